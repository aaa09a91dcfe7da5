"""torchvision's image codecs (torchvision.io) are deprecated since 0.29 and may go: a jpeg store's
`store[i]` and the CPU decoders work without them, and the nvJPEG decoder, the one left on them, says
it is unavailable instead of failing a loader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpufeed
from conftest import save, smooth
from gpufeed.decode.codecs import cpu, nvjpeg
from gpufeed.doctor import doctor


@pytest.fixture(scope="module")
def jpeg_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("tvio")
    for i, (h, w) in enumerate([(40, 60), (64, 48), (33, 33), (90, 120)] * 2):
        save(root / "src" / f"c{i % 2}" / f"{i:03d}.png", smooth(i, h, w))
    gpufeed.pack(root / "src", root / "store", mode="jpeg", quality=95, workers=1, progress=False)
    return root / "store"


@pytest.mark.parametrize("hide_nvimgcodec", [False, True], ids=["nvimgcodec", "pillow"])
def test_store_items_and_cpu_threads_decode_without_torchvision(jpeg_store, hide_nvimgcodec):
    """In a process where torchvision can't be imported at all, `store[i]` and the CPU thread decoder
    give Pillow's pixels: by nvImageCodec's CPU backend where installed, else by Pillow."""
    code = f"""
import sys
sys.modules["torchvision"] = None  # `import torchvision` raises ImportError from here on
if {hide_nvimgcodec}:
    sys.modules["nvidia.nvimgcodec"] = None
sys.path.insert(0, {str(Path(__file__).parent)!r})
import numpy as np, torch, gpufeed
from conftest import decoded
from gpufeed.decode.codecs import cpu
from gpufeed.decode.base import Encoded, as_tensor

store = gpufeed.open({str(jpeg_store)!r})
assert all(torch.equal(store[i][0], decoded(store.encoded(i))) for i in range(len(store)))
batch = Encoded.of(as_tensor(store.data), np.asarray(store.offsets), np.arange(len(store)))
pool = cpu.CpuDecoder(2)
part = pool.collect(pool.submit(batch, np.asarray(store.shapes)), torch.device("cpu"), pin=False)
pool.close()
assert not part.failed and part.sizes.tolist() == np.asarray(store.shapes).tolist()
images = [part.base.as_strided((3, h, w), tuple(s), int(o))
          for (h, w), s, o in zip(part.sizes.tolist(), part.strides.tolist(), part.offsets.tolist())]
assert all(torch.equal(image, decoded(store.encoded(i))) for i, image in enumerate(images))
print(cpu.whole_by_nvimgcodec())  # which decoded the whole images
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(cpu.roi_available() and not hide_nvimgcodec)


def test_nvjpeg_without_torchvision_decode_jpeg_says_so(monkeypatch):
    """As torchvision would be after removing its codecs: the decoder can't be made, with the reason
    and the fix, and `gpufeed doctor` lists the decoders without it."""
    import torchvision.io

    assert nvjpeg.problem() is None  # the torchvision tested here still has it
    monkeypatch.delattr(torchvision.io, "decode_jpeg")
    why = nvjpeg.problem()
    assert why.startswith("nvJPEG through torchvision is unavailable: torchvision ") and "has no" in why
    assert "pip install" in why
    with pytest.raises(ImportError, match="nvJPEG through torchvision is unavailable"):
        nvjpeg.NvJpegDecoder(torch.device("cuda"))
    line = doctor._jpeg_decoders()
    assert "nvJPEG +" not in line and why in line and line.startswith("jpeg decoders available: ")
