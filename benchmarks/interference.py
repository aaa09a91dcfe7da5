"""Which piece of JPEG loading slows a training loop in the same process? Synthetic-data training
with one background thread doing one piece of a loader's per-batch work, paced to the rate the model
consumes batches (`--rate` per second), so the only difference between rows is that piece.
`h2dN` copies N MB from page-locked memory to the GPU per tick (the CPU workers' pixels going up).
`kernelsN` runs N small kernels per tick (an elementwise op over one decoded image's bytes, as a
decoder's colour conversion per image) captured in one CUDA graph: what many small kernels of
another stream cost the model's, with no launches or Python; `opsN` launches the same N ops from
Python. `gilN` lets go of the GIL and takes it back N times per tick (`time.sleep(0)`), nothing
else: what a library that does so per image (nvImageCodec's Python binding, three times) costs the
training thread. `capi_hw`, `capi_cuda`: 128 images per tick through nvImageCodec's C API (the
library's decoder) into one reused buffer, `capi_hw_420` with the 4:2:0 photos as their planes.
`cpu_procsN` instead starts N processes that decode JPEGs with PIL as fast as they can (no GPU):
what CPU decode workers' load alone costs the training thread on the host. `proc_KIND` runs KIND
in a process of its own, with its own CUDA context: the same GPU work without the training process's
threads, locks and GIL.

    PYTHONPATH=src python benchmarks/train_bench.py --rows "synthetic;interfere:tv_nvjpeg;..." --models resnet18
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

KINDS = ("none", "tv_nvjpeg", "tv_nvjpeg_ptrs", "nvimg_hw", "nvimg_hw_ptrs", "capi_hw", "capi_cuda", "capi_hw_420",
         "resize", "cpu_tv_threads",
         "pyloop_1ms", "pyloop_3ms", "pyslices_NxUS", "pipe_recv", "cpu_procsN", "h2dN", "kernelsN", "opsN",
         "gilN", "proc_KIND")

# a CPU decode process for `cpu_procsN`: decodes one file over and over until its parent is gone
_DECODER = """import io, os, sys
from PIL import Image
data, parent = open(sys.argv[1], "rb").read(), os.getppid()
while os.getppid() == parent:
    for _ in range(20):
        Image.open(io.BytesIO(data)).convert("RGB").load()
"""


# `proc_KIND`: KIND's paced thread in a process of its own (exec'd), until this process ends
_IN_A_PROCESS = """import os, sys, time
sys.path.insert(0, sys.argv[1])
import interference
parent = os.getppid()
interference.start(sys.argv[2], rate=float(sys.argv[3]))
while not interference.COUNTS["ticks"]:
    time.sleep(0.01)
print("ready", flush=True)
while os.getppid() == parent:
    time.sleep(0.2)
