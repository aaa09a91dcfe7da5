"""Bad files are skipped with a reason (or raise naming them); packing is atomic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

import gpufeed
from conftest import claiming, jpeg_bytes, pixels, save, smooth
from gpufeed.packing import worker


@pytest.fixture
def messy(tmp_path):
    """One good image per class plus one of each kind of bad input."""
    root = tmp_path / "messy"
    save(root / "a" / "good.png", pixels(0, 32, 32))
    save(root / "b" / "good.png", pixels(1, 32, 32))
    (root / "a" / "empty.jpg").write_bytes(b"")
    (root / "a" / "truncated.jpg").write_bytes(jpeg_bytes(smooth(0))[:300])
    png = bytearray(save(tmp_path / "ok.png", smooth(2)).read_bytes())
    png[60:160] = os.urandom(100)  # header intact, image data garbled
    (root / "a" / "corrupt.png").write_bytes(bytes(png))
    (root / "a" / "text.jpg").write_text("I am not a picture")
    (root / "a" / "notes.txt").write_text("readme")
    (root / "a" / ".DS_Store").write_bytes(b"\0\0")
    (root / ".cache").mkdir()
    (root / "b" / "dangling.jpg").symlink_to(root / "nowhere.jpg")
    (root / "b" / "self.jpg").symlink_to(root / "b" / "self.jpg")
    (root / "b" / "loop").symlink_to(root / "b")
    return root


EXPECTED = {
    "empty.jpg": "empty file",
    "truncated.jpg": "cannot decode",
    "corrupt.png": "cannot decode",
    "text.jpg": "not an image",
    "notes.txt": "not an image file",
    ".DS_Store": "dotfile",
    ".cache": "dotfile",
    "dangling.jpg": "unreadable",
    "self.jpg": "unreadable",
    "loop": "symlink loop",
}


@pytest.mark.parametrize("workers", [1, 2])
def test_every_bad_kind_is_skipped_with_its_reason(messy, tmp_path, workers):
    report = gpufeed.pack(messy, tmp_path / "s", size=32, workers=workers, progress=False)
    assert report.count == 2
    reasons = {os.path.basename(s["path"]): s["reason"] for s in report.skipped}
    assert set(reasons) == set(EXPECTED), reasons
    for name, words in EXPECTED.items():
        assert words in reasons[name], (name, reasons[name])
    store = gpufeed.open(tmp_path / "s")
    assert store.manifest.skipped == report.skipped
    assert store.labels.tolist() == [0, 1]
    assert np.array_equal(store.images[1], pixels(1, 32, 32))


def test_raise_stops_at_the_bad_file_and_names_it(image_folder, messy, tmp_path):
    (image_folder / "dog" / "zz.jpg").write_bytes(jpeg_bytes(smooth(0))[:300])
    with pytest.raises(gpufeed.PackError, match=r"dog/zz\.jpg: cannot decode"):
        gpufeed.pack(image_folder, tmp_path / "s", size=32, workers=2, on_error="raise", progress=False)
    with pytest.raises(gpufeed.PackError, match="|".join(k for k in EXPECTED if not k.startswith("."))):
        gpufeed.pack(messy, tmp_path / "s", size=32, workers=1, on_error="raise", progress=False)
    assert not (tmp_path / "s").exists()


def test_nothing_packable_is_an_error(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.jpg").write_bytes(b"junk")
    with pytest.raises(gpufeed.PackError, match="nothing could be packed") as e:
        gpufeed.pack(tmp_path / "src", tmp_path / "s", workers=1, progress=False)
    assert e.value.skipped[0]["path"].endswith("x.jpg")
    assert not (tmp_path / "s").exists()


def test_missing_source_and_bad_arguments(tmp_path):
    with pytest.raises(gpufeed.SourceError, match="no such file"):
        gpufeed.pack(tmp_path / "nope", tmp_path / "s")
    with pytest.raises(ValueError, match="mode"):
        gpufeed.pack(tmp_path, tmp_path / "s", mode="png")


def test_huge_jpeg_is_drafted_not_decoded_in_full(tmp_path):
    (tmp_path / "src").mkdir()
    Image.new("RGB", (12000, 12000), (10, 120, 230)).save(tmp_path / "src" / "huge.jpg", quality=75)
    report = gpufeed.pack(tmp_path / "src", tmp_path / "s", size=64, workers=1, progress=False)
    assert report.count == 1
    assert gpufeed.open(tmp_path / "s")[0][0][:, 32, 32].tolist() == pytest.approx([10, 120, 230], abs=3)


def test_pixel_budget_replaces_pillow_bomb_guard(tmp_path):
    save(tmp_path / "src" / "big.png", smooth(0, 300, 300))
    save(tmp_path / "src" / "big.jpg", smooth(1, 300, 300), quality=90)
    save(tmp_path / "src" / "small.png", smooth(2, 90, 100))
    report = gpufeed.pack(tmp_path / "src", tmp_path / "s", size=32, max_pixels=10_000, workers=1, progress=False)
    # the budget is for the size the header declares, before anything is decoded: the JPEG too,
    # though it would shrink to 38x38 while decoding (issue 21: refuse before allocating)
    assert report.count == 1 and len(report.skipped) == 2
    assert all("300x300 image" in s["reason"] and "exceeds max_pixels" in s["reason"] for s in report.skipped)
    assert Image.MAX_IMAGE_PIXELS is not None  # Pillow's global guard is restored


def test_a_tiny_jpeg_declaring_a_huge_size_is_skipped_not_packed_gray(tmp_path):
    """677 bytes declaring 65000x65000: Pillow would decode it (DCT-reduced) into a flat gray image."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "bomb.jpg").write_bytes(claiming(jpeg_bytes(smooth(0, 16, 16)), 65000, 65000))
    save(tmp_path / "src" / "ok.png", smooth(1, 20, 20))
    report = gpufeed.pack(tmp_path / "src", tmp_path / "s", size=16, workers=1, progress=False)
    assert report.count == 1 and "65000x65000 image (JPEG) exceeds max_pixels" in report.skipped[0]["reason"]


