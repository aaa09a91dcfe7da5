"""A folder's index reads most JPEG headers without Pillow (`sources.images.plain_jpeg_size`, issue 65):
wherever it decides alone, Pillow decides the same (kept as it is, the same size); anything else it
leaves to Pillow; and a folder indexed with it serves what the Pillow-only index served."""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

import gpufeed
from gpufeed.augment import CenterCrop, Resize
from gpufeed.loader import folder
from gpufeed.sources import Skip, folders, headers, indexer
from gpufeed.sources.folders import IMAGE_EXTS
from gpufeed.sources.videos import VIDEO_EXTS
from gpufeed.sources.images import kept_as_is, plain_jpeg_size
from gpufeed.synth import natural_image

MAX_SIDE = 4096


def _jpeg(array: np.ndarray, mode: str = "RGB", **kw) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).convert(mode).save(out, format="JPEG", **kw)
    return out.getvalue()


def _exif(orientation: int | None, order: str) -> bytes:
    """An APP1 EXIF block's TIFF data (after "Exif\\0\\0"), IFD0 holding one orientation tag (or an
    unrelated tag), in byte order `order` ("II" or "MM")."""
    e = "<" if order == "II" else ">"
    tag, value = (0x0112, orientation) if orientation is not None else (0x010F, 0)
    entry = struct.pack(f"{e}HHI", tag, 3, 1) + struct.pack(f"{e}H", value) + b"\0\0"
    return order.encode() + struct.pack(f"{e}HI", 42, 8) + struct.pack(f"{e}H", 1) + entry + b"\0\0\0\0"


def _exif_dpi_a_byte() -> bytes:
    """An EXIF block whose resolution unit and X resolution (1 byte, UNDEFINED: not a rational) Pillow's
    open reads for the image's dpi, and fails on (IndexError, not caught there)."""
    entries = struct.pack("<HHIHH", 0x0128, 3, 1, 2, 0) + struct.pack("<HHI", 0x011A, 7, 1) + b"\x05\0\0\0"
    return b"II" + struct.pack("<HI", 42, 8) + struct.pack("<H", 2) + entries + b"\0\0\0\0"


def _with_app1(jpeg: bytes, payload: bytes) -> bytes:
    """`jpeg` with an APP1 segment of `payload` right after its SOI."""
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def _mpo(photo: np.ndarray) -> bytes:
    """Two pictures in one file (a camera's multi-picture JPEG): Pillow opens it as MPO."""
    out = io.BytesIO()
    Image.fromarray(photo).save(out, format="MPO", save_all=True, append_images=[Image.fromarray(photo[::-1])])
    return out.getvalue()


def _with_dqt_tail(jpeg: bytes) -> bytes:
    """`jpeg` with a quantization table segment holding a byte after its table (Pillow refuses it)."""
    table = b"\x00" + bytes(range(1, 65))
    return jpeg[:2] + b"\xff\xdb" + struct.pack(">H", len(table) + 3) + table + b"\x00" + jpeg[2:]


def _exif_twice(first: int, second: int) -> bytes:
    """An EXIF block whose first IFD names the orientation twice (Pillow keeps the last)."""
    entries = b"".join(struct.pack("<HHI", 0x0112, 3, 1) + struct.pack("<H", v) + b"\0\0" for v in (first, second))
    return b"II" + struct.pack("<HI", 42, 8) + struct.pack("<H", 2) + entries + b"\0\0\0\0"


