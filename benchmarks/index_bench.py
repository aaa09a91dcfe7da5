"""How long a folder read in place takes to index (its JPEG headers read once, then cached) at
ImageNet's scale: `--files` JPEGs in class folders of 1,300 (copies of `--photos` photo-like JPEGs of
ImageNet's spread of sizes, benchmarks/photos.py, so the folder is made in seconds), indexed cold
(no index cache) with each `--threads` count, with the page cache warm and, where this user may
drop it (root), cold; then opened with the cached index. Issue 65's aim: 1.28M files in <= 20 s on
16 cores.

    python benchmarks/index_bench.py --files 1281167 --root /tmp/ib --out index.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import common
import photos

SMOKE = dict(files=40, photos=4, threads="1,4", root=None, cold_cache=False, links=False)


def _make(root: Path, files: int, count: int, links: bool) -> Path:
    """`files` JPEGs in folders of 1,300, copies of `count` photos, or hard links to them where
    `links` (kept in `root`: made once)."""
    folder = root / f"folder-{files}{'-links' if links else ''}"
    if (folder / ".complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    made = sorted(photos.make_folder(root / "photos", count, classes=1).rglob("*.jpg"))
    blobs = [] if links else [p.read_bytes() for p in made]
    for k in range(files):
        if k % 1300 == 0:
            (folder / f"n{k // 1300:05d}").mkdir(parents=True)
        path = folder / f"n{k // 1300:05d}" / f"{k:08d}.jpg"
        if links:
            os.link(made[k % len(made)], path)
        else:
            path.write_bytes(blobs[k % len(blobs)])
    (folder / ".complete").touch()
    return folder


def _drop_page_cache() -> bool:
    """Drop the page cache (root only); whether it was."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--files", type=int, default=200_000)
    p.add_argument("--photos", type=int, default=500, help="distinct photos copied over the files")
    p.add_argument("--threads", default="4,16,64", help="index threads to try (comma-separated)")
    p.add_argument("--root", default=None, help="work folder, kept, its folder reused (default: a temporary one)")
    p.add_argument("--cold-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="also index with the page cache dropped (root only: the whole machine's)")
    p.add_argument("--links", action="store_true",
                   help="hard links to the photos, not copies: ImageNet's file count on a disk too small for"
                        " its bytes (each file's pages are then the photos', always cached: no cold-cache row)")
    a = common.parse(p, argv, SMOKE)
    from gpufeed.loader import folder as folder_module

    rows = common.Rows(a.out, __file__)
    with common.workdir(a.root, "gpufeed-index-bench-") as root:
        images = _make(root, a.files, a.photos, a.links)
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")
        for cache in ("warm", "cold") if a.cold_cache and not a.links else ("warm",):
            for threads in (int(t) for t in a.threads.split(",")):
                shutil.rmtree(root / "cache", ignore_errors=True)
                if cache == "cold" and not _drop_page_cache():
                    continue
                t0 = time.perf_counter()
                store = folder_module.FolderStore(images, threads=threads)
                seconds = time.perf_counter() - t0
                store.close()
                rows[f"built, page cache {cache}, {threads} threads"] = {"seconds": seconds, "files": len(store)}
        t0 = time.perf_counter()
        folder_module.FolderStore(images).close()
        rows["opened with the cached index"] = {"seconds": time.perf_counter() - t0, "files": a.files}
    lines = [[name, f"{r['seconds']:.2f}", f"{r['files'] / r['seconds']:,.0f}"] for name, r in rows.items()]
    cores = len(os.sched_getaffinity(0))
    markdown = f"{a.files:,} files{' (hard links)' if a.links else ''}, {cores} cores\n\n" + common.table(["index", "s", "files/s"], lines)
    return common.write(a, __file__, dict(rows), markdown, "cpu", files=a.files, cores=cores)


if __name__ == "__main__":
    main()
