"""nvImageCodec's C API through ctypes (`gpufeed.decode.codecs.nvimgcodec_api`), on its CPU backend: the
structures as the 0.9 header lays them out (`nvimgcodec_header`), and a batch decoded into one
buffer as Pillow decodes it, bad images reported and the rest decoded, the handles made again into
from batch to batch."""

from __future__ import annotations

import ctypes as C
import importlib.util
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import claiming
from gpufeed.decode.codecs import nvimgcodec_api as api
from gpufeed.decode.codecs import nvimgcodec_header as header
from gpufeed.synth import encode_jpegs, natural_images


def test_structures_are_laid_out_as_the_header_says():
    # sizes and offsets from gcc's sizeof/offsetof on nvImageCodec 0.9's include/nvimgcodec.h
    assert C.sizeof(header.ImageInfo) == 2160 and C.sizeof(header.PlaneInfo) == 56
    info = header.ImageInfo
    assert (info.orientation.offset, info.num_planes.offset, info.plane_info.offset, info.buffer.offset,
            info.buffer_kind.offset, info.cuda_stream.offset) == (296, 336, 344, 2136, 2144, 2152)
    assert (header.PlaneInfo.row_stride.offset, header.PlaneInfo.precision.offset) == (32, 48)
    assert (C.sizeof(header.ExecutionParams), header.ExecutionParams.backends.offset, C.sizeof(header.Backend),
            header.Backend.params.offset, C.sizeof(header.BackendParams), C.sizeof(header.DecodeParams),
            C.sizeof(header.InstanceCreateInfo)) == (80, 72, 64, 32, 32, 32, 64)
    assert (C.sizeof(header.DeviceAllocator), header.DeviceAllocator.device_mem_padding.offset,
            C.sizeof(header.PinnedAllocator), header.PinnedAllocator.pinned_mem_padding.offset) == (56, 48, 56, 48)
    assert (C.sizeof(header.Properties), C.sizeof(header.ExtensionDesc), header.ExtensionDesc.version.offset,
            header.ExtensionDesc.create.offset) == (32, 64, 40, 48)


@pytest.mark.skipif(not importlib.util.find_spec("nvidia.nvimgcodec"), reason="needs nvImageCodec")
def test_the_library_opens_with_its_jpeg_extensions_alone_without_its_python_module():
    """Its Python module's import loads every extension (a second of a Loader's start on a GPU host)."""
    code = ("import sys; from gpufeed.decode.codecs import nvimgcodec_api as api; lib, instance = api.open_library(); "
            "print(bool(instance), 'nvidia.nvimgcodec' in sys.modules, len(api._EXTENSIONS))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "False", str(len(api.EXTENSIONS))], done.stderr


LOADED_AHEAD = """
import threading, torch
from gpufeed.decode.codecs import nvimgcodec_api as api
from gpufeed.decode.scheduling import choice
choice.load_ahead(torch.device("cuda", 0), None)
for t in threading.enumerate():
    if t.name.startswith("gpufeed-nvimgcodec"):
        t.join(60)
print(len(api._EXTENSIONS))
"""


@pytest.mark.skipif(not importlib.util.find_spec("nvidia.nvimgcodec"), reason="needs nvImageCodec")
def test_loading_ahead_makes_the_extensions_too():
    """A folder's Loader opens nvImageCodec while it indexes the folder (`choice.load_ahead`): the
    extensions too (0.57 s of the opening on a GPU host), now that stderr sent aside meanwhile costs a
    worker started then nothing (`gpufeed.stderr.child_stderr`) and the index's warnings come after."""
    done = subprocess.run([sys.executable, "-c", LOADED_AHEAD], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == [str(len(api.EXTENSIONS))], done.stderr


@pytest.mark.skipif(not importlib.util.find_spec("nvidia.nvimgcodec"), reason="needs nvImageCodec")
def test_a_batch_decodes_into_one_buffer_as_pillow_decodes_it():
    good = encode_jpegs(natural_images(6))
    blobs = good[:2] + [b"not a jpeg at all"] + good[2:4] + [claiming(good[4], 60000, 60000)] + good[4:]
    data = np.frombuffer(b"".join(blobs), np.uint8)
    ends = np.cumsum([len(b) for b in blobs])
    begins = ends - [len(b) for b in blobs]
    dec = api.BatchDecoder("cpu", 0, 1)
    for rounds in range(2):  # the second batch decodes into the first one's handles
        take = np.arange(len(blobs)) if rounds == 0 else np.array([0, 3, 4, 7])
        sizes, ok = dec.read(data, begins[take], ends[take])
        assert ok.tolist() == [len(blobs[k]) > 20 for k in take]
        readable = ok & (sizes[:, 0] * sizes[:, 1] < 10**8)
        offsets, total = dec.layout(np.where(readable, dec.nbytes(sizes, np.zeros(len(sizes), bool)), 0))
        assert (offsets % dec.ALIGN == 0).all() and dec.ycc420(len(take))[readable].all()  # Pillow's 4:2:0
        out = np.zeros(total, np.uint8)
        done = dec.decode(sizes, readable, out.ctypes.data, offsets, 0)
        assert done.tolist() == readable.tolist()
        for k in np.flatnonzero(done):
            h, w = sizes[k]
            want = np.asarray(Image.open(io.BytesIO(blobs[take[k]])).convert("RGB"))
            got = out[offsets[k]: offsets[k] + h * w * 3].reshape(h, w, 3)
            assert got.shape == want.shape and np.abs(got.astype(int) - want).mean() < 2, k


def test_jpegs_cut_short_are_told_apart_from_whole_ones_for_the_gpu_decoders():
    """The GPU's decoders fill a cut file with gray and call it decoded, where Pillow refuses it: such
    files go to the CPU (`Encoded.cut_short`), so a file gets one verdict whichever decoder drew it."""
    from gpufeed.decode.base import EOI_WINDOW, Encoded

    j = encode_jpegs(natural_images(1))[0]
    blobs = [j, j[: len(j) // 2], j + b"\0" * 7, j + b"x" * (EOI_WINDOW + 1), b"", b"\xff\xd9", j[:-1]]
    assert Encoded.joined(blobs).cut_short().tolist() == [False, True, False, True, True, True, True]
    assert Encoded.joined([]).cut_short().tolist() == []