def _variants() -> dict[str, bytes]:
    rng = np.random.default_rng(3)
    photo = natural_image(rng, 75, 101, 1)
    plain = _jpeg(photo, quality=90)
    return {
        "baseline": plain,
        "baseline 4:4:4": _jpeg(photo, quality=95, subsampling=0),
        "optimized": _jpeg(photo, quality=80, optimize=True),
        "progressive": _jpeg(photo, quality=90, progressive=True),
        "gray": _jpeg(photo, "L", quality=90),
        "cmyk": _jpeg(photo, "CMYK", quality=90),
        "exif upright II": _with_app1(plain, b"Exif\0\0" + _exif(1, "II")),
        "exif upright MM": _with_app1(plain, b"Exif\0\0" + _exif(1, "MM")),
        "exif no orientation": _with_app1(plain, b"Exif\0\0" + _exif(None, "II")),
        "exif rotated II": _with_app1(plain, b"Exif\0\0" + _exif(6, "II")),
        "exif rotated MM": _with_app1(plain, b"Exif\0\0" + _exif(3, "MM")),
        "exif garbled": _with_app1(plain, b"Exif\0\0" + b"XX" + bytes(20)),
        "xmp": _with_app1(plain, b"http://ns.adobe.com/xap/1.0/\0<x:xmpmeta tiff:Orientation=\"6\"/>"),
        "two exif blocks": _with_app1(_with_app1(plain, b"Exif\0\0" + _exif(1, "II")), b"Exif\0\0" + _exif(6, "II")),
        "png": (lambda b: (Image.fromarray(photo).save(b, format="PNG"), b.getvalue())[1])(io.BytesIO()),
        "mpo": _mpo(photo),
        "dqt with bytes over": _with_dqt_tail(plain),
        "two orientation tags": _with_app1(plain, b"Exif\0\0" + _exif_twice(1, 6)),
        "exif dpi a byte": _with_app1(plain, b"Exif\0\0" + _exif_dpi_a_byte()),
        "jfif cut short": plain[:2] + b"\xff\xe0\x00\x06JFIF" + plain[2:],
        "cut inside the header": plain[:40],
    }


@pytest.mark.parametrize("name", list(_variants()))
def test_a_header_read_alone_decides_as_pillow_does(name):
    data = _variants()[name]
    fast = plain_jpeg_size(data, MAX_SIDE)
    try:
        img = Image.open(io.BytesIO(data))
        pillow = (img.size[1], img.size[0]) if kept_as_is(img, MAX_SIDE) else None
    except (OSError, SyntaxError):
        pillow = None
    if fast is not None:  # where it decides alone, as Pillow
        assert fast == pillow, name
    expected_alone = {"baseline", "baseline 4:4:4", "optimized", "exif upright II", "exif upright MM",
                      "exif no orientation"}
    assert (fast is not None) == (name in expected_alone), (name, fast, pillow)


def test_a_side_over_the_limit_is_left_to_pillow():
    data = _variants()["baseline"]
    assert plain_jpeg_size(data, 100) is None and plain_jpeg_size(data, 101) == (75, 101)


def test_a_folder_indexed_without_pillow_serves_what_pillow_indexed(tmp_path, monkeypatch):
    """Every variant in a folder (those needing it re-encoded, those unreadable skipped): the index made
    with the header path and one made with Pillow alone give the same files, sizes, skips and batches."""
    root = tmp_path / "img"
    for k, (name, data) in enumerate(_variants().items()):
        path = root / f"c{k % 2}" / f"{k:02d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    ops = [Resize(40), CenterCrop(32)]

    def index(cache: str):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / cache))
        store = folder.FolderStore(root)
        loader = gpufeed.Loader(store, batch_size=4, device="cpu", shuffle=False, drop_last=False, augment=ops,
                                num_workers=0, fields=("label", "source"))
        return store, [b for b in loader]

    fast_store, fast = index("fast")
    monkeypatch.setattr(headers, "plain_jpeg_header", lambda head, side: None)
    slow_store, slow = index("pillow")
    # cut in its header; JFIF and DQT segments Pillow refuses; an EXIF dpi Pillow's open fails on
    assert fast_store.skipped == slow_store.skipped and len(fast_store.skipped) == 4
    assert np.array_equal(fast_store.shapes, slow_store.shapes) and fast_store.reencoded == slow_store.reencoded
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert torch.equal(a["image"], b["image"]) and a["source"] == b["source"]


