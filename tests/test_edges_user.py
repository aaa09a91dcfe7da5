"""Edges a first-time user meets (issue 63): a pack script run twice, truncated JPEGs kept as they are,
stores of one size, a full disk, FIFOs and non-UTF-8 names in a folder read in place, and the CLI's
exit codes and noise."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import save, smooth

import gpufeed
from gpufeed.augment import CenterCrop, Normalize
from gpufeed.cli import main
from gpufeed.packing import packer
from gpufeed.store.format import StoreError
from gpufeed.store.writer import HashingWriter


def _jpeg_folder(root, per_class: int = 2, h: int = 40, w: int = 48):
    for c in ("ant", "bee"):
        for i in range(per_class):
            save(root / c / f"{i}.jpg", smooth(i, h, w), quality=95)
    return root


# item 13: the README's "pack once" runs again


def test_exist_ok_keeps_a_store_of_the_same_source_and_settings(tmp_path):
    src = _jpeg_folder(tmp_path / "data")
    dest = tmp_path / "store"
    first = gpufeed.pack(src, dest, mode="jpeg", workers=1, progress=False, exist_ok=True)
    assert not first.kept and first.count == 4
    made = (dest / "manifest.json").stat().st_mtime_ns
    again = gpufeed.pack(src, dest, mode="jpeg", workers=1, progress=False, exist_ok=True)
    assert again.kept and again.count == 4 and again.bytes == first.bytes
    assert "kept" in again.summary() and "nothing packed" in again.summary()
    assert (dest / "manifest.json").stat().st_mtime_ns == made  # not packed again
    # the same folder, written otherwise: kept too
    assert gpufeed.pack(f"{src}/", dest, mode="jpeg", workers=1, progress=False, exist_ok=True).kept


def test_exist_ok_refuses_a_store_packed_otherwise(tmp_path):
    src = _jpeg_folder(tmp_path / "data")
    dest = tmp_path / "store"
    gpufeed.pack(src, dest, mode="jpeg", workers=1, progress=False)
    with pytest.raises(StoreError, match=r"quality 90 \(asked: 80\).*overwrite=True"):
        gpufeed.pack(src, dest, mode="jpeg", quality=80, workers=1, progress=False, exist_ok=True)
    with pytest.raises(StoreError, match=r"mode 'jpeg' \(asked: 'raw'\)"):
        gpufeed.pack(src, dest, size=16, workers=1, progress=False, exist_ok=True)
    other = _jpeg_folder(tmp_path / "other")
    with pytest.raises(StoreError, match="source"):
        gpufeed.pack(other, dest, mode="jpeg", workers=1, progress=False, exist_ok=True)
    # with overwrite=True, a store packed otherwise is replaced
    report = gpufeed.pack(src, dest, mode="jpeg", quality=80, workers=1, progress=False, exist_ok=True, overwrite=True)
    assert not report.kept and gpufeed.open(dest).manifest.settings["quality"] == 80
    # a damaged store is not kept
    os.truncate(dest / "labels.i64", 8)
    with pytest.raises(StoreError, match="labels.i64 is missing or not 32 bytes"):
        gpufeed.pack(src, dest, mode="jpeg", quality=80, workers=1, progress=False, exist_ok=True)
    # something that is no store
    (tmp_path / "notes").mkdir()
    with pytest.raises(StoreError, match="not a complete gpufeed store"):
        gpufeed.pack(src, tmp_path / "notes", mode="jpeg", workers=1, progress=False, exist_ok=True)
    assert (tmp_path / "notes").is_dir()  # left as it was


def test_cli_exist_ok(tmp_path, capsys):
    src = _jpeg_folder(tmp_path / "data")
    dest = str(tmp_path / "store")
    assert main(["pack", str(src), dest, "--size", "16", "--workers", "1", "--exist-ok"]) == 0
    assert "packed 4 images" in capsys.readouterr().out
    assert main(["pack", str(src), dest, "--size", "16", "--workers", "1", "--exist-ok"]) == 0
    assert "kept" in capsys.readouterr().out
    assert main(["pack", str(src), dest, "--size", "24", "--workers", "1", "--exist-ok"]) == 1
    assert "size 16 (asked: 24)" in capsys.readouterr().err


# item 14: a truncated JPEG kept as it is


def test_reencode_false_skips_a_truncated_jpeg(tmp_path):
    src = _jpeg_folder(tmp_path / "data", h=64, w=80)
    whole = (src / "ant" / "1.jpg").read_bytes()
    (src / "ant" / "1.jpg").write_bytes(whole[: len(whole) // 2])  # cut short
    (src / "bee" / "1.jpg").write_bytes(whole[:-2])  # all but its end-of-image marker
    (src / "bee" / "2.jpg").write_bytes(whole + b"appended: a motion photo's video")  # complete, with a trailer
    report = gpufeed.pack(src, tmp_path / "s", mode="jpeg", reencode=False, workers=1, progress=False)
    reasons = {s["path"].split("data/")[1]: s["reason"] for s in report.skipped}
    assert set(reasons) == {"ant/1.jpg", "bee/1.jpg"} and report.count == 3
    assert all("truncated JPEG: no end-of-image marker" in r for r in reasons.values())
    loader = gpufeed.Loader(
        tmp_path / "s",
        batch_size=3,
        device="cpu",
        num_workers=0,
        shuffle=False,
        on_error="raise",
        augment=[CenterCrop(32)],
    )
    with loader:
        assert [len(y) for _, y in loader] == [3]  # every kept image decodes


# item 16: a jpeg store of one size needs no augment


@pytest.mark.parametrize("workers", [0, 1])
def test_a_jpeg_store_of_one_size_loads_without_augment(tmp_path, workers):
    src = _jpeg_folder(tmp_path / "data", per_class=3)
    gpufeed.pack(src, tmp_path / "s", mode="jpeg", workers=1, progress=False)
    store = gpufeed.open(tmp_path / "s")
    with gpufeed.Loader(tmp_path / "s", batch_size=3, device="cpu", shuffle=False, num_workers=workers) as loader:
        assert loader.dtype == torch.uint8
        batches = list(loader)
    assert [tuple(x.shape) for x, _ in batches] == [(3, 3, 40, 48)] * 2 and batches[0][0].dtype == torch.uint8
    for k, (x, y) in enumerate(batches):  # the images as stored, as store[i] decodes them
        for j in range(3):
            image, label = store[3 * k + j]
            assert torch.equal(x[j], image) and y[j] == label
    with gpufeed.Loader(tmp_path / "s", batch_size=3, device="cpu", augment=[Normalize()], num_workers=workers) as norm:
        assert next(iter(norm))[0].shape == (3, 3, 40, 48)
    save(src / "bee" / "9.jpg", smooth(9, 32, 48), quality=95)  # another size: ops that end in one are needed
    gpufeed.pack(src, tmp_path / "s2", mode="jpeg", workers=1, progress=False)
    with pytest.raises(ValueError, match="holds images of different sizes"):
        gpufeed.Loader(tmp_path / "s2", batch_size=3, device="cpu", num_workers=workers)


# item 19: noise and defaults

SRC = str(Path(gpufeed.__file__).parents[1])


def _cli(*args: str, probe: str = "") -> subprocess.CompletedProcess:
    """`gpufeed ARGS` in a fresh process (warnings and logging are per process), then `probe`."""
    script = f"import sys\nfrom gpufeed.cli import main\nrc = main(sys.argv[1:])\n{probe}\nsys.exit(rc)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=300)


def test_doctor_prints_no_warning_of_torch():
    """torch's "The given NumPy array is not writable" UserWarning came on stderr, from decode/codecs/cpu.py."""
    done = _cli("doctor", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "versions: gpufeed" in done.stdout and "Warning" not in done.stderr, done.stderr


def test_other_libraries_log_lines_are_not_printed_as_gpufeeds(tmp_path):
    """The CLI printed botocore's information as its own: "gpufeed: Found credentials in environment variables."."""
    probe = (
        "import logging\n"
        "logging.getLogger('botocore.credentials').info('Found credentials in environment variables.')\n"
        "logging.getLogger('botocore.credentials').warning('a warning of its own')\n"
        "logging.getLogger('gpufeed.x').info('a plain message')\n"
    )
    done = _cli("inspect", str(tmp_path / "missing"), probe=probe)
    assert done.returncode == 1 and "gpufeed inspect: error:" in done.stderr, done.stderr
    assert "Found credentials" not in done.stderr
    assert "botocore.credentials: a warning of its own" in done.stderr and "gpufeed: a warning" not in done.stderr
    assert "gpufeed: a plain message" in done.stderr


@pytest.mark.parametrize(
    ("option", "value"),
    [("--size", "0"), ("--quality", "101"), ("--quality", "0"), ("--max-side", "0"), ("--workers", "0")],
)
def test_pack_values_out_of_range_are_usage_errors(tmp_path, capsys, option, value):
    """They exited 1 after starting to pack; the README says a value out of range exits 2, with the usage."""
    with pytest.raises(SystemExit) as e:
        main(["pack", str(tmp_path / "src"), str(tmp_path / "s"), option, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: gpufeed pack" in err and f"argument {option}" in err, err
    assert not (tmp_path / "s").exists()


# item 11b: a full disk while packing


def _open_under(folder: Path) -> list[str]:
    """What this process still holds open under `folder` (a removed file's space is freed only once closed)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(folder)):
                held.append(target)
    return held


def _no_space(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _leaves_nothing(tmp_path: Path, e: pytest.ExceptionInfo, dest: Path) -> None:
    message = str(e.value)
    assert "no space left" in message and str(dest) in message, message
    assert ".png" not in message and e.value.skipped == []  # no image blamed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]  # no store, scratch folder or lock
    assert _open_under(tmp_path) == []


def test_a_full_disk_stops_a_raw_pack_naming_the_destination(image_folder, tmp_path, monkeypatch):
    """Formerly a worker writing into a hole of the sparse images.u8 on a full disk died of SIGBUS, and the
    pack failed "on 32 file(s)": good images, and never "no space left"."""
    monkeypatch.setattr(packer, "CHUNK", 4)  # 12 images: 3 slots reserved, the second finds the disk full
    calls = []
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        calls.append(offset)
        if len(calls) == 2:
            _no_space()
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    dest = tmp_path / "s"
    with pytest.raises(packer.PackError) as e:
        gpufeed.pack(image_folder, dest, size=16, workers=2, progress=False)
    assert len(calls) == 2
    _leaves_nothing(tmp_path, e, dest)


def test_a_full_disk_stops_a_jpeg_pack_naming_the_destination(image_folder, tmp_path, monkeypatch, capsys):
    """A jpeg pack's data.bin on a full disk raised an OSError without a file name."""
    real = HashingWriter.write
    monkeypatch.setattr(HashingWriter, "write", lambda w, data: _no_space() if w.bytes else real(w, data))
    dest = tmp_path / "s"
    with pytest.raises(packer.PackError) as e:
        gpufeed.pack(image_folder, dest, mode="jpeg", workers=1, progress=False)
    _leaves_nothing(tmp_path, e, dest)
    assert main(["pack", str(image_folder), str(dest), "--mode", "jpeg", "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gpufeed pack: error: {dest}: no space left"), err


# item 5: a FIFO put in a file's place while a folder is read


def _write_ends(fifo: Path, until: threading.Event) -> None:
    """Open `fifo` for writing and close it again, over and over: a reader blocked opening it goes on
    (and reads its end at once)."""
    while not until.wait(0.2):
        with contextlib.suppress(OSError):  # ENXIO: no reader at the moment
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_put_in_a_files_place_fails_that_image_in_a_decode_worker(tmp_path):
    """A decode worker opened each file blocking: a FIFO put in an image's place since the folder was
    indexed held its open until a writer came, and the pass hung."""
    src = _jpeg_folder(tmp_path / "data", per_class=3)
    fifo = src / "bee" / "1.jpg"
    loader = gpufeed.Loader(
        src, batch_size=3, device="cpu", shuffle=False, drop_last=False, num_workers=1, augment=[CenterCrop(32)]
    )
    fifo.unlink()
    os.mkfifo(fifo)
    seen: list = []
    passing = threading.Thread(target=lambda: seen.extend(len(y) for _, y in loader), daemon=True)
    passing.start()
    passing.join(60)
    hung = passing.is_alive()
    freed = threading.Event()
    if hung:  # free the worker for as long as it opens the FIFO (the next epoch's batches too), so as to fail
        threading.Thread(target=_write_ends, args=(fifo, freed), daemon=True).start()
        passing.join(30)
    try:
        loader.close()
    finally:
        freed.set()
    assert not hung, "the pass hung on the FIFO"
    assert sum(seen) == 5
    assert [(s.source, "not a regular file" in s.reason) for s in loader.skipped] == [(str(fifo), True)], loader.skipped


# item 11a: file names that are not UTF-8, in a folder read in place


def _named(folder: Path, name: bytes) -> Path:
    """`folder`/`name`, a file name that need not be UTF-8 (its other bytes kept as surrogates, as Python does)."""
    return Path(os.fsdecode(os.fsencode(folder) + b"/" + name))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_folder_read_in_place_takes_names_that_are_not_utf8(tmp_path, workers):
    """Packing took them; reading the folder in place raised UnicodeEncodeError when it was made."""
    src = _jpeg_folder(_named(tmp_path, b"d\xe9j\xe0"))  # a Latin-1 folder name, as on an old disk
    cafe = _named(src / "bee", b"caf\xe9.jpg")  # read as it is
    os.rename(src / "bee" / "1.jpg", cafe)
    save(_named(src / "ant", b"\xff.png"), smooth(5, 40, 48))  # re-encoded beside the index
    names = sorted(str(p) for p in src.rglob("*.*"))

    def make() -> gpufeed.Loader:
        return gpufeed.Loader(
            src, batch_size=5, device="cpu", shuffle=False, drop_last=False, num_workers=workers,
            fields=("source",), augment=[CenterCrop(32)],
        )  # fmt: skip

    with make() as loader:
        assert loader.store.reencoded == 1 and loader.skipped == []
        assert sorted(s for b in loader for s in b["source"]) == names
    if workers:  # a decode worker's reason for an image that fails names it (its bytes escaped)
        with make() as loader:
            cafe.unlink()
            os.mkfifo(cafe)
            assert sum(len(b["source"]) for b in loader) == 4
            reasons = [(s.source, "caf\\udce9.jpg: not a regular file" in s.reason) for s in loader.skipped]
            assert reasons == [(str(cafe), True)], loader.skipped
    assert gpufeed.pack(src, tmp_path / "s", mode="jpeg", workers=1, progress=False).count == 4 + (not workers)


def test_a_strict_log_file_gets_the_messages_that_name_files_not_utf8(tmp_path):
    """A message naming a folder that is not UTF-8 reached a strict handler (a `logging.FileHandler`'s
    default errors) as "--- Logging error ---" and was lost; gpufeed's messages escape those bytes."""
    src = _jpeg_folder(_named(tmp_path, b"d\xe9j\xe0"))
    save(_named(src / "ant", b"\xff.png"), smooth(5, 40, 48))  # re-encoded: a warning names the folder
    failed: list[BaseException | None] = []

    class Strict(logging.FileHandler):
        def handleError(self, record):
            failed.append(sys.exc_info()[1])

    handler = Strict(tmp_path / "log.txt", encoding="utf-8")
    logging.getLogger("gpufeed").addHandler(handler)
    try:
        with gpufeed.Loader(src, batch_size=5, device="cpu", num_workers=0, augment=[CenterCrop(32)]) as loader:
            assert loader.store.reencoded == 1
    finally:
        logging.getLogger("gpufeed").removeHandler(handler)
        handler.close()
    assert failed == []
    assert "d\\udce9j\\udce0: 1 image(s) the JPEG decoders can't read" in (tmp_path / "log.txt").read_text()


# item 18: what the docs say a folder read in place gives (docs/loader.md, "Without packing")


def test_the_docs_say_which_pack_gives_a_folders_pixels(tmp_path):
    """The README said a folder read in place gives "the pixels a store packed from it gives": only a pack
    with reencode=False does; a default pack re-encodes every JPEG. The section is in docs/loader.md now."""
    page = (Path(__file__).parents[1] / "docs" / "loader.md").read_text()
    section = " ".join(page.split("\n## Without packing", 1)[1].split("\n## ", 1)[0].split())
    assert "the pixels a store packed from it gives" not in section
    assert "a store packed from the folder with `reencode=False`" in section and "a default pack re-encodes" in section
    src = _jpeg_folder(tmp_path / "data", per_class=3)
    kept = gpufeed.pack(src, tmp_path / "kept", mode="jpeg", reencode=False, workers=1, progress=False)
    default = gpufeed.pack(src, tmp_path / "default", mode="jpeg", workers=1, progress=False)

    def pixels(path) -> torch.Tensor:
        with gpufeed.Loader(path, batch_size=6, device="cpu", shuffle=False, num_workers=0) as loader:
            return next(iter(loader))[0]

    folder = pixels(src)
    assert torch.equal(folder, pixels(kept.dest)) and not torch.equal(folder, pixels(default.dest))


def test_stray_bytes_between_a_jpegs_segments_are_no_reason_to_skip_it(tmp_path):
    """libjpeg (and Pillow) skip bytes that are no marker between header segments, with a warning: such
    a file decodes, so the check for a JPEG cut short passes over them and keeps it."""
    import io

    from PIL import Image

    from gpufeed.sources.images import truncated_jpeg

    buf = io.BytesIO()
    Image.fromarray(smooth(3, 48, 64)).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    app0 = 4 + int.from_bytes(data[4:6], "big")  # SOI, then APP0's marker and its length
    odd = data[:app0] + b"\x00\x13\x37" + data[app0:]
    assert Image.open(io.BytesIO(odd)).convert("RGB").size == (64, 48)  # it decodes
    assert truncated_jpeg(odd) is None and truncated_jpeg(odd[: len(odd) // 2]) is not None
    save(tmp_path / "src" / "c0" / "a.png", smooth(1, 32, 32))
    (tmp_path / "src" / "c0" / "odd.jpg").write_bytes(odd)
    report = gpufeed.pack(tmp_path / "src", tmp_path / "store", mode="jpeg", reencode=False, workers=1,
                          progress=False)
    assert report.count == 2 and not report.skipped
