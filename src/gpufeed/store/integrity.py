"""Check a store against its manifest: every data file present, of the right size and hash."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpufeed.store.format import Manifest
from gpufeed.store.writer import file_digest


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
        A `VerifyResult`: `ok`, and `damaged` mapping each bad file to why (missing, size, digest).

    Raises:
        StoreError: `path` is not a readable store (its manifest is missing or invalid).
    """
    path = Path(path)
    manifest = Manifest.read(path)
    damaged: dict[str, str] = {}
    for name, entry in manifest.files.items():
        file = path / name
        if not file.is_file():
            damaged[name] = "missing"
            continue
        got = file_digest(file)
        if got["bytes"] != entry["bytes"]:
            damaged[name] = f"{got['bytes']} bytes, manifest says {entry['bytes']}"
        elif got["digest"] != entry["digest"]:
            damaged[name] = "checksum mismatch (contents changed since packing)"
    return VerifyResult(path, sorted(manifest.files), damaged)
