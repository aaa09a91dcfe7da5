"""nvImageCodec on 500x375 q90 JPEGs, batch 256 (img/s): each backend alone, several backends in one
call (the library splits the batch by load hint), region-of-interest decode, and two calls at once.

Needs the `[nvimgcodec]` extra.

    PYTHONPATH=src python benchmarks/nvimgcodec_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch

from gpufeed.synth import encode_jpegs, natural_images


def rrc_regions(count: int, h: int = 375, w: int = 500, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """RandomResizedCrop-like boxes (scale 0.08-1, ratio 3/4-4/3), as (y0, x0, y1, x1)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        for _ in range(10):
            area = h * w * rng.uniform(0.08, 1.0)
            ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            cw, ch = int(round((area * ratio) ** 0.5)), int(round((area / ratio) ** 0.5))
            if 0 < cw <= w and 0 < ch <= h:
                y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
                out.append((y, x, y + ch, x + cw))
                break
        else:
            out.append((0, 0, h, w))
    return out


def main() -> None:
    from nvidia import nvimgcodec as nv

    p = argparse.ArgumentParser()
    p.add_argument("--distinct", type=int, default=256)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--out", default="nvimgcodec_probe.json")
    a = p.parse_args()
    datas = encode_jpegs(natural_images(a.distinct), 90) * (a.batch * 4 // a.distinct)
    arrays = [np.frombuffer(d, np.uint8) for d in datas]
    regions = rrc_regions(len(datas))
    K, P = nv.BackendKind, nv.LoadHintPolicy

    def backend(kind, hint=1.0, policy=P.FIXED):
        return nv.Backend(kind, load_hint=hint, load_hint_policy=policy)

    def batches(roi: bool):
        n = len(arrays)
        for b in range(a.batches):
            lo = (b * a.batch) % n
            part = arrays[lo:lo + a.batch]
            if roi:
                part = [nv.CodeStream(x).get_sub_code_stream(region=nv.Region(*regions[lo + k]))
                        for k, x in enumerate(part)]
            yield part

    def run(decoder, roi: bool, stream: torch.cuda.Stream) -> float:
        with torch.cuda.stream(stream):
            for part in batches(roi):
                out = decoder.decode(part, cuda_stream=stream.cuda_stream)
                assert all(o is not None for o in out)
            stream.synchronize()
        return a.batches * a.batch

    def rate(make, roi=False, concurrent=1, repeats=3) -> dict:
        decoders = [make() for _ in range(concurrent)]
        streams = [torch.cuda.Stream() for _ in decoders]
        for d, s in zip(decoders, streams):
            run(d, roi, s)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            threads = [threading.Thread(target=run, args=(d, roi, s)) for d, s in zip(decoders, streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rates.append(concurrent * a.batches * a.batch / (time.perf_counter() - t0))
        return {"img_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}

    cpus = 16
    configs = {
        "hw only": lambda: nv.Decoder(backends=[backend(K.HW_GPU_ONLY)]),
        "cuda only": lambda: nv.Decoder(backends=[backend(K.GPU_ONLY)]),
        "hybrid only": lambda: nv.Decoder(backends=[backend(K.HYBRID_CPU_GPU)]),
        "cpu only (16 threads)": lambda: nv.Decoder(max_num_cpu_threads=cpus, backends=[backend(K.CPU_ONLY)]),
        "hw 0.5 + cuda (fixed)": lambda: nv.Decoder(backends=[backend(K.HW_GPU_ONLY, 0.5), backend(K.GPU_ONLY)]),
        "hw 0.6 + cuda (fixed)": lambda: nv.Decoder(backends=[backend(K.HW_GPU_ONLY, 0.6), backend(K.GPU_ONLY)]),
        "hw + cuda (adaptive)": lambda: nv.Decoder(backends=[backend(K.HW_GPU_ONLY, 0.5, P.ADAPTIVE_MINIMIZE_IDLE_TIME),
                                                             backend(K.GPU_ONLY)]),
        "hw + hybrid (adaptive)": lambda: nv.Decoder(backends=[
            backend(K.HW_GPU_ONLY, 0.5, P.ADAPTIVE_MINIMIZE_IDLE_TIME), backend(K.HYBRID_CPU_GPU)]),
        "hw + cuda + cpu (adaptive)": lambda: nv.Decoder(max_num_cpu_threads=cpus, backends=[
            backend(K.HW_GPU_ONLY, 0.5, P.ADAPTIVE_MINIMIZE_IDLE_TIME),
            backend(K.GPU_ONLY, 0.7, P.ADAPTIVE_MINIMIZE_IDLE_TIME), backend(K.CPU_ONLY)]),
    }
    out = {"gpu": torch.cuda.get_device_name(), "nvimgcodec": nv.__version__, "rows": {}}
    for name, make in configs.items():
        for roi in (False, True):
            for conc in (1, 2):
                key = f"{name}{', ROI' if roi else ''}{', 2 threads' if conc == 2 else ''}"
                try:
                    out["rows"][key] = rate(make, roi, conc)
                except Exception as e:  # a backend this GPU or build lacks
                    out["rows"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                r = out["rows"][key]
                print(f"{key:48s} " + (f"{r['img_per_s']:9.0f} img/s ({r['min']:.0f}-{r['max']:.0f})"
                                       if "error" not in r else r["error"]), flush=True)
    t0 = time.perf_counter()
    for part in batches(True):
        pass
    out["codestream_roi_us_per_image"] = (time.perf_counter() - t0) / (a.batches * a.batch) * 1e6
    print(f"CodeStream + ROI sub-stream in Python: {out['codestream_roi_us_per_image']:.1f} us/image")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
