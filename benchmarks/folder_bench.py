"""Reading a folder of JPEGs in place against reading the store packed from it, and DALI's
`readers.file` on the same folder where nvidia-dali is installed (a benchmark-only import).

Times: building the header index (cold, no cache file), opening with the cached index, and one
evaluation pass (Resize(256), CenterCrop(224), Normalize, float16) over the folder, over a jpeg store
packed from it with its bytes kept (`reencode=False`: the same JPEGs), and through DALI. The rows of
the passes are interleaved over `--rounds`, so host drift hits each alike; the table gives median
(min-max) img/s over the rounds.

    python benchmarks/folder_bench.py --n 2000 --device cuda --rounds 3 --out folder.json
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import common
import feeds

SMOKE = dict(n=16, image="64x48", size=32, device="cpu", batch=4, rounds=1, root=None)


def gpufeed_pass(path: Path, device: str, batch: int, size: int) -> tuple[float, int]:
    import gpufeed
    from gpufeed.augment import CenterCrop, Normalize, Resize
    from gpufeed.bench.common import sync

    recipe = [Resize(round(size * 8 / 7)), CenterCrop(size), Normalize()]
    loader = gpufeed.Loader(path, batch_size=batch, device=device, shuffle=False, drop_last=False, augment=recipe)
    t0 = time.perf_counter()
    count = 0
    for images, _ in loader:
        count += len(images)
    sync(device)
    seconds = time.perf_counter() - t0
    loader.close()
    return seconds, count


def dali_pass(path: Path, batch: int, threads: int, size: int) -> tuple[float, int]:
    """The same evaluation pass through DALI: mixed decoder, resize shorter, crop + normalize."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(path), random_shuffle=False, name="reader")
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=round(size * 8 / 7))
        images = fn.crop_mirror_normalize(images, crop=(size, size), dtype=types.FLOAT16, output_layout="CHW",
                                          mean=[m * 255 for m in feeds.MEAN], std=[s * 255 for s in feeds.STD])
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["images", "labels"], reader_name="reader", last_batch_policy=LastBatchPolicy.PARTIAL)
    t0 = time.perf_counter()
    count = sum(len(out[0]["images"]) for out in it)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, count


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=2000, help="images (4 classes)")
    p.add_argument("--image", default="500x375", help="generated images' WIDTHxHEIGHT (q90 JPEGs)")
    p.add_argument("--size", type=int, default=224, help="CenterCrop's side (Resize to size*8/7 first)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--root", default=None, help="work folder, kept (default: a temporary one)")
    a = common.parse(p, argv, SMOKE)
    import gpufeed
    from gpufeed.loader import folder
    from gpufeed.synth import make_image_folder

    with common.workdir(a.root, "gpufeed-folder-bench-") as root:
        width, height = (int(x) for x in a.image.split("x"))
        images = make_image_folder(root / "images", per_class=max(1, a.n // 4), classes=4, width=width, height=height)
        t0 = time.perf_counter()
        folder.FolderStore(images).close()
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        folder.FolderStore(images).close()
        warm = time.perf_counter() - t0
        gpufeed.pack(images, root / "store", mode="jpeg", reencode=False, progress=False, overwrite=True)
        rows = {"gpufeed, folder in place": lambda: gpufeed_pass(images, a.device, a.batch, a.size),
                "gpufeed, packed store": lambda: gpufeed_pass(root / "store", a.device, a.batch, a.size)}
        if a.device.startswith("cuda") and feeds.has_dali():
            rows["DALI readers.file"] = lambda: dali_pass(images, a.batch, max(1, torch.get_num_threads()), a.size)
        results: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(a.rounds):
            for name, run in rows.items():
                seconds, count = run()
                results[name].append(count / seconds)
    print(f"{a.n} JPEGs {a.image}, device {a.device}: index built in {cold:.2f} s, opened with the cached index "
          f"in {warm:.3f} s")
    lines = [[name, common.cell(rates), ", ".join(f"{r:,.0f}" for r in rates)] for name, rates in results.items()]
    markdown = common.table(["reader", "img/s", "rounds"], lines)
    return common.write(a, __file__, results, markdown, a.device, index_build_s=cold, index_cached_open_s=warm)


if __name__ == "__main__":
    main()