def _variant_folder(root):
    for k, data in enumerate(_variants().values()):
        path = root / f"c{k % 2}" / f"{k:02d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


class _Plugin(ImageFile.ImageFile):
    """A format only this process's Pillow reads (as a plugin a user registered): b"GPFK", then the
    width and height (uint16), then RGB pixels."""

    format = "GPFK"

    def _open(self) -> None:
        head = self.fp.read(8)
        if head[:4] != b"GPFK":
            raise SyntaxError("not GPFK")
        w, h = struct.unpack("<HH", head[4:8])
        self._mode, self._size = "RGB", (w, h)
        self.tile = [ImageFile._Tile("raw", (0, 0, w, h), 8, ("RGB", 0, 1))]


def test_index_processes_make_the_index_threads_make(tmp_path, monkeypatch, caplog):
    """A folder of many files is indexed by processes (`sources.indexer`, here from 1 file on, 2 of them):
    the same entries, skips and re-encoded copies as threads, an image of a format only a plugin of
    this process reads included (indexed here again); where they fail, threads index it and a
    warning says so."""
    root = _variant_folder(tmp_path / "img")
    monkeypatch.setitem(Image.OPEN, "GPFK", (_Plugin, lambda prefix: prefix[:4] == b"GPFK"))
    monkeypatch.setattr(Image, "ID", [*Image.ID, "GPFK"])
    (root / "c0" / "plugin.jpg").write_bytes(b"GPFK" + struct.pack("<HH", 20, 12) + bytes(range(240)) * 3)

    def index(cache: str):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / cache))
        store = folder.FolderStore(root)
        return store, json.loads(folder._cache_path(root).read_text())["entries"]

    threads, by_threads = index("threads")
    monkeypatch.setattr(folder, "PROCESSES_FROM", 1)
    monkeypatch.setattr(folder, "rank_cores", lambda: SimpleNamespace(usable=2))
    asked = []
    real = indexer.entries
    monkeypatch.setattr(indexer, "entries", lambda jobs, n: asked.append((len(jobs), n)) or real(jobs, n))
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        procs, by_processes = index("processes")
    assert "index processes failed" not in caplog.text, caplog.text  # (threads would give the same entries)
    assert asked == [(len(_variants()) + 1, 2)]
    loads = []
    real_load = folder._load
    monkeypatch.setattr(folder, "_load", lambda path: loads.append(path) or real_load(path))
    folder.FolderStore(root)  # the files as the processes looked at them: served, no entry read
    assert loads == []
    monkeypatch.setattr(folder, "_load", real_load)
    assert by_processes == by_threads and procs.skipped == threads.skipped
    assert np.array_equal(procs.shapes, threads.shapes) and procs.reencoded == threads.reencoded > 0
    plugin = next(v for k, v in by_processes.items() if k.endswith("plugin.jpg|" + k.split("|", 1)[1]))
    assert plugin == [12, 20, plugin[2], 1]  # read by this process's plugin, re-encoded
    assert sorted(p.name for p in procs.upright.glob("*.jpg")) == sorted(p.name for p in threads.upright.glob("*.jpg"))

    def broken(jobs, n):
        raise indexer.IndexFailed("index process 1 ended without its entries (killed)")

    monkeypatch.setattr(indexer, "entries", broken)
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        again, by_fallback = index("fallback")
    assert by_fallback == by_threads and "index processes failed" in caplog.text and "killed" in caplog.text


