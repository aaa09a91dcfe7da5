"""`store.fetch` against a fake object store (no server): a remote folder's files as byte ranges, a
range that fails asked for again alone, a file whose digest differs refused and nothing of it kept,
and `retried` telling a missing file, a timeout and a passing error apart."""

from __future__ import annotations

import pytest

import gpufeed.store.fetch as fetch_module
from gpufeed.store.fetch import Fetcher, retried
from gpufeed.store.format import StoreError
from gpufeed.store.writer import file_digest


class FakeObjectStore:
    """An fsspec-like filesystem of byte strings by path, answering ranges as an object store does;
    `fail` names (path, start) ranges that fail once."""

    protocol = "s3"

    def __init__(self, files: dict[str, bytes], fail: set[tuple[str, int]] = frozenset()):
        self.files, self.fail, self.asked = files, set(fail), []

    def cat_ranges(self, paths, starts, ends, on_error="raise"):
        self.asked.append(list(zip(paths, starts, ends, strict=True)))
        out = []
        for path, a, b in zip(paths, starts, ends, strict=True):
            if (path, a) in self.fail:
                self.fail.discard((path, a))
                out.append(ConnectionResetError(f"{path}: reset"))
            elif path not in self.files:
                out.append(FileNotFoundError(path))
            else:
                out.append(self.files[path][a:b])
        return out


def _entries(tmp_path, files: dict[str, bytes]) -> dict[str, dict]:
    """Manifest entries ({"bytes", "digest"}) of `files`, as a store records them."""
    entries = {}
    for name, data in files.items():
        (tmp_path / "made" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "made" / name).write_bytes(data)
        entries[name] = file_digest(tmp_path / "made" / name)
    return entries


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(fetch_module, "PART", 100)
    monkeypatch.setattr(fetch_module, "RANGES_AT_ONCE", 3)
    monkeypatch.setattr(fetch_module, "BACKOFF", 0.0)


def test_files_come_whole_as_ranges_and_a_failed_range_is_asked_for_again_alone(tmp_path, small_parts):
    data = {"a.bin": bytes(range(256)) * 3, "b.bin": b"x" * 150, "empty": b""}
    fs = FakeObjectStore({f"root/s/{n}": d for n, d in data.items()}, fail={("root/s/a.bin", 300)})
    into = tmp_path / "into"
    into.mkdir()
    Fetcher(fs, "root", "s3://bucket/root", tmp_path).checked("root/s", _entries(tmp_path, data), into)
    assert {p.name: p.read_bytes() for p in into.iterdir()} == data
    again = [ranges for ranges in fs.asked if ("root/s/a.bin", 300, 400) in ranges]
    assert len(again) == 2 and again[1] == [("root/s/a.bin", 300, 400)]  # the failed range alone, in the same try
    assert all(len(ranges) <= 3 for ranges in fs.asked)


def test_a_file_whose_digest_differs_is_named_and_nothing_of_it_kept(tmp_path, small_parts):
    data = {"a.bin": b"a" * 120, "b.bin": b"b" * 40}
    entries = _entries(tmp_path, data)
    fs = FakeObjectStore({"root/s/a.bin": data["a.bin"], "root/s/b.bin": b"c" * 40})  # damaged in the bucket
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(StoreError, match=r"s3://bucket/root/s/b\.bin: not what the store's manifest recorded"):
        Fetcher(fs, "root", "s3://bucket/root", tmp_path).checked("root/s", entries, into)
    assert list(into.iterdir()) == []


def test_retried_tells_a_missing_file_a_timeout_and_a_passing_error_apart(monkeypatch):
    monkeypatch.setattr(fetch_module, "BACKOFF", 0.0)
    calls = []

    def failing(error):
        def call():
            calls.append(error)
            raise error

        return call

    with pytest.raises(StoreError, match="s3://b/x: not found"):
        retried("s3://b/x", failing(FileNotFoundError("x")))
    assert len(calls) == 1  # not transient: no second try
    calls.clear()
    with pytest.raises(StoreError, match=r"the server did not answer \(2 tries"):
        retried("s3://b/x", failing(TimeoutError("read timed out")))
    assert len(calls) == fetch_module.TIMEOUT_TRIES
    calls.clear()
    answers = iter([ConnectionResetError("reset"), ConnectionResetError("reset")])

    def passing():
        error = next(answers, None)
        calls.append(error)
        if error is not None:
            raise error
        return "ok"

    assert retried("s3://b/x", passing) == "ok" and len(calls) == 3
    with pytest.raises(StoreError, match=r"s3://b/x: failed 2 times, last: ConnectionResetError: reset"):
        retried("s3://b/x", failing(ConnectionResetError("reset")), retries=2)
