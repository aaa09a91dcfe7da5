"""The GPU's hardware JPEG engines (NVJPG on A100/H100/H200) through nvImageCodec.

Optional (`pip install gpufeed[nvimgcodec]`), imported only when a loader asks for it. The
engines use neither CUDA cores nor much CPU, so they add to nvJPEG and the CPU threads
(measured on an H200, 500x375 JPEGs: 23.6k img/s on their own).
"""

from __future__ import annotations

import torch

from gpufeed.decode.base import Decoded, in_place


class HwJpegDecoder:
    """Batched hardware-only decode; images the engines refuse are reported as failed."""

    name = "hw"

    def __init__(self, device: torch.device):
        from nvidia import nvimgcodec  # ImportError when the extra is not installed

        self.device = device
        backend = nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)
        self._decoder = nvimgcodec.Decoder(device_id=device.index or 0, backends=[backend])

    def decode(self, datas: list[torch.Tensor]) -> Decoded:
        """Decode on the current CUDA stream; images stay where the decoder put them (HWC, read as CHW).

        Addresses come from each image's CUDA array interface: one tensor is made for the base
        pointer, not one per image (a torch.as_tensor per image was a visible share of the batch)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        results = self._decoder.decode([d.numpy() for d in datas], cuda_stream=stream)
        kept, ptrs, sizes, strides, failed = [], [], [], [], {}
        for k, r in enumerate(results):
            if r is None:
                failed[k] = "hardware JPEG decoder refused it"
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
        offsets = torch.tensor(ptrs, dtype=torch.int64) - ptrs[0]
        return Decoded(base, offsets, torch.tensor(sizes, dtype=torch.int32), torch.tensor(strides, dtype=torch.int64),
                       kept, failed)