@pytest.mark.parametrize("workers", [1, 2])
def test_fifo_and_devices_are_skipped_not_read(tmp_path, workers):
    """A FIFO named like an image would block a read forever; /dev/zero would never end."""
    save(tmp_path / "src" / "c" / "ok.png", smooth(0, 20, 20))
    os.mkfifo(tmp_path / "src" / "c" / "fifo.jpg")
    (tmp_path / "list.csv").write_text(f"path,label\n{tmp_path / 'src' / 'c' / 'ok.png'},0\n/dev/zero,1\n"
                                        f"{tmp_path / 'src' / 'c' / 'fifo.jpg'},1\n")
    for source, dest in ((tmp_path / "src", "a"), (tmp_path / "list.csv", "b")):
        t0 = time.monotonic()
        report = gpufeed.pack(source, tmp_path / dest, size=16, workers=workers, progress=False)
        assert time.monotonic() - t0 < 60 and report.count == 1
        reasons = {os.path.basename(s["path"]): s["reason"] for s in report.skipped}
        assert "not a regular file" in reasons["fifo.jpg"], reasons
        if dest == "b":
            assert "not a regular file" in reasons["zero"], reasons


def test_tar_links_and_oversized_members_are_listed_as_skipped(tmp_path, monkeypatch):
    import io
    import tarfile

    from gpufeed.sources import tars

    monkeypatch.setattr(tars, "MAX_FILE_BYTES", 10_000)
    good, big = jpeg_bytes(smooth(0, 20, 20)), os.urandom(20_000)
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for name, data in (("a.jpg", good), ("a.cls", b"1"), ("b.jpg", big)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("c.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "a.jpg"
        tar.addfile(link)
    report = gpufeed.pack(tmp_path / "shard.tar", tmp_path / "s", size=16, workers=1, progress=False)
    reasons = {s["path"].rsplit(":", 1)[1]: s["reason"] for s in report.skipped}
    assert report.count == 1
    assert "20000 bytes, more than any image" in reasons["b.jpg"] and "not a regular file" in reasons["c.jpg"]


def test_existing_destination_needs_overwrite(image_folder, tmp_path):
    gpufeed.pack(image_folder, tmp_path / "s", size=8, workers=1, progress=False)
    with pytest.raises(gpufeed.StoreError, match="exists"):
        gpufeed.pack(image_folder, tmp_path / "s", size=8, workers=1, progress=False)
    gpufeed.pack(image_folder, tmp_path / "s", size=16, workers=1, progress=False, overwrite=True)
    assert gpufeed.open(tmp_path / "s").image_shape == (16, 16, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "s"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_crash_mid_pack_leaves_nothing(image_folder, tmp_path, monkeypatch, exc):
    calls = []
    real = worker.process

    def dying(chunk, s):
        calls.append(1)
        if len(calls) == 2:
            raise exc("simulated crash")
        return real(chunk, s)

    gpufeed.pack(image_folder, tmp_path / "old", size=8, workers=1, progress=False)
    monkeypatch.setattr("gpufeed.packing.packer.CHUNK", 4)
    monkeypatch.setattr("gpufeed.packing.worker.process", dying)
    with pytest.raises(exc):
        gpufeed.pack(image_folder, tmp_path / "old", size=8, workers=1, progress=False, overwrite=True)
    assert len(gpufeed.open(tmp_path / "old")) == 12  # the previous store survives intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "old"]


def test_killed_pack_leaves_no_store(tmp_path):
    for i in range(1500):
        save(tmp_path / "src" / f"{i:04d}.png", pixels(i, 64, 64))
    code = (f"import gpufeed; gpufeed.pack({str(tmp_path / 'src')!r}, {str(tmp_path / 'dest')!r}, "
            "size=64, workers=1, progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while not any(p.name.startswith(".dest.packing") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.time() < deadline, "pack ended before it could be killed"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "dest").exists()
    leftover = next(p for p in tmp_path.iterdir() if p.name.startswith(".dest.packing"))
    with pytest.raises(gpufeed.StoreError, match="not a gpufeed store"):
        gpufeed.open(leftover)


def test_packing_workers_start_without_torch():
    """Workers import only what packing needs (fast start on every core)."""
    code = "import sys, gpufeed.packing.worker, gpufeed; gpufeed.pack; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_destination_another_pack_is_writing_is_refused(image_folder, tmp_path):
    from gpufeed.store.writer import exclusive

    dest = (tmp_path / "s").absolute()
    with exclusive(dest):  # as a concurrent `gpufeed pack` to the same destination holds it
        with pytest.raises(gpufeed.StoreError, match="another gpufeed pack is writing this destination"):
            gpufeed.pack(image_folder, dest, size=16, workers=1, progress=False)
    assert not dest.exists()
    gpufeed.pack(image_folder, dest, size=16, workers=1, progress=False)  # free again once released
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "s"]  # no lock file left behind


def test_a_tar_bomb_is_skipped_under_a_memory_cap(tmp_path):
    """A small .tar.gz holding a member of 300 MiB of zeros (over the 256 MiB any image may have) is
    skipped by its header size, streamed past without being held, and the images around it pack:
    in a child process whose address space is capped at 2 GiB, peak RSS stays far below the member."""
    import io
    import subprocess
    import sys
    import tarfile

    good = jpeg_bytes(smooth(0, 20, 20))
    with tarfile.open(tmp_path / "bomb.tar.gz", "w:gz", compresslevel=1) as tar:
        for name, data in (("a.jpg", good), ("a.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        class Zeros(io.RawIOBase):  # 300 MiB of zeros, never in memory at once
            left = 300 << 20

            def readable(self):
                return True

            def readinto(self, b):
                n = min(len(b), self.left)
                b[:n] = bytes(n)
                self.left -= n
                return n

        info = tarfile.TarInfo("b.jpg")
        info.size = Zeros.left
        tar.addfile(info, io.BufferedReader(Zeros(), 1 << 20))
        info = tarfile.TarInfo("c.jpg")
        info.size = len(good)
        tar.addfile(info, io.BytesIO(good))
    assert (tmp_path / "bomb.tar.gz").stat().st_size < 5 << 20
    child = (
        "import resource, sys, gpufeed\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        f"r = gpufeed.pack({str(tmp_path / 'bomb.tar.gz')!r}, {str(tmp_path / 's')!r}, size=16, workers=1,"
        " progress=False)\n"
        "print(r.count, [s['reason'] for s in r.skipped])\n"
        # VmHWM: this process image's peak RSS (ru_maxrss would carry pytest's own over fork + exec)
        "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) // 1024)\n"
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary, peak_mb = proc.stdout.strip().splitlines()
    assert summary.startswith("2 ") and "more than any image" in summary, summary
    assert int(peak_mb) < 200, f"peak RSS {peak_mb} MB"  # the member alone is 300 MiB
