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
        """Decode on the current CUDA stream; images stay where the decoder put them (HWC, as CHW views)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        results = self._decoder.decode([d.numpy() for d in datas], cuda_stream=stream)
        images, failed = [], {}
        for k, r in enumerate(results):
            if r is None:
                failed[k] = "hardware JPEG decoder refused it"
            else:
                images.append(torch.as_tensor(r, device=self.device).permute(2, 0, 1))
        return in_place(images, failed)
