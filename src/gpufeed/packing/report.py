"""What a pack did (`PackReport`): shared by the local pack (`packer`) and the pack into a bucket (`upload`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpufeed.packing.skips import summarize_skipped


@dataclass
class PackReport:
    """What `pack` did: where, how many, what was skipped and why, how fast. `kept`: `exist_ok` found
    the store already packed and packed nothing (count, skipped and bytes are the store's)."""

    dest: Path
    mode: str
    count: int
    skipped: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    workers: int = 1
    bytes: int = 0
    kept: bool = False

    @property
    def images_per_s(self) -> float:
        """Images packed per second of the whole pack."""
        return self.count / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        """What to print: count, size, speed (or that a complete store was kept), and how many files were
        skipped for each reason, with a few of them (`packing.skips`)."""
        what, rate = ("videos", "videos/s") if self.mode == "video" else ("images", "img/s")
        if self.kept:
            lines = [
                f"kept {self.dest}: {self.count} {what} ({self.mode}, {self.bytes / 1e6:.1f} MB) packed before "
                "from the same source with the same settings; nothing packed"
            ]
        else:
            lines = [
                f"packed {self.count} {what} into {self.dest} ({self.mode}, {self.bytes / 1e6:.1f} MB) "
                f"in {self.seconds:.1f} s: {self.images_per_s:.0f} {rate} on {self.workers} worker(s)"
            ]
        lines += summarize_skipped(self.skipped, "each in manifest.json; gpufeed inspect --all-skipped lists them")
        return "\n".join(lines)
