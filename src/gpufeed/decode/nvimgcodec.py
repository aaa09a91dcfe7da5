"""Two decoders through nvImageCodec (optional: `pip install 'gpufeed[nvimgcodec-cu13]'`, or `-cu12`
to match torch's CUDA; imported only when a loader asks for one):

- `hw`: the GPU's hardware JPEG engines (NVJPG on A100/H100/H200) alone;
- `cuda`: nvJPEG's hybrid decoder, Huffman on nvImageCodec's own CPU threads and the rest on CUDA
  cores. It is the one GPU decoder that leaves the engines free: on Hopper, torchvision's batched
  `decode_jpeg(device="cuda")` (the `nvjpeg` decoder) shares the engines with `hw`
  (`benchmarks/gpu_decoders_probe.py`).

Region-of-interest decode is slower than whole images on both (`benchmarks/nvimgcodec_probe.py`,
docs/benchmarks.md), so the loader decodes whole images and crops in its resize kernel.

The decoded Images are decoded into again once the kernels reading them ran (`ReusedImages`):
a fresh Image per decode allocates device memory and frees it when dropped, and beside a training
loop those allocations and frees waited for the model's queued work (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import numpy as np
import torch

from gpufeed.decode.base import Decoded, Encoded, in_place
from gpufeed.decode.pixels import nvimgcodec

log = logging.getLogger(__name__)


load = nvimgcodec  # the module, imported once (see `pixels.nvimgcodec`)


# Images larger than this (bytes) are not kept for reuse: every pooled buffer would grow to the
# largest image it ever held
REUSE_MAX_BYTES = 16 << 20
REUSE = True  # False: a fresh Image per decode, as before (benchmarks/train_bench.py compares the two)


class ReusedImages:
    """Decoded Images handed back with an event recorded after the kernels that read them; `take`
    gives out those whose event completed, to be decoded into again. Thread-safe."""

    def __init__(self, max_bytes: int = REUSE_MAX_BYTES):
        self.max_bytes = max_bytes
        self._free: list = []
        self._busy: deque = deque()  # (event, images)
        self._lock = threading.Lock()

    def take(self, n: int) -> list | None:
        """`n` Images to decode into, or None when fewer are free (the decoder then makes new ones)."""
        with self._lock:
            while self._busy and self._busy[0][0].query():
                self._free += self._busy.popleft()[1]
            if n == 0 or len(self._free) < n:
                return None
            taken, self._free = self._free[-n:], self._free[:-n]
            return taken

    def give_back(self, images: list, nbytes: list[int], done) -> None:
        """`images` (of `nbytes` each) may be decoded into again once `done` has completed."""
        keep = [im for im, size in zip(images, nbytes) if size <= self.max_bytes]
        with self._lock:
            self._busy.append((done, keep))


class NvImgCodecDecoder:
    """Batched decode with one nvImageCodec backend; images it refuses are reported as failed."""

    def __init__(self, device: torch.device, name: str = "hw", cpu_threads: int = 4):
        nvimgcodec = load()
        kinds = {"hw": nvimgcodec.BackendKind.HW_GPU_ONLY, "cuda": nvimgcodec.BackendKind.HYBRID_CPU_GPU}
        self.name, self.device = name, device
        self._decoder = nvimgcodec.Decoder(device_id=device.index or 0, max_num_cpu_threads=cpu_threads,
                                           backends=[nvimgcodec.Backend(kinds[name])])
        self.reused = ReusedImages()

    def decode(self, batch: Encoded, shapes: np.ndarray | None = None) -> Decoded:
        """Decode on the current CUDA stream; images stay where the decoder put them (HWC, read as CHW).
        (`shapes`, the sizes the store records, are not needed: each Image says its own.)

        Addresses come from each image's CUDA array interface: one tensor is made for the base
        pointer, not one per image (a torch.as_tensor per image was a visible share of the batch)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        into = self.reused.take(len(batch)) if REUSE else None
        if into is None:
            results = self._decoder.decode(batch.arrays(), cuda_stream=stream)
        else:
            results = self._decoder.decode(batch.arrays(), images=into, cuda_stream=stream)
        kept, ptrs, sizes, strides, failed = [], [], [], [], {}
        for k, r in enumerate(results):
            if r is None:
                failed[k] = f"nvImageCodec ({self.name}) refused it"
                continue
            face = r.__cuda_array_interface__
            h, w, c = face["shape"]
            sy, sx, sc = face["strides"] or (w * c, c, 1)
            kept.append(r)
            ptrs.append(face["data"][0])
            sizes.append((h, w))
            strides.append((sc, sy, sx))
        if not kept:
            return in_place([], failed)
        base = torch.as_tensor(kept[0], device=self.device)
        offsets = np.array(ptrs, np.int64)
        nbytes = [h * w * 3 for h, w in sizes]
        return Decoded(base, offsets - offsets[0], np.array(sizes, np.int64), np.array(strides, np.int64), kept, failed,
                       on_done=lambda done: self.reused.give_back(kept, nbytes, done))
