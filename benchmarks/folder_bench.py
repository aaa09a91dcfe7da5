"""Reading a folder of JPEGs in place against reading the store packed from it, and DALI's
`readers.file` on the same folder where nvidia-dali is installed (a benchmark-only import).

Times: building the header index (cold, no cache file), opening with the cached index, and one
evaluation pass (Resize(256), CenterCrop(224), Normalize, float16) over the folder, over a jpeg store
packed from it with its bytes kept (`reencode=False`: the same JPEGs), and through DALI. The rows of
the passes are interleaved over `--rounds`, so host drift hits each alike; medians are reported.

    PYTHONPATH=src python benchmarks/folder_bench.py --n 2000 --device cuda --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import gpufeed
from gpufeed.augment import CenterCrop, Normalize, Resize
from gpufeed.loader import folder
from gpufeed.synth import make_image_folder

OPS = [Resize(256), CenterCrop(224), Normalize()]


def gpufeed_pass(path: Path, device: str, batch: int) -> tuple[float, int]:
    loader = gpufeed.Loader(path, batch_size=batch, device=device, shuffle=False, drop_last=False, augment=OPS)
    t0 = time.perf_counter()
    count = 0
    for images, _ in loader:
        count += len(images)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    loader.close()
    return seconds, count


def dali_pass(path: Path, batch: int, threads: int) -> tuple[float, int] | None:
    try:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError:
        return None

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(path), random_shuffle=False, name="reader")
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=256)
        images = fn.crop_mirror_normalize(images, crop=(224, 224), dtype=types.FLOAT16, output_layout="CHW",
                                          mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                          std=[0.229 * 255, 0.224 * 255, 0.225 * 255])
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="reader", last_batch_policy=LastBatchPolicy.PARTIAL)
    t0 = time.perf_counter()
    count = sum(len(out[0]["images"]) for out in it)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="images (4 classes)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--root", default=None, help="work folder (default: a temporary one)")
    a = p.parse_args()
    root = Path(a.root or tempfile.mkdtemp(prefix="gpufeed-folder-bench-"))
    images = make_image_folder(root / "images", per_class=a.n // 4, classes=4)
    t0 = time.perf_counter()
    folder.FolderStore(images).close()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    folder.FolderStore(images).close()
    warm = time.perf_counter() - t0
    gpufeed.pack(images, root / "store", mode="jpeg", reencode=False, progress=False)
    print(f"{a.n} JPEGs 500x375, device {a.device}: index built in {cold:.2f} s, opened with the cached index "
          f"in {warm:.3f} s")
    rows = {"gpufeed, folder in place": lambda: gpufeed_pass(images, a.device, a.batch),
            "gpufeed, packed store": lambda: gpufeed_pass(root / "store", a.device, a.batch)}
    if a.device == "cuda":
        rows["DALI readers.file"] = lambda: dali_pass(images, a.batch, max(1, (torch.get_num_threads() or 4)))
    results: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(a.rounds):
        for name, run in rows.items():
            out = run()
            if out is None:
                results.pop(name, None)
                continue
            seconds, count = out
            results[name].append(count / seconds)
    print("| reader | img/s (median of rounds) | rounds |\n|---|---:|---|")
    for name, rates in results.items():
        if rates:
            print(f"| {name} | {statistics.median(rates):,.0f} | {', '.join(f'{r:,.0f}' for r in rates)} |")
    if a.root is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
