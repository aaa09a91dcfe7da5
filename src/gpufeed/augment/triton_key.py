"""Triton's key for its kernel cache, kept from one process to the next.

Triton keys every kernel it compiles or finds in its cache on disk with `triton_key()`: a SHA-256 of
its own Python files and of its library (libtriton, 505 MB in Triton 3.8), computed once a process,
before its first kernel: 0.32-0.35 s on the development box (0.94 s with the library not in the page
cache), with Triton's import 0.3-0.5 s on an H200 host, more beside a Loader's starting threads and
workers. A fresh process's first batch came just after it (`pipeline.triton_ahead` starts it at the
Loader's call; docs/benchmarks.md, "Reading a folder in place"); giving back a kept key takes 0.015 s.

`known` gives Triton the key a process before computed, kept in gpufeed's cache folder with the size,
mtime, ctime and inode of every file Triton hashes (a superset: every file under the folders it
walks). Any reinstall or edit of Triton changes one of them (a file written anew gets a new ctime and
inode, which nothing can set back), and the key is then computed again, as Triton computes it, and
kept. A record that does not parse, or names another Triton, is not trusted. Triton keeps its own
cache of compiled kernels (~/.triton/cache); this keeps one string.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path

from gpufeed.logs import logger
from gpufeed.user_cache import user_cache

log = logger(__name__)

_FOLDERS = ("compiler", "backends", "language")  # what `triton_key` walks, under Triton's package folder


def known() -> None:
    """Make `triton.runtime.cache.triton_key` give its key at once where a process before computed it
    for these very files, and keep it for the next process where it had to be computed. Raises what
    importing Triton raises; any other failure leaves Triton's own function in place."""
    from triton.runtime import cache

    original = cache.triton_key
    try:
        path = _record_path()
        seen = fingerprint(Path(cache.__file__).resolve().parent.parent)
        key = _read(path, seen)
        if key is None:
            key = original()
            _write(path, seen, key)
    except (OSError, ValueError) as e:  # no cache folder, a file gone while looked at: Triton hashes, as ever
        log.debug("gpufeed: Triton's key not kept (%s)", e)
        return

    def triton_key() -> str:
        return key

    cache.triton_key = triton_key  # `get_cache_key` looks it up here at each compile


def fingerprint(root: Path) -> str:
    """What Triton's key hashes, told by each file's path, size, mtime, ctime and inode (not read)."""
    from triton import __version__

    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    files = [root / "runtime" / "cache.py", root / "_C" / f"libtriton.{ext}"]
    for folder in _FOLDERS:
        for parent, dirs, names in os.walk(root / folder):
            dirs.sort()
            files += [Path(parent) / name for name in sorted(names)]
    lines = [f"triton {__version__} at {root}"]
    for f in files:
        st = f.stat()
        lines.append(f"{f.relative_to(root)} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _record_path() -> Path:
    return user_cache() / "triton-key.json"


def _read(path: Path, seen: str) -> str | None:
    """The key kept at `path` for the files `seen` describes; None where there is none, it is for other
    files, or the record is not what this module writes."""
    from triton import __version__

    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != seen:
        return None
    key = record.get("key")
    # Triton's form: its version, then hex digests joined by '-'
    if not isinstance(key, str) or not key.startswith(__version__):
        return None
    digests = key[len(__version__) :].split("-")
    if not digests or not all(len(d) == 64 and all(c in "0123456789abcdef" for c in d) for d in digests):
        return None
    return key


def _write(path: Path, seen: str, key: str) -> None:
    """Keep `key` for `seen` at `path`, whole or not at all (processes starting at once each write theirs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".triton-key-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": seen, "key": key}, f)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
