"""Packing at the edges: hostile tar shards, lists that would scramble labels, SIGTERM, a destination
inside its source, and CLI options that must not be ignored or fail after the store is written."""

from __future__ import annotations

import gzip
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

import gpufeed
from conftest import jpeg_bytes, pixels, save, smooth
from gpufeed.cli import main
from gpufeed.packing import packer
from gpufeed.sources import Item, SourceError


def _members(parts: list[tuple[str, bytes]]) -> bytes:
    """Tar bytes of `parts`, without the end-of-archive blocks, so more may be appended."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in parts:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        end = tar.offset
    return buf.getvalue()[:end]


def _lying_shard(path, declared: int, compress: bool) -> None:
    """A good sample a, then a member b.jpg whose header declares `declared` bytes but whose body is 10 KB."""
    good = _members([("a.jpg", jpeg_bytes(smooth(0, 20, 20))), ("a.cls", b"1")])
    liar = tarfile.TarInfo("b.jpg")
    liar.size = declared
    data = good + liar.tobuf(tarfile.PAX_FORMAT) + os.urandom(10_000)
    path.write_bytes(gzip.compress(data, compresslevel=1) if compress else data)


@pytest.mark.parametrize("name", ["s.tar", "s.tar.gz"])
@pytest.mark.parametrize("declared", [1 << 50, 100 << 30, 200 << 20])  # 1 PiB, 100 GB, under MAX_FILE_BYTES
def test_a_tar_member_declaring_more_than_the_shard_holds(tmp_path, name, declared):
    """Never read past a shard's end: the pack ends at once, keeps the sample before and names the liar."""
    _lying_shard(tmp_path / name, declared, name.endswith(".gz"))
    t0 = time.monotonic()
    report = gpufeed.pack(tmp_path / name, tmp_path / "s", size=16, workers=1, progress=False)
    assert time.monotonic() - t0 < 5
    assert report.count == 1 and gpufeed.open(tmp_path / "s").labels.tolist() == [1]
    reasons = {s["path"].rsplit(":", 1)[1]: s["reason"] for s in report.skipped}
    assert list(reasons) == ["b.jpg"], reasons
    assert "past the end of the shard" in reasons["b.jpg"] and "rest of shard lost" in reasons["b.jpg"]


def test_chunks_are_bounded_by_bytes_as_well_as_items():
    """Chunks of tar or dataset samples close at CHUNK_BYTES, and the chunks in flight hold at most
    IN_FLIGHT_BYTES (one chunk alone may hold more, when one sample does)."""

    class Sink:
        slots = 0

        def reserve(self, n):
            self.slots += n
            return self.slots - n

    sizes = [1 << 20] * 200 + [packer.CHUNK_BYTES * 3] + [100] * 100  # 1 MiB samples, a huge one, tiny ones
    items = [Item(f"x{i}", 0, data=bytes(n)) for i, n in enumerate(sizes)]
    chunks = list(packer._chunks(iter(items), Sink(), None, lambda s: False))
    held = [sum(len(i.data) for i in c.items) for c in chunks]
    assert [i for c in chunks for i in c.items] == items
    assert all(h <= packer.CHUNK_BYTES or len(c.items) == 1 for h, c in zip(held, chunks)), held
    assert max(len(c.items) for c in chunks) == packer.CHUNK  # tiny samples still fill a chunk by count

    class Recorder:
        """Completes nothing until its result is asked for: records the bytes in flight at each submit."""

        def __init__(self):
            self.flight, self.peaks = {}, []

        def submit(self, fn, chunk):
            self.flight[id(chunk)] = sum(len(i.data) for i in chunk.items)
            self.peaks.append(sum(self.flight.values()))
            recorder = self

            class Done:
                def result(self):
                    del recorder.flight[id(chunk)]
                    return []

            return Done()

    ex = Recorder()
    assert len(list(packer._bounded(ex, None, iter(chunks), window=10_000))) == len(chunks)
    assert max(ex.peaks) <= max(packer.IN_FLIGHT_BYTES, packer.CHUNK_BYTES * 3), ex.peaks


def _images(folder, n):
    for k in range(n):
        save(folder / f"{k}.png", pixels(k, 16, 16))


def test_a_csv_with_a_byte_order_mark_keeps_its_header(tmp_path):
    """Excel writes a BOM before `path,label,...`: the header is still the header."""
    _images(tmp_path, 4)
    text = "path,label,score\n" + "".join(f"{k}.png,{'ab'[k % 2]},{k / 2}\n" for k in range(4))
    (tmp_path / "l.csv").write_bytes(text.encode("utf-8-sig"))
    report = gpufeed.pack(tmp_path / "l.csv", tmp_path / "s", size=16, workers=1, progress=False)
    store = gpufeed.open(tmp_path / "s")
    assert report.count == 4 and report.skipped == []
    assert store.classes == ["a", "b"] and store.labels.tolist() == [0, 1, 0, 1]
    assert [store.field("score", i) for i in range(4)] == [0.0, 0.5, 1.0, 1.5]