print(sys.argv[2], interference.COUNTS, file=sys.stderr, flush=True)  # its ticks, into the row's error output
os._exit(0)  # not Python's finalization under a daemon thread in the middle of a decode
"""


COUNTS = {"ticks": 0, "work_seconds": 0.0}  # the paced thread's ticks and its time in `work`


def start(kind: str, rate: float = 50.0, images: int = 128) -> threading.Thread | list:
    """Run `kind` `rate` times a second on a daemon thread (`cpu_procsN`: start the processes)."""
    from gpufeed.synth import encode_jpegs, natural_images

    data = encode_jpegs(natural_images(64))
    if kind.startswith("cpu_procs"):
        return _processes(int(kind[len("cpu_procs"):]), data[0])
    if kind.startswith("proc_"):  # the same work in a process of its own, with its own CUDA context
        import subprocess
        import sys
        from pathlib import Path

        proc = subprocess.Popen([sys.executable, "-c", _IN_A_PROCESS, str(Path(__file__).parent), kind[5:], str(rate)],
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # its first tick done: the row's steps are timed with it running
        return [proc]
    data = [data[k % 64] for k in range(images)]
    arrays = [np.frombuffer(d, np.uint8) for d in data]
    pinned = torch.empty(sum(len(d) for d in data), dtype=torch.uint8).pin_memory()
    bounds = np.cumsum([0] + [len(d) for d in data])
    for k, d in enumerate(data):
        pinned[bounds[k]:bounds[k + 1]] = torch.frombuffer(bytearray(d), dtype=torch.uint8)
    stream = torch.cuda.Stream()
    work = _work(kind, arrays, pinned, bounds, stream)

    def loop():
        for _ in paced(rate):
            w0 = time.perf_counter()
            with torch.cuda.stream(stream):
                work()
            COUNTS["ticks"] += 1
            COUNTS["work_seconds"] += time.perf_counter() - w0

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    return th


def paced(rate: float):
    """Yield `rate` times a second, forever: each tick at its time, or at once when the one before
    ran late (no catching up)."""
    period, t = 1.0 / rate, time.perf_counter()
    while True:
        yield
        t += period
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        else:
            t = time.perf_counter()


def _processes(count: int, jpeg: bytes) -> list:
    """`count` decode processes (exec'd, each ends when this process does)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".jpg", delete=False) as f:
        f.write(jpeg)
    return [subprocess.Popen([sys.executable, "-c", _DECODER, f.name]) for _ in range(count)]


def _work(kind, arrays, pinned, bounds, stream):
    from torchvision.io import decode_jpeg

    if kind == "none":
        return lambda: None
    if kind.startswith("tv_nvjpeg"):
        def f():
            tensors = [pinned[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
            out = decode_jpeg(tensors, device="cuda")
            if kind.endswith("ptrs"):
                [(t.data_ptr(), t.shape, t.stride()) for t in out]
            stream.synchronize()
        return f
    if kind.startswith("nvimg"):
        from gpufeed.decode.pixels import nvimgcodec as load

        nv = load()
        dec = nv.Decoder(device_id=0, max_num_cpu_threads=4, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)])

        def f():
            res = dec.decode(arrays, cuda_stream=stream.cuda_stream)
            if kind.endswith("ptrs"):
                [r.__cuda_array_interface__ for r in res]
            stream.synchronize()
        return f
    if kind.startswith("capi"):  # the library's decoder: nvImageCodec's C API, into one buffer reused
        from gpufeed.decode.base import Encoded
        from gpufeed.decode.nvimgcodec import NvImgCodecDecoder

        dec = NvImgCodecDecoder(torch.device("cuda", torch.cuda.current_device()), kind.split("_")[1], 4)
        dec.planar = kind.endswith("_420")  # YCbCr 4:2:0 planes out: no colour conversion or upsampling
        batch = Encoded.joined(arrays)

        def f():
            part = dec.decode(batch)  # on the current stream: the tick's
            part.on_done(stream.record_event())  # its buffer is decoded into again once this tick is done
            stream.synchronize()
            COUNTS["decoded"] = COUNTS.get("decoded", 0) + len(part.sizes)
        return f
    if kind.startswith("h2d"):
        host = torch.empty(int(float(kind[3:]) * 2**20), dtype=torch.uint8).pin_memory()
        device = torch.empty_like(host, device="cuda")
        return lambda: (device.copy_(host, non_blocking=True), stream.synchronize())
    if kind == "resize":
        from gpufeed.augment import fused

        src = torch.randint(0, 255, (256 * 375 * 500 * 3,), dtype=torch.uint8, device="cuda")
        n = 256
        offsets = torch.arange(n, device="cuda") * (375 * 500 * 3)
        sizes = torch.tensor([[375, 500]] * n, device="cuda")
        strides = torch.tensor([[1, 1500, 3]] * n, device="cuda")
        rows = torch.arange(n, device="cuda")
        boxes = torch.tensor([[10.0, 10.0, 300.0, 300.0]] * n, device="cuda").view(-1)
        flip = torch.zeros(n, device="cuda")
        out = torch.empty((n, 3, 224, 224), dtype=torch.float16, device="cuda")
        scale = torch.ones(3, device="cuda")
        shift = torch.zeros(3, device="cuda")
        return lambda: (fused.resample_packed(src, offsets, sizes, strides, rows, boxes, flip, out, scale, shift),
                        stream.synchronize())
    if kind.startswith("kernels") or kind.startswith("ops"):  # N small kernels per tick on the side stream,
        graphed = kind.startswith("kernels")  # one CUDA graph launch for all (the GPU's side alone), or N ops
        count = int(kind[len("kernels") if graphed else len("ops"):])  # from Python (launches and GIL too)
        image = torch.zeros(375 * 500 * 3, dtype=torch.uint8, device="cuda")  # what one image's conversion writes

        def ops():
            for _ in range(count):
                image.add_(1)
        if not graphed:
            return lambda: (ops(), stream.synchronize())
        with torch.cuda.stream(stream):
            ops()  # warm up before capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                ops()
        return lambda: (graph.replay(), stream.synchronize())
    if kind.startswith("gil"):
        count = int(kind[3:])

        def f():
            for _ in range(count):
                time.sleep(0)
        return f
    if kind == "cpu_tv_threads":
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(4)
        tensors = [torch.from_numpy(a.copy()) for a in arrays[:32]]
        return lambda: list(pool.map(decode_jpeg, tensors))
    if kind.startswith("pyloop"):
        ms = float(kind[7:-2]) / 1e3

        def f():
            t = time.perf_counter()
            while time.perf_counter() - t < ms:
                sum(range(100))
        return f
    if kind.startswith("pyslices"):  # pyslices_NxUS: N stretches of US microseconds of Python, each after a short sleep
        count, us = (int(x) for x in kind[len("pyslices_"):].split("x"))

        def f():
            for _ in range(count):
                time.sleep(20e-6)  # blocks: the GIL is taken again after, as a loader thread's wake-up does
                t = time.perf_counter()
                while time.perf_counter() - t < us / 1e6:
                    sum(range(20))
        return f
    if kind == "pipe_recv":
        import multiprocessing

        a, b = multiprocessing.Pipe()
        msg = {"begins": np.arange(256), "ends": np.arange(256), "boxes": np.zeros((256, 4)), "sizes": np.zeros((256, 2))}

        def f():
            b.send(msg)
            a.recv()
        return f
    raise SystemExit(f"unknown interference {kind!r}: {KINDS}")
