"""Triton's kernel-cache key kept from one process to the next (`augment.triton_key`): given back only
for the very files it was computed from, never from a record it did not write, and Triton's own
function left in place where anything is off."""

from __future__ import annotations

import json
import time

import pytest

triton = pytest.importorskip("triton")
from triton.runtime import cache  # noqa: E402

from gpufeed.augment import triton_key as kept  # noqa: E402

KEY = f"{triton.__version__}" + "-".join(["a" * 64, "b" * 64, "c" * 64])


@pytest.fixture
def computed(tmp_path, monkeypatch):
    """Triton's key function replaced by one that counts its calls (restored after the test, as is
    whatever `known` put in its place); the cache folder a temporary one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def triton_key():
        calls.append(1)
        return KEY

    monkeypatch.setattr(cache, "triton_key", triton_key)
    return calls


def _fresh_process(monkeypatch, original):
    """As a new process finds Triton: its own function, nothing computed yet."""
    monkeypatch.setattr(cache, "triton_key", original)


def test_the_key_is_computed_once_and_given_back_to_the_next_process(computed, monkeypatch, tmp_path):
    original = cache.triton_key
    kept.known()
    assert cache.triton_key() == KEY and len(computed) == 1
    record = json.loads((tmp_path / "gpufeed" / "triton-key.json").read_text())
    assert record["key"] == KEY
    _fresh_process(monkeypatch, original)
    kept.known()
    assert cache.triton_key() == KEY and len(computed) == 1  # not computed again
    assert cache.get_cache_key.__globals__["triton_key"]() == KEY  # what Triton's compile looks up


def test_files_changed_since_make_it_computed_again(computed, monkeypatch):
    original = cache.triton_key
    kept.known()
    _fresh_process(monkeypatch, original)
    monkeypatch.setattr(kept, "fingerprint", lambda root: "another install")
    kept.known()
    assert cache.triton_key() == KEY and len(computed) == 2


@pytest.mark.parametrize(
    "record",
    [
        "not json",
        "[]",
        '{"fingerprint": "F"}',
        '{"fingerprint": "F", "key": 3}',
        '{"fingerprint": "F", "key": "0.0.1' + "a" * 64 + '"}',  # another Triton's
        '{"fingerprint": "F", "key": "VERSIONzz"}',  # not hex digests
        '{"fingerprint": "F", "key": "VERSION"}',
    ],
)
def test_a_record_it_did_not_write_is_not_trusted(computed, monkeypatch, tmp_path, record):
    monkeypatch.setattr(kept, "fingerprint", lambda root: "F")
    path = tmp_path / "gpufeed" / "triton-key.json"
    path.parent.mkdir(parents=True)
    path.write_text(record.replace("VERSION", triton.__version__))
    kept.known()
    assert cache.triton_key() == KEY and len(computed) == 1  # computed, as Triton does
    assert json.loads(path.read_text())["key"] == KEY  # and kept in its place


def test_no_cache_folder_leaves_tritons_own_function(computed, monkeypatch, tmp_path):
    (tmp_path / "gpufeed").write_text("a file where the folder would be")
    before = cache.triton_key
    kept.known()
    assert cache.triton_key is before


def test_the_fingerprint_follows_every_file_triton_hashes(tmp_path, monkeypatch):
    """Built from a stand-in of Triton's folder: a file edited, added or replaced changes it."""
    import sysconfig

    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    for rel in ["runtime/cache.py", f"_C/libtriton.{ext}", "compiler/a.py", "backends/nvidia/b.py", "language/c.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    first = kept.fingerprint(tmp_path)
    assert kept.fingerprint(tmp_path) == first
    (tmp_path / "language" / "d.py").write_text("new")
    second = kept.fingerprint(tmp_path)
    assert second != first
    lib = tmp_path / "_C" / f"libtriton.{ext}"
    lib.unlink()
    time.sleep(0.05)  # (file times tick in a few ms: a file written anew within one may keep them)
    lib.write_text(f"_C/libtriton.{ext}")  # the same bytes, written anew (a reinstall)
    assert kept.fingerprint(tmp_path) != second