@pytest.mark.parametrize("header", ["path,label,a,a", "path,label,label"])
def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path, header):
    _images(tmp_path, 1)
    (tmp_path / "l.csv").write_text(f"{header}\n0.png,1,2" + ",3" * (header.count(",") - 2) + "\n")
    with pytest.raises(SourceError, match=r"l\.csv: column '(a|label)' is named twice in the header"):
        gpufeed.pack(tmp_path / "l.csv", tmp_path / "s", size=16, workers=1, progress=False)


def test_a_number_column_is_decided_over_all_rows_and_missing_cells_are_nan(tmp_path):
    """A blank or N/A in the first row no longer makes the column text (and every later row a
    mismatch): a column whose every present cell is a number is numbers, missing cells NaN."""
    _images(tmp_path, 6)
    cells = ["", "1", "N/A", "3", "NA", "5"]
    notes = ["x", "1", "", "y", "2.5", "z"]  # text: numbers in it stay text
    (tmp_path / "l.csv").write_text("path,label,weight,count,note\n" + "".join(
        f"{k}.png,0,{w},{k},{n}\n" for k, (w, n) in enumerate(zip(cells, notes))))
    report = gpufeed.pack(tmp_path / "l.csv", tmp_path / "s", size=16, workers=1, progress=False)
    assert report.count == 6 and report.skipped == []
    store = gpufeed.open(tmp_path / "s")
    assert store.fields == {"weight": {"kind": "float"}, "count": {"kind": "int"}, "note": {"kind": "str"}}
    weights = [store.field("weight", i) for i in range(6)]
    assert np.isnan(weights[0]) and np.isnan(weights[2]) and np.isnan(weights[4]) and weights[1::2] == [1, 3, 5]
    assert [store.field("note", i) for i in range(6)] == notes


def test_a_csv_cell_too_large_is_a_source_error_naming_the_line(tmp_path):
    _images(tmp_path, 1)
    (tmp_path / "l.csv").write_text("path,label,note\n0.png,1,short\n0.png,1," + "x" * (200 << 10) + "\n")
    with pytest.raises(SourceError, match=r"l\.csv: line 3: .*field larger than field limit"):
        gpufeed.pack(tmp_path / "l.csv", tmp_path / "s", size=16, workers=1, progress=False)
    assert main(["pack", str(tmp_path / "l.csv"), str(tmp_path / "s")]) == 1


def test_lists_of_numbers_of_one_shape_become_array_fields(tmp_path):
    """JSONL embeddings and multi-hot lists (and CSV cells holding such JSON lists) come back as
    tensors when every sample has one of the same shape; lists whose shape varies stay JSON."""
    _images(tmp_path, 3)
    rows = [{"path": f"{k}.png", "label": k, "emb": [k / 2, 1, 2], "hot": [[1, 0], [0, k]], "tags": [1] * (k + 1),
             "flags": [True, k == 1]} for k in range(3)]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gpufeed.pack(tmp_path / "l.jsonl", tmp_path / "j", size=16, workers=1, progress=False)
    store = gpufeed.open(tmp_path / "j")
    assert store.fields["emb"] == {"kind": "array", "dtype": "<f8", "shape": [3]}
    assert store.fields["hot"] == {"kind": "array", "dtype": "<i8", "shape": [2, 2]}
    assert store.fields["flags"] == {"kind": "array", "dtype": "|b1", "shape": [2]}
    assert store.fields["tags"] == {"kind": "json"} and store.field("tags", 2) == [1, 1, 1]
    assert store.field("emb", 1).tolist() == [0.5, 1, 2] and store.field("hot", 2).tolist() == [[1, 0], [0, 2]]
    loader = gpufeed.Loader(store, batch_size=3, device="cpu", shuffle=False, fields=("emb", "hot"))
    batch = next(iter(loader))
    assert batch["emb"].shape == (3, 3) and batch["hot"][2].tolist() == [[1, 0], [0, 2]]
    (tmp_path / "l.csv").write_text("path,label,emb\n" + "".join(f'{k}.png,{k},"[{k}, 1]"\n' for k in range(3)))
    gpufeed.pack(tmp_path / "l.csv", tmp_path / "c", size=16, workers=1, progress=False)
    store = gpufeed.open(tmp_path / "c")
    assert store.fields["emb"] == {"kind": "array", "dtype": "<i8", "shape": [2]}
    assert store.field("emb", 2).tolist() == [2, 1]


