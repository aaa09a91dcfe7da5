"""Two decoders through nvImageCodec (optional: `pip install 'gpufeed[nvimgcodec-cu13]'`, or `-cu12`
to match torch's CUDA; imported only when a loader asks for one):

- `hw`: the GPU's hardware JPEG engines (NVJPG on A100/H100/H200) alone;
- `cuda`: nvJPEG's hybrid decoder, Huffman on nvImageCodec's own CPU threads and the rest on CUDA
  cores. It is the one GPU decoder that leaves the engines free: on Hopper, torchvision's batched
  `decode_jpeg(device="cuda")` (the `nvjpeg` decoder) shares the engines with `hw`
  (docs/benchmarks.md, "One GPU decoder").

Region-of-interest decode is slower than whole images on both
(docs/benchmarks.md, "Kernels, copies and CPU decoding"), so the loader decodes whole images and
crops in its resize kernel.

A batch decodes through nvImageCodec's C API (`nvimgcodec_api`) into one device buffer, decoded
into again once the kernels reading it ran (a fresh buffer per batch, of another size each time,
left torch's allocator holding more device memory). Its Python binding would take the GIL back
about three times per image, each time waiting for the training thread; it would also allocate and
free device memory for every Image it makes
(both: docs/benchmarks.md, "nvImageCodec through its C API").
"""

from __future__ import annotations

import numpy as np
import torch

from gpufeed.decode.base import CUT_SHORT, YCC420, Decoded, Encoded, PinnedStaging, hwc_strides
from gpufeed.decode.codecs.nvimgcodec_api import BatchDecoder

MAX_IMAGE_BYTES = 1 << 30  # a header that claims more (a damaged or hostile file) is refused, not allocated


class NvImgCodecDecoder:
    """Batched decode with one nvImageCodec backend; images it refuses are reported as failed."""

    def __init__(
        self,
        device: torch.device,
        name: str = "hw",
        cpu_threads: int = 4,
        room: tuple[int, int, int] | None = None,
        padding: int = 32 << 20,
    ):
        """`room`: the batches the decoder makes its buffers for at once; `padding`: what nvJPEG rounds
        its allocations up to (`BatchDecoder`)."""
        self.name, self.device = name, device
        self._batches = BatchDecoder(name, device.index or 0, cpu_threads, room, padding)
        # YCbCr 4:2:0 images as their planes, for a consumer whose kernel converts them (`base.YCC420`):
        # the engines then run no colour conversion or upsampling kernel per image
        # (docs/benchmarks.md, "YCbCr planes into the resize kernel")
        self.planar = False
        self.buffers = PinnedStaging(alloc=lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device))

    def keep_for_process(self) -> None:
        """Never destroy this decoder, idle from now on (`choice.keep_idle`): the process's exit reclaims
        it, as it does nvImageCodec's instance (destroyed at the interpreter's shutdown, it could run
        after CUDA's own teardown); its output buffers are let go."""
        self.buffers.drain()  # (each once the kernels reading it have run; raises after a CUDA error)
        self._batches.kept = True

    def taken_back(self) -> None:
        """In use again after `keep_for_process`, by one pipeline (`choice._taken_back`): destroyed
        when that pipeline lets it go, unless kept once more."""
        self._batches.kept = False

    def decode(self, batch: Encoded, shapes: np.ndarray | None = None) -> Decoded:
        """Decode on the current CUDA stream into one buffer: HWC RGB, or with `planar` the 4:2:0
        photos' YCbCr planes. (`shapes`, the sizes the store records, are not trusted: each image's
        header says its own, checked against `MAX_IMAGE_BYTES`.)"""
        native, batch = self._batches, batch.readable()
        sizes, ok = native.read(batch.array, batch.begins, batch.ends)
        big = sizes[:, 0] * sizes[:, 1] * 3 > MAX_IMAGE_BYTES
        cut = batch.cut_short()
        ok &= ~big & ~cut
        planar = native.ycc420(len(sizes)) & ok if self.planar else np.zeros(len(sizes), bool)
        offsets, total = native.layout(np.where(ok, native.nbytes(sizes, planar), 0))
        out = self.buffers.take(max(total, 1))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        done = native.decode(sizes, ok, out.data_ptr(), offsets, stream, planar)
        failed = {}
        for k in np.flatnonzero(~done).tolist():  # rare: a loop is fine
            h, w = sizes[k].tolist()
            failed[k] = (
                f"its header claims {h}x{w} pixels, over the {MAX_IMAGE_BYTES >> 20} MiB gpufeed decodes"
                if big[k]
                else CUT_SHORT
                if cut[k]
                else f"nvImageCodec ({self.name}) could not read its header"
                if not ok[k]
                else f"nvImageCodec ({self.name}) refused it"
            )
        strides = hwc_strides(sizes)
        strides[planar, 0], strides[planar, 1], strides[planar, 2] = YCC420, sizes[planar, 1], 1
        return Decoded(
            out,
            offsets[done],
            sizes[done],
            strides[done],
            [out],
            failed,
            on_done=lambda event: self.buffers.give_back(out, event),
        )