def test_an_index_process_that_fails_is_named_and_none_is_left(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'MemoryError: the machine ran out' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(indexer.sys, "executable", str(fake))
    started = []
    real_popen = indexer.subprocess.Popen
    monkeypatch.setattr(indexer.subprocess, "Popen", lambda *a, **kw: started.append(real_popen(*a, **kw)) or started[-1])
    jobs = [headers.Job(str(tmp_path / f"{k}.jpg"), 0, -1, f"{k}.jpg", str(tmp_path)) for k in range(4)]
    with pytest.raises(indexer.IndexFailed, match="ended without its entries .MemoryError: the machine ran out"):
        indexer.entries(jobs, 2)
    assert len(started) == 2 and all(p.returncode is not None for p in started)


def test_a_file_cut_short_is_found_though_an_exif_thumbnail_ends_in_its_last_bytes(tmp_path):
    """A JPEG with a long EXIF thumbnail (its own end-of-image marker), cut soon after its scan starts:
    its last bytes hold the thumbnail's marker, not the image's, and it is refused as packing refuses it."""
    rng = np.random.default_rng(4)
    plain = _jpeg(natural_image(rng, 120, 160, 2), quality=90)
    thumbnail = _jpeg(natural_image(rng, 240, 320, 3), quality=98)
    assert len(thumbnail) > headers.HEADER_BYTES
    whole = _with_app1(plain, b"Exif\0\0" + _exif(1, "II") + thumbnail)
    scan = whole.rindex(b"\xff\xda")  # the image's scan (the thumbnail's comes first)
    cut = whole[: scan + 200]
    path = tmp_path / "cut.jpg"
    path.write_bytes(cut)
    found = headers.entry(headers.Job(str(path), 0, -1, "cut.jpg", str(tmp_path / "up")))
    assert isinstance(found.entry, str) and "truncated" in found.entry, found
    path.write_bytes(whole)  # the whole file is kept as it is
    assert headers.entry(headers.Job(str(path), 0, -1, "w.jpg", str(tmp_path / "up"))).entry == [120, 160, len(whole)]


def _linked_folder(root):
    """Class folders with what a walk skips or follows: a nested folder, a dotfile, a text file, a link
    to an earlier class's folder and one to the root (each a loop, skipped, when walked in order)."""
    rng = np.random.default_rng(5)
    for c in range(4):
        (root / f"c{c}").mkdir(parents=True)
        for k in range(3):
            Image.fromarray(natural_image(rng, 24 + k, 28, k)).save(root / f"c{c}" / f"{k}.jpg", quality=90)
    (root / "c1" / "sub").mkdir()
    Image.fromarray(natural_image(rng, 26, 30, 9)).save(root / "c1" / "sub" / "nested.jpg")
    (root / "c2" / ".hidden.jpg").write_bytes(b"x")
    (root / "c2" / "notes.txt").write_text("x")
    os.symlink(root / "c0", root / "c3" / "link")
    os.symlink(root, root / "c2" / "up")
    return root


def test_a_large_folder_listed_by_processes_is_the_folder_listed_here(tmp_path, monkeypatch, caplog):
    """A large folder's class folders are listed, and their files looked at, by processes
    (`sources.indexer.walk`; here from 1 file on, 2 of them): the same images, labels, skips and looks
    as listed here, a link to an earlier class's folder included (walked here again, as a loop); the
    same columns opened cold and warm; where they fail, listed here and said."""
    root = _linked_folder(tmp_path / "img")
    here = folder._list(str(root), look=True)
    assert here.looks is None and any("symlink loop" in s["reason"] for s in here.skipped)  # (not asked for)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "here"))
    cold_here = _columns(folder.FolderStore(root))
    warm_here = _columns(folder.FolderStore(root))

    monkeypatch.setattr(folder, "WALK_PROCESSES_FROM", 1)
    monkeypatch.setattr(folder, "rank_cores", lambda: SimpleNamespace(usable=2))
    asked = []
    real = indexer.walk
    monkeypatch.setattr(indexer, "walk", lambda dirs, exts, what, n, look: asked.append((len(dirs), n, look)) or real(dirs, exts, what, n, look))
    apart = folder._list(str(root), look=True)
    assert asked == [(4, 2, True)]
    for name in ("names", "files", "labels", "skipped", "classes"):
        assert getattr(apart, name) == getattr(here, name), name
    assert np.array_equal(apart.looks, headers.file_looks(here.files))
    (root / "c3" / "clip.mp4").write_bytes(b"x")  # (a video: not an image, a skip not fatal)
    walked = folders.walk_folder(root, apart=lambda dirs: real(dirs, IMAGE_EXTS, folders.IMAGE_WORDS, 2, False))
    assert [(r.label, r.found) for r in walked.runs] == [(r.label, r.found) for r in folders.walk_folder(root).runs]
    videos = folders.walk_folder(root, VIDEO_EXTS, lambda dirs: real(dirs, VIDEO_EXTS, folders.VIDEO_WORDS, 2, False))
    assert [(r.label, r.found) for r in videos.runs] == [(r.label, r.found) for r in folders.walk_folder(root, VIDEO_EXTS).runs]
    assert any(isinstance(f, Skip) and "not an image file (extension '.txt')" in f.reason for r in walked.runs for f in r.found)
    (root / "c3" / "clip.mp4").unlink()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "apart"))
    assert _columns(folder.FolderStore(root)) == cold_here and len(asked) == 2 and not asked[-1][2]  # cold: no looks
    assert _columns(folder.FolderStore(root)) == warm_here and asked[-1][2]

    def broken(dirs, exts, what, n, look):
        raise indexer.IndexFailed("index process 1 ended without its listing (killed)")

    monkeypatch.setattr(indexer, "walk", broken)
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        assert _columns(folder.FolderStore(root)) == warm_here
    assert "listing processes failed" in caplog.text and "killed" in caplog.text


