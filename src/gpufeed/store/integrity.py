"""Check a store against its manifest: every data file present, of the right size and hash."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpufeed.store.format import Manifest, StoreError, open_own
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
    return VerifyResult(path, sorted(manifest.files), damaged)
