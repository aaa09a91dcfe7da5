"""nvImageCodec backends on 500x375 JPEGs: hardware engines alone, CUDA, hybrid (img/s).

Needs the `[nvimgcodec]` extra.

    PYTHONPATH=src python benchmarks/nvimgcodec_probe.py
"""

from __future__ import annotations

import time

import torch

from gpufeed.synth import encode_jpegs, natural_images


def main() -> None:
    from nvidia import nvimgcodec

    datas = encode_jpegs(natural_images(64), 90)
    datas *= 4
    kinds = {"hardware only": nvimgcodec.BackendKind.HW_GPU_ONLY, "CUDA only": nvimgcodec.BackendKind.GPU_ONLY,
             "hybrid CPU+GPU": nvimgcodec.BackendKind.HYBRID_CPU_GPU}
    for name, kind in kinds.items():
        try:
            decoder = nvimgcodec.Decoder(backends=[nvimgcodec.Backend(kind)])
            decoder.decode(datas)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(8):
                images = [torch.as_tensor(o, device="cuda") for o in decoder.decode(datas)]
            torch.cuda.synchronize()
            rate = len(datas) * 8 / (time.perf_counter() - t0)
            print(f"{name:16s} {rate:9.0f} img/s  {tuple(images[0].shape)} {images[0].dtype}")
        except Exception as e:  # a backend this GPU or build lacks
            print(f"{name:16s} unavailable: {e!r:.200}")


if __name__ == "__main__":
    main()
