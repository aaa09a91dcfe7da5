"""GPU JPEG decoders alone and side by side (each in its own thread and stream), on 500x375 q90
JPEGs in batches of 256: which ones share a resource, what each costs the host in CPU.

Decoders: `nvjpeg` (torchvision batched decode_jpeg), and through nvImageCodec `hw` (hardware
engines), `hybrid` (Huffman on CPU threads), `hybrid0` (the same decoder told to do Huffman on the
GPU for every image: hybrid_huffman_threshold=0) and `gpu` (backend GPU_ONLY). A row joins names
with "+"; a name twice means two instances.

    PYTHONPATH=src python benchmarks/gpu_decoders_probe.py --rows "hw,nvjpeg,hw+nvjpeg,hw+hybrid0"

With `--processes N`, N processes run each row at once, as the loader's pipeline processes do: the
rate is their images over the time from the first start to the last finish.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import threading
import time

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from gpufeed.synth import encode_jpegs, natural_images


def factories(threads: int) -> dict:
    """name -> () -> decode(list of uint8 CPU tensors, stream) -> decoded images (on the GPU)."""
    def nvimg(kind: str, options: str = ""):
        from nvidia import nvimgcodec as nv

        dec = nv.Decoder(max_num_cpu_threads=threads, backends=[nv.Backend(getattr(nv.BackendKind, kind))],
                         options=options)

        def decode(datas, stream):
            out = dec.decode([d.numpy() for d in datas], cuda_stream=stream.cuda_stream)
            if any(o is None for o in out):
                raise RuntimeError(f"nvImageCodec {kind} {options!r} refused an image")
            return out
        return decode

    return {
        "nvjpeg": lambda: lambda datas, stream: decode_jpeg(datas, mode=ImageReadMode.RGB, device="cuda"),
        "hw": lambda: nvimg("HW_GPU_ONLY"),
        "hybrid": lambda: nvimg("HYBRID_CPU_GPU"),
        "hybrid0": lambda: nvimg("HYBRID_CPU_GPU", "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"),
        "gpu": lambda: nvimg("GPU_ONLY"),
    }


def measure(decoders: list, tensors: list[torch.Tensor], batch: int, batches: int) -> dict:
    """Every decoder decodes `batches` batches at once, each in its own thread and stream."""
    streams = [torch.cuda.Stream() for _ in decoders]
    seconds = [0.0] * len(decoders)

    def run(k: int) -> None:
        t0 = time.perf_counter()
        with torch.cuda.stream(streams[k]):
            for b in range(batches):
                lo = ((b * len(decoders) + k) * batch) % (len(tensors) - batch)
                decoders[k](tensors[lo:lo + batch], streams[k])
            streams[k].synchronize()
        seconds[k] = time.perf_counter() - t0

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(decoders))]
    c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    return {"img_per_s": len(decoders) * batches * batch / wall, "cpu_cores": cpu / wall,
            "each_img_per_s": [batches * batch / s for s in seconds]}


def _inputs() -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in encode_jpegs(natural_images(256), 90)] * 8


def _child(row: str, a: argparse.Namespace, barrier, results) -> None:
    """One of `--processes`: warm up, then measure each repeat when all are ready."""
    try:
        make, tensors = factories(a.cpu_threads), _inputs()
        decoders = [make[name]() for name in row.split("+")]
        measure(decoders, tensors, a.batch, 2)
        for _ in range(a.repeats):
            barrier.wait(timeout=600)
            t0 = time.time()
            r = measure(decoders, tensors, a.batch, a.batches)
            results.put((t0, time.time(), len(decoders) * a.batch * a.batches, r["cpu_cores"]))
    except Exception as e:  # the others must not wait for this one
        barrier.abort()
        results.put(f"{type(e).__name__}: {e}")


def in_processes(row: str, a: argparse.Namespace) -> list[dict]:
    """`row` in `a.processes` processes at once, per repeat: images/s over the common window, cores summed."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(a.processes), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(row, a, barrier, results)) for _ in range(a.processes)]
    for proc in procs:
        proc.start()
    runs = []
    for _ in range(a.repeats):
        got = [results.get(timeout=600) for _ in procs]
        if any(isinstance(g, str) for g in got):
            for proc in procs:
                proc.terminate()
            raise RuntimeError(next(g for g in got if isinstance(g, str)))
        wall = max(g[1] for g in got) - min(g[0] for g in got)
        runs.append({"img_per_s": sum(g[2] for g in got) / wall, "cpu_cores": sum(g[3] for g in got),
                     "each_img_per_s": [g[2] / (g[1] - g[0]) for g in got]})
    for proc in procs:
        proc.join()
    return runs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="nvjpeg,hw,hybrid,hybrid0,gpu,hw+hw,hw+nvjpeg,hw+hybrid0,hw+gpu,"
                                     "nvjpeg+hybrid0,hw+nvjpeg+hybrid0,hybrid0+hybrid0")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-threads", type=int, default=4, help="nvImageCodec's CPU threads per decoder")
    p.add_argument("--processes", type=int, default=1, help="run each row in this many processes at once")
    p.add_argument("--out", default="gpu_decoders_probe.json")
    a = p.parse_args()
    if a.processes < 1:
        p.error(f"--processes must be 1 or more, got {a.processes}")
    make = factories(a.cpu_threads)
    unknown = sorted({name for row in a.rows.split(",") for name in row.split("+")} - set(make))
    if unknown:
        p.error(f"--rows: unknown decoder(s) {', '.join(unknown)}; choose from {', '.join(make)}")
    tensors = _inputs() if a.processes == 1 else None
    out = {"gpu": torch.cuda.get_device_name(), "processes": a.processes, "rows": {}}
    for row in a.rows.split(","):
        try:
            if a.processes > 1:
                runs = in_processes(row, a)
            else:
                decoders = [make[name]() for name in row.split("+")]
                measure(decoders, tensors, a.batch, 2)  # warm-up: allocations, plans, kernels
                runs = [measure(decoders, tensors, a.batch, a.batches) for _ in range(a.repeats)]
            r = {"img_per_s": statistics.median(x["img_per_s"] for x in runs),
                 "min": min(x["img_per_s"] for x in runs), "max": max(x["img_per_s"] for x in runs),
                 "cpu_cores": statistics.median(x["cpu_cores"] for x in runs),
                 "each_img_per_s": [round(statistics.median(x["each_img_per_s"][k] for x in runs))
                                    for k in range(len(runs[0]["each_img_per_s"]))]}
            print(f"{row:24s} {r['img_per_s']:8.0f} img/s ({r['min']:.0f}-{r['max']:.0f}) "
                  f"{r['cpu_cores']:4.1f} cores, each {r['each_img_per_s']}", flush=True)
        except Exception as e:  # a backend or option this GPU or build lacks
            r = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{row:24s} {r['error']}", flush=True)
        out["rows"][row] = r
        torch.cuda.synchronize()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
