"""`gpufeed demo`: make sample images, pack them both ways, read them back, print the numbers."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from gpufeed.packing import pack
from gpufeed.store import open_store, verify
from gpufeed.synth import make_image_folder

T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _read_all(store) -> int:
    """Read every sample once (decoding jpeg ones) and return the pixel bytes seen."""
    return sum(store[i][0].numel() for i in range(len(store)))


def run_demo(directory: str | Path = "gpufeed-demo", per_class: int = 64, classes: int = 4) -> list[dict]:
    """Run the whole flow in `directory` (replaced if present) and print a results table."""
    root = Path(directory)
    if root.exists():
        shutil.rmtree(root)
    n, modes = per_class * classes, ("raw", "jpeg")
    total = 2 + 2 * len(modes)  # make the images; pack and read back each mode; load one store
    numbers = iter(range(1, total + 1))

    def step(what: str) -> None:
        print(f"{next(numbers)}/{total} {what}")

    step(f"making {n} sample JPEGs (500x375, {classes} classes) in {root / 'images'}")
    _, t_make = _timed(lambda: make_image_folder(root / "images", per_class=per_class, classes=classes))
    rows = []
    for mode in modes:
        step(f"packing mode={mode}")
        report = pack(root / "images", root / f"store-{mode}", mode=mode, progress=False)
        store = open_store(root / f"store-{mode}")
        step(f"reading back mode={mode}")
        store[0]  # warm-up: first use loads the decoder
        _, t_read = _timed(partial(_read_all, store))
        check, t_verify = _timed(partial(verify, store.path))
        rows.append(
            {
                "mode": mode,
                "images": len(store),
                "MB": store.nbytes / 1e6,
                "pack img/s": report.images_per_s,
                "read img/s": len(store) / t_read,
                "verify": "intact" if check.ok else "DAMAGED",
                "verify s": t_verify,
            }
        )
    step("loading the raw store with gpufeed.Loader")
    loaded = _load(root / "store-raw")
    print(f"\nsample images made in {t_make:.1f} s; stores in {root}/")
    header = list(rows[0])
    print("  ".join(f"{h:>11}" for h in header))
    for r in rows:
        print("  ".join(f"{v:>11.1f}" if isinstance(v, float) else f"{v!s:>11}" for v in r.values()))
    print("read img/s: store[i] one sample at a time on this CPU (decode included for jpeg).")
    print(
        f"gpufeed.Loader on {loaded['device']} ({loaded['tier']} tier): {loaded['img/s']:.0f} img/s, "
        f"batches of {loaded['shape']} {loaded['dtype']} (RandomResizedCrop 224 + flip + normalize, "
        f"{loaded['epochs']} epochs after a warm-up epoch)"
    )
    return rows + [loaded]


def _load(store_path: Path, epochs: int = 3) -> dict:
    """Time the Loader over the raw store on the GPU if there is one, else on the CPU."""
    import torch

    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
    from gpufeed.loader import Loader

    device = "cuda" if torch.cuda.is_available() else "cpu"
    store = open_store(store_path)
    batch = min(32, len(store))
    loader = Loader(
        store,
        batch_size=batch,
        device=device,
        dtype=torch.float16,
        augment=[RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()],
    )
    for _batch in loader:
        pass
    t0 = time.perf_counter()
    for _ in range(epochs):
        for images, _ in loader:  # noqa: B007  the last batch's shape and dtype are reported below
            pass
    if device == "cuda":
        torch.cuda.synchronize()
    rate = epochs * len(loader) * batch / (time.perf_counter() - t0)
    return {
        "mode": "loader",
        "device": device,
        "tier": loader.tier.name,
        "img/s": rate,
        "shape": tuple(images.shape),
        "dtype": str(images.dtype).replace("torch.", ""),
        "epochs": epochs,
    }