def test_a_destination_inside_its_source_and_a_source_inside_its_destination_are_refused(tmp_path):
    """Re-packing into a folder inside the source would read the old store as a class of images;
    replacing a destination that holds the source would delete the source."""
    src = tmp_path / "src"
    for c in ("a", "b"):
        _images(src / c, 2)
    for dest in (src / "store", src / "a" / "deeper" / "store", src):
        with pytest.raises(ValueError, match="inside the source folder"):
            gpufeed.pack(src, dest, size=16, workers=1, progress=False, overwrite=True)
    with pytest.raises(ValueError, match="inside the destination"):
        gpufeed.pack(src / "a", src, size=16, workers=1, progress=False, overwrite=True)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s-0.tar").write_bytes(_members([("k.png", (src / "a" / "0.png").read_bytes())]))
    with pytest.raises(ValueError, match="inside the destination"):
        gpufeed.pack(str(tmp_path / "shards" / "s-*.tar"), tmp_path / "shards", size=16, workers=1, progress=False)
    (tmp_path / "link").symlink_to(src)
    with pytest.raises(ValueError, match="inside the source folder"):
        gpufeed.pack(tmp_path / "link", src / "store", size=16, workers=1, progress=False)
    assert sorted(p.name for p in src.iterdir()) == ["a", "b"] and len(list(src.rglob("*.png"))) == 4
    assert main(["pack", str(src), str(src / "store")]) == 1
    gpufeed.pack(src, tmp_path / "store", size=16, workers=1, progress=False)  # beside it: fine


@pytest.mark.parametrize("group", [False, True], ids=["kill", "killpg"])
def test_sigterm_cleans_up_as_ctrl_c_does(tmp_path, group):
    """SIGTERM (kill, `timeout`, a scheduler: to the pack alone or to its process group, workers too)
    removes the scratch folder and the lock, and the command exits 143."""
    for i in range(1500):
        save(tmp_path / "src" / f"{i:04d}.png", pixels(i, 64, 64))
    proc = subprocess.Popen([sys.executable, "-m", "gpufeed.cli", "pack", str(tmp_path / "src"), str(tmp_path / "dest"),
                             "--size", "64", "--workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 60
    while not any(p.name.startswith(".dest.packing-") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.time() < deadline, "pack ended before it could be terminated"
        time.sleep(0.01)
    (os.killpg if group else os.kill)(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], err
    assert proc.returncode == 143, (out, err)
    assert "gpufeed pack: terminated" in err, err


def test_a_pack_removes_what_dead_packs_left_beside_its_destination(tmp_path):
    """A pack killed with SIGKILL leaves its scratch folder; the next pack to that destination (holding
    the lock, so no live pack owns it) removes it."""
    _images(tmp_path / "src", 2)
    for stale in (".dest.packing-0badf00d", ".dest.packing-deadbeef"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "images.u8").write_bytes(bytes(1000))
    (tmp_path / ".dest.lock").touch()
    (tmp_path / ".destination.packing-12345678").mkdir()  # another destination's: not ours to remove
    gpufeed.pack(tmp_path / "src", tmp_path / "dest", size=16, workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".destination.packing-12345678", "dest", "src"]


def test_pack_size_with_jpeg_is_a_usage_error_naming_max_side(tmp_path, capsys):
    _images(tmp_path / "src", 1)
    with pytest.raises(SystemExit) as e:
        main(["pack", str(tmp_path / "src"), str(tmp_path / "s"), "--mode", "jpeg", "--size", "128"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: gpufeed pack" in err and "error: --size" in err and "--max-side" in err
    assert not (tmp_path / "s").exists()
    assert main(["pack", str(tmp_path / "src"), str(tmp_path / "s"), "--mode", "jpeg", "--workers", "1"]) == 0


def test_pack_max_pixels_flag(tmp_path, capsys):
    from gpufeed.cli import _parser
    from gpufeed.packing.imaging import DEFAULT_MAX_PIXELS

    save(tmp_path / "src" / "small.png", pixels(0, 8, 8))
    save(tmp_path / "src" / "large.png", pixels(1, 16, 16))
    assert main(["pack", str(tmp_path / "src"), str(tmp_path / "s"), "--size", "8", "--max-pixels", "100",
                 "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "exceeds max_pixels=100" in out and "large.png" in out  # the reason, then the files skipped for it
    store = gpufeed.open(tmp_path / "s")
    assert len(store) == 1 and store.manifest.settings["max_pixels"] == 100
    assert _parser().parse_args(["pack", "a", "b"]).max_pixels == DEFAULT_MAX_PIXELS


def test_pack_prints_its_summary_when_a_file_name_is_not_utf8_and_stdout_is_strict(tmp_path):
    """The store is written: the summary naming a skipped file called b'\\xff.jpg' must not fail the command."""
    _images(tmp_path / "src", 1)
    (tmp_path / "src" / os.fsdecode(b"\xff.jpg")).write_bytes(b"not an image")
    proc = subprocess.run([sys.executable, "-m", "gpufeed.cli", "pack", str(tmp_path / "src"), str(tmp_path / "s"),
                           "--size", "8", "--workers", "1"], capture_output=True,
                          env={**os.environ, "PYTHONIOENCODING": "ascii:strict", "LC_ALL": "C"})
    assert proc.returncode == 0, proc.stderr
    assert b"packed 1 images" in proc.stdout and b"\\udcff.jpg" in proc.stdout
