"""Photo-like JPEGs for the benchmarks, and what one costs to decode.

Generated smooth images (`gpufeed.synth`) decode faster than photographs: they are one size, their
fields are smooth, and they carry no sensor noise, so a loader that keeps up with them can fall
behind on a real dataset (issue 62: 90-96 % of the ceiling on generated images, 59-75 % on photos).
`--data photos` (the training benchmarks' default) makes each image from a real photograph that an
installed package ships (matplotlib's always: it is a gpufeed dependency; scikit-image's where it is
installed), as ImageNet's images are:

- a random crop of half to all of the photograph, mirrored half of the time, each channel's gain
  drawn from 0.85-1.15;
- scaled to a size drawn like ImageNet's: the long side 500 px for 60 % of the images, else 300-700 px,
  at 4:3, 3:2, 5:4, 1:1 or 16:9, a quarter of them portrait (short sides down to 200 px);
- sensor noise, stronger in the bright parts (Gaussian, 3-12 levels at mid-grey, per channel, so
  colour noise too);
- saved at a JPEG quality drawn from 75-95 (4:2:0, as cameras and ImageNet's files are).

`--data smooth` keeps the older generated images (`--image` sized, q90). `describe` measures a
sample's bytes, pixels and Pillow's single-core decode time, so a table's images can be read
against ImageNet's (its 1.28M training files take about 140 GB: about 110 KB an image).
"""

from __future__ import annotations

import importlib.util
import io
import time
from pathlib import Path

import numpy as np

# (package, path inside it): the photographs each package ships in its wheel
SOURCES = (
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
    ("skimage", "data/astronaut.png"),
    ("skimage", "data/chelsea.png"),
    ("skimage", "data/coffee.png"),
    ("skimage", "data/motorcycle_left.png"),
    ("skimage", "data/motorcycle_right.png"),
    ("skimage", "data/rocket.jpg"),
    ("skimage", "data/hubble_deep_field.jpg"),
    ("skimage", "data/brick.png"),
    ("skimage", "data/grass.png"),
    ("skimage", "data/gravel.png"),
)
ASPECTS = ((4 / 3, 0.45), (3 / 2, 0.25), (5 / 4, 0.15), (1.0, 0.10), (16 / 9, 0.05))  # (long/short, share)
CHUNK = 64  # images per pool job


def sources() -> list[Path]:
    """The photographs of `SOURCES` that installed packages hold (found without importing them)."""
    found = []
    for package, inside in SOURCES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        path = Path(next(iter(spec.submodule_search_locations))) / inside
        if path.is_file():
            found.append(path)
    if not found:
        raise SystemExit("no photographs found: matplotlib (a gpufeed dependency) ships one; is it installed?")
    return found


def size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) drawn as described in the module's docstring."""
    long = 500 if rng.random() < 0.6 else int(rng.integers(300, 701))
    ratios, shares = zip(*ASPECTS)
    ratio = ratios[rng.choice(len(ratios), p=np.array(shares) / sum(shares))]
    short = max(200, round(long / ratio))
    return (short, long) if rng.random() < 0.25 else (long, short)


def photo(rng: np.random.Generator, source: np.ndarray, width: int, height: int) -> np.ndarray:
    """One HWC uint8 image of (`width`, `height`) from `source` (HWC uint8), as the module describes."""
    from PIL import Image

    sh, sw = source.shape[:2]
    area = rng.uniform(0.5, 1.0) * sh * sw
    cw = int(min(sw, max(16, np.sqrt(area * width / height))))
    ch = int(min(sh, max(16, cw * height / width)))
    x0, y0 = int(rng.integers(0, sw - cw + 1)), int(rng.integers(0, sh - ch + 1))
    crop = Image.fromarray(source[y0 : y0 + ch, x0 : x0 + cw]).resize((width, height), Image.Resampling.BICUBIC)
    img = np.asarray(crop, np.float32)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    img = img * rng.uniform(0.85, 1.15, 3).astype(np.float32)
    sigma = rng.uniform(3.0, 12.0)
    img = img + rng.standard_normal(img.shape, np.float32) * (sigma * np.sqrt(0.5 + img / 255))
    return np.clip(img, 0, 255).astype(np.uint8)


def load(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _write_chunk(job: tuple) -> None:
    """Pool job: images `start`..`stop` of class `label` into `folder`, each seeded by its number."""
    folder, label, start, stop, paths, seed = job
    from PIL import Image

    photos_ = [load(Path(p)) for p in paths]
    for i in range(start, stop):
        rng = np.random.default_rng([seed, label, i])
        width, height = size(rng)
        pixels = photo(rng, photos_[int(rng.integers(len(photos_)))], width, height)
        Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", quality=int(rng.integers(75, 96)))


def make_folder(root: Path, n: int, classes: int = 10, seed: int = 0) -> Path:
    """An ImageFolder tree (class_000/000000.jpg, ...) of `n` photo-like JPEGs, `classes` classes."""
    from gpufeed.processes import run_each

    paths = [str(p) for p in sources()]
    per_class = max(1, n // classes)
    jobs = []
    for c in range(classes):
        folder = root / f"class_{c:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs += [(folder, c, s, min(s + CHUNK, per_class), paths, seed) for s in range(0, per_class, CHUNK)]
    run_each(_write_chunk, jobs, here=n <= 256)  # (a smoke run's handful: here)
    return root


def describe(folder: Path, sample: int = 200) -> dict:
    """A sample of `folder`'s JPEGs (every k-th file, sorted): mean KB, mean megapixels, the spread of
    sides, and Pillow's whole-image decode on one core, in ms an image and ms a megapixel."""
    from PIL import Image

    files = sorted(folder.rglob("*.jpg"))
    files = files[:: max(1, len(files) // sample)][:sample]
    datas = [f.read_bytes() for f in files]
    sides, seconds = [], 0.0
    for data in datas:
        t0 = time.perf_counter()
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            sides.append(im.size)
        seconds += time.perf_counter() - t0
    pixels = np.array([w * h for w, h in sides], np.float64)
    flat = np.array(sides).ravel()
    return {"files": len(datas), "mean_kb": round(float(np.mean([len(d) for d in datas])) / 1e3, 1),
            "mean_mpixels": round(float(pixels.mean()) / 1e6, 3),
            "side_px_p5_p50_p95": [int(np.percentile(flat, q)) for q in (5, 50, 95)],
            "decode_ms_per_image": round(1e3 * seconds / len(datas), 3),
            "decode_ms_per_mpixel": round(1e3 * seconds / (pixels.sum() / 1e6), 3)}
