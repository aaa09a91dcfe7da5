"""Check a store against its manifest: every data file present, of the right size and hash."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpufeed.store.format import MANIFEST, Manifest, StoreError, open_own
from gpufeed.store.sharded import manifest_digest
from gpufeed.store.writer import fd_digest


@dataclass
class VerifyResult:
    """Outcome of `verify`: `damaged` maps each bad file to the reason."""

    path: Path
    checked: list[str]
    damaged: dict[str, str]

    @property
    def ok(self) -> bool:
        """True when every data file has its recorded size and digest."""
        return not self.damaged


def verify(path: str | Path) -> VerifyResult:
    """Recompute the checksum of every data file of the store at `path` (on all cores).

    Returns:
        A `VerifyResult`: `ok`, and `damaged` mapping each bad file to why (missing, size, digest, or
        not the store's own regular file: a symbolic link, FIFO or device, whose target is not hashed).

    Raises:
        StoreError: `path` is not a readable store (its manifest is missing, invalid or a symbolic link).
    """
    path = Path(path)
    manifest = Manifest.read(path)
    damaged = _files(path, manifest)
    checked = sorted(manifest.files)
    for shard in manifest.shards:  # a sharded store: every shard, its manifest and its files
        name = shard["name"]
        checked.append(f"{name}/{MANIFEST}")
        try:
            if manifest_digest(path / name / MANIFEST) != shard["digest"]:
                damaged[f"{name}/{MANIFEST}"] = "checksum mismatch (not the shard the store's manifest recorded)"
                continue
            inner = Manifest.read(path / name)
        except (OSError, StoreError) as e:
            damaged[f"{name}/{MANIFEST}"] = f"missing or unreadable ({type(e).__name__})"
            continue
        damaged |= {f"{name}/{file}": why for file, why in _files(path / name, inner).items()}
        checked += [f"{name}/{file}" for file in sorted(inner.files)]
    return VerifyResult(path, checked, damaged)


def _files(path: Path, manifest: Manifest) -> dict[str, str]:
    """The data files of the store (or shard) at `path` whose size or digest differ, with why."""
    damaged: dict[str, str] = {}
    for name, entry in manifest.files.items():
        try:
            fd = open_own(path / name)
        except FileNotFoundError:
            damaged[name] = "missing"
            continue
        except StoreError as e:  # a symbolic link, FIFO or device: not the store's own file
            damaged[name] = str(e).removeprefix(f"{path / name}: ")
            continue
        got = fd_digest(fd)
        if got["bytes"] != entry["bytes"]:
            damaged[name] = f"{got['bytes']} bytes, manifest says {entry['bytes']}"
        elif got["digest"] != entry["digest"]:
            damaged[name] = "checksum mismatch (contents changed since packing)"
    return damaged