def _columns(store) -> tuple:
    return (store._names, store.shapes.tolist(), store._sizes.tolist(), store._labels.tolist(),
            store._files.tolist(), store._file_of.tolist(), store._begins.tolist(), store.skipped, store.reencoded)


def test_an_index_written_by_another_process_while_this_one_lists_is_taken_as_cold(tmp_path, monkeypatch):
    """Ranks opening one folder at once: an index another one wrote while this open listed the folder
    (no index when it began) is not used for files this open did not look at (it failed on them)."""
    root = _linked_folder(tmp_path / "img")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = _columns(folder.FolderStore(root))
    index = folder._cache_path(root)
    written = index.read_bytes()
    index.unlink()
    index.with_suffix(".served.npz").unlink()
    real = folder._list

    def listed_meanwhile(source, **kw):
        listing = real(source, **kw)
        index.write_bytes(written)  # (the other rank's)
        return listing

    monkeypatch.setattr(folder, "_list", listed_meanwhile)
    assert _columns(folder.FolderStore(root)) == first


def test_a_header_read_alone_never_takes_one_pillow_would_not():
    """The header walk decides alone only where Pillow decides the same (its promise, over headers
    damaged at random, seeded): a scan header whose length ran past the file's end was taken as a
    plain JPEG, which Pillow's open refuses ("Truncated File Read") and `gpufeed pack` skips."""
    rng = np.random.default_rng(11)
    disagree, decided = [], 0
    for name, data in _variants().items():
        for _ in range(1500):
            damaged = bytearray(data)
            for at in rng.integers(0, min(len(data), 400), rng.integers(1, 4)):
                damaged[at] = rng.integers(0, 256)
            fast = plain_jpeg_size(bytes(damaged), MAX_SIDE)
            if fast is None:
                continue
            decided += 1
            try:
                with warnings.catch_warnings():  # (Pillow's of damaged EXIF tags)
                    warnings.simplefilter("ignore")
                    img = Image.open(io.BytesIO(bytes(damaged)))
                    pillow = (img.size[1], img.size[0]) if kept_as_is(img, MAX_SIDE) else None
            except (OSError, SyntaxError, ValueError) as e:
                pillow = repr(e)
            if fast != pillow:
                disagree.append((name, fast, pillow))
    assert decided > 1000 and not disagree, (decided, disagree[:3])
