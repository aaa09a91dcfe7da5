"""The data a training benchmark feeds its model, by row name: train_bench.py's rows, which
ddp_bench.py (`--train`) and start_bench.py use too.

Rows (`name` or `name:KEY=VALUE,...`):
- `synthetic`: one batch already on the device, given again every step: the ceiling.
- `raw`: gpufeed.Loader on the raw store (`<work>/raw`).
- `jpeg`: gpufeed.Loader on the jpeg store (`<work>/jpeg`) with its defaults. KEY=VALUE settings are
  Loader arguments (`num_workers=8`, `decoders=(hw+cpu)`), fields of the JPEG path's
  `gpufeed.decode.tuning.Tuning` (`pipelines=2,gpu_min=0.3` builds `Tuning(pipelines=2, gpu_min=0.3)`),
  `policy=randaugment|trivialaugment|autoaugment` (that policy added to the recipe after the flip) or
  `gc=freeze` (the training loop's: `gc.freeze()` before the timed steps, so that full collections
  traverse only what was made since). `raw` takes the same, and so does `sharded`: the same JPEGs in
  a sharded store (`<work>/sharded`, 16 MB shards, made by `prepare` when a row asks for it), as a store in a
  bucket is read from its cache once downloaded.
- `folder`: gpufeed.Loader on the image folder itself (`<work>/images`), read in place, with the
  same settings as `jpeg` (a `--baseline` row reads the same folder).
- `dataloader`: torch DataLoader over the image folder, PIL, uint8 to the device, normalized there
  (`workers=N`, default all cores).
- `dali`: NVIDIA DALI on the image folder (nvidia-dali installed: a benchmark-only import).

The recipe everywhere: RandomResizedCrop `size` + flip (+ policy) + normalize.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
POLICIES = ("randaugment", "trivialaugment", "autoaugment")


DATA = ("photos", "smooth")
GPUFEED_ROWS = ("raw", "jpeg", "sharded", "folder")  # the rows gpufeed.Loader feeds
STORE_ROWS = ("raw", "jpeg", "sharded")  # those reading a store packed from the images


def prepare(work: Path, n: int, image: tuple[int, int] = (500, 375), raw_side: int = 256,
            sharded: bool = False, data: str = "photos") -> Path:
    """`work`/images (`n` JPEGs, 10 classes: `data` "photos", photo-like ones of ImageNet's spread of
    sizes and qualities (photos.py), or "smooth", generated `image` (width, height) q90 ones),
    `work`/raw (packed to `raw_side`²), `work`/jpeg (the same JPEGs' bytes) and with `sharded`
    `work`/sharded (those in 16 MB shards), each made only if missing: before any row is timed, in one
    process. `work`/data.json says what the images are, with a sample's bytes, pixels and decode time
    (`photos.describe`); a `work` made with other images is refused, not mixed."""
    import gpufeed

    make_images(work, n, image, data)
    for name in ("raw", "jpeg", *(("sharded",) if sharded else ())):
        if not (work / name).exists():
            gpufeed.pack(work / "images", work / name, progress=False, **pack_settings(name, raw_side))
    return work


def make_images(work: Path, n: int, image: tuple[int, int] = (500, 375), data: str = "photos") -> Path:
    """`work`/images: `n` JPEGs in 10 classes, `data` "photos" (photo-like, photos.py) or "smooth"
    (generated, `image` (width, height), q90), made only if missing, and `work`/data.json saying which
    with a sample's bytes, pixels and decode time; a `work` made with other images is refused."""
    import json

    import photos

    from gpufeed.synth import make_image_folder

    if data not in DATA:
        raise SystemExit(f"--data {data}: choose from {', '.join(DATA)}")
    want = {"data": data, "n": n} | ({"image": list(image)} if data == "smooth" else {})
    record = work / "data.json"
    if (work / "images").exists():
        had = json.loads(record.read_text()) if record.exists() else {"data": "smooth (unrecorded)"}
        if {k: had.get(k) for k in want} != want:
            raise SystemExit(f"{work}: holds images made as {had}, not {want}: use another --workdir")
    else:
        if data == "photos":
            photos.make_folder(work / "images", n)
        else:
            make_image_folder(work / "images", per_class=max(1, n // 10), classes=10, width=image[0],
                              height=image[1])
        record.write_text(json.dumps(want | {"sample": photos.describe(work / "images")}))
    return work / "images"


def pack_settings(name: str, raw_side: int) -> dict:
    """How `prepare` packs the store the row `name` reads (`raw`, `jpeg`, `sharded`): `gpufeed.pack`'s
    arguments beside the folder, the destination and `progress`."""
    return {"raw": {"size": raw_side}, "jpeg": {"mode": "jpeg", "reencode": False},
            "sharded": {"mode": "jpeg", "reencode": False, "shard_size": "16MB"}}[name]


def described(work: Path) -> dict:
    """What `prepare` recorded of `work`'s images (data.json), for a benchmark's record."""
    import json

    record = work / "data.json"
    return json.loads(record.read_text()) if record.exists() else {}


def wants_sharded(rows) -> bool:
    """Whether any of `rows` (names, with or without settings) reads the sharded store."""
    return any(row.partition(":")[0] == "sharded" for row in rows)


def ops(policy: str | None = None, size: int = 224):
    """The training recipe: crop, flip, normalize; `policy` adds that policy after the flip, as
    torchvision's and timm's recipes do."""
    from gpufeed import augment as A

    if policy not in (None, *POLICIES):
        raise SystemExit(f"policy={policy}: choose from {', '.join(POLICIES)}")
    extra = {None: [], "randaugment": [A.RandAugment(2, 9)], "trivialaugment": [A.TrivialAugmentWide()],
             "autoaugment": [A.AutoAugment("imagenet")]}[policy]
    return [A.RandomResizedCrop(size), A.RandomHorizontalFlip(), *extra, A.Normalize(MEAN, STD)]


def settings(row: str) -> dict:
    """A row's KEY=VALUE settings (`name:KEY=VALUE,...`) as Python values: numbers, None/True/False,
    `(a+b)` a tuple of names, else text."""
    return {k: _value(v) for k, v in (kv.split("=", 1) for kv in row.partition(":")[2].split(",") if "=" in kv)}


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.startswith(("(", "[")):
        return tuple(x for x in text.strip("()[]").split("+") if x)
    return {"None": None, "True": True, "False": False}.get(text, text)


class Feed:
    """A row made ready: `batches` yields (images, labels) on the device forever; `build_s` is the
    time the row took to build; `stats` the Loader's counters (None for the other rows); `loop`
    the training loop's own settings (`gc`)."""

    def __init__(self, batches, build_s: float, loader=None, loop: dict | None = None):
        self.batches, self.build_s, self.loader, self.loop = batches, build_s, loader, loop or {}

    def stats(self) -> dict | None:
        return self.loader.stats() if self.loader is not None else None

    def close(self) -> None:
        if self.loader is not None and hasattr(self.loader, "close"):
            self.loader.close()


def check(row: str) -> None:
    """Refuse a row whose name or setting does not exist (a knob removed since a table was made)."""
    import inspect

    import gpufeed
    from gpufeed.decode.tuning import Tuning

    name = row.partition(":")[0]
    known = {"synthetic": set(), "dataloader": {"workers"}, "dali": {"threads"},
             "raw": {*inspect.signature(gpufeed.Loader).parameters, *Tuning.names(), "policy"} - {"self", "store"}}
    known["jpeg"] = known["sharded"] = known["folder"] = known["raw"]
    if name not in known:
        raise SystemExit(f"unknown row {row!r}: synthetic, raw, jpeg, sharded, folder, dataloader or dali")
    unknown = set(settings(row)) - known[name] - {"gc"}
    if unknown:
        raise SystemExit(f"row {row!r}: no setting {', '.join(sorted(unknown))} (Loader arguments, Tuning fields, "
                         "policy, gc; dataloader: workers; dali: threads)")


def feed(row: str, work: Path, batch: int, device: str = "cuda", size: int = 224,
         shard: tuple[int, int] = (0, 1)) -> Feed:
    """Build `row` on `work`'s data (see the module's docstring). `shard` (rank, ranks) is the part of
    the folder the `dali` row reads under torchrun; gpufeed's rows find their rank themselves."""
    name = row.partition(":")[0]
    kwargs = settings(row)
    loop = {"gc": kwargs.pop("gc", None)}
    t0 = time.perf_counter()
    if name == "synthetic":
        import torch

        images = torch.randn(batch, 3, size, size, device=device).half()
        labels = torch.randint(0, 1000, (batch,), device=device)
        return Feed(_forever(lambda: [(images, labels)]), time.perf_counter() - t0, loop=loop)
    if name == "sharded" and not (work / name).exists():
        raise SystemExit(f"{work / name}: missing (feeds.prepare(..., sharded=True) makes it before the rows)")
    if name in GPUFEED_ROWS:
        loader = _gpufeed(_images(work) if name == "folder" else work / name, batch, device, size, kwargs)
        return Feed(_forever(lambda: loader), time.perf_counter() - t0, loader, loop)
    if name == "dataloader":
        return Feed(_dataloader(work / "images", batch, device, size, kwargs.get("workers")),
                    time.perf_counter() - t0, loop=loop)
    if name == "dali":
        loader = dali_loader(work / "images", batch, kwargs.get("threads", 8), [m * 255 for m in MEAN],
                             [s * 255 for s in STD], size, shard)
        batches = _forever(lambda: ((out[0]["images"], out[0]["labels"].view(-1).long()) for out in loader))
        return Feed(batches, time.perf_counter() - t0, loop=loop)
    raise SystemExit(f"unknown row {row!r}: synthetic, raw, jpeg, sharded, folder, dataloader or dali")


def _forever(epoch):
    """The batches of `epoch()` (an iterable of one epoch), epoch after epoch."""
    while True:
        yield from epoch()


def _images(work: Path) -> Path:
    """The image folder of `work`, or of the work folder a baseline's (`<work>/baseline`) is in."""
    return work / "images" if (work / "images").is_dir() else work.parent / "images"


def _gpufeed(store: Path, batch: int, device: str, size: int, kwargs: dict):
    """gpufeed.Loader on `store` with the recipe; Tuning fields among `kwargs` become its `tuning`."""
    import gpufeed
    from gpufeed.decode.tuning import Tuning

    tuned = tuning({key: kwargs.pop(key) for key in list(kwargs) if key in Tuning.names()})
    if tuned is not None:
        kwargs["tuning"] = tuned
    recipe = ops(kwargs.pop("policy", None), size)
    return gpufeed.Loader(store, batch_size=batch, device=device, augment=recipe, **kwargs)


def tuning(given: dict):
    """`gpufeed.decode.tuning.Tuning` with the `given` fields (each cast to its default's type; as
    given where the default is None), or None (the defaults) if none is given."""
    from gpufeed.decode.tuning import Tuning

    unknown = set(given) - set(Tuning.names())
    if unknown:
        raise SystemExit(f"{', '.join(sorted(unknown))}: not among Tuning's fields ({', '.join(Tuning.names())})")
    defaults = Tuning()

    def cast(k, v):
        default = getattr(defaults, k)
        return v if default is None else type(default)(v)

    return Tuning(**{k: cast(k, v) for k, v in given.items()}) if given else None


def _dataloader(folder: Path, batch: int, device: str, size: int, workers: int | None):
    """torch DataLoader(ImageFolder) with PIL crops, uint8 to `device`, normalized there, forever."""
    import torch
    from torchvision import datasets

    workers = os.cpu_count() if workers is None else workers
    dl = torch.utils.data.DataLoader(datasets.ImageFolder(folder, cpu_recipe(size)), batch_size=batch, shuffle=True,
                                     drop_last=True, num_workers=workers, pin_memory=device.startswith("cuda"),
                                     persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    yield from normalized(_forever(lambda: dl), device)


def cpu_recipe(size: int):
    """The recipe on PIL images, for the rows that decode on the CPU: RandomResizedCrop `size`, flip,
    uint8 CHW (normalized on the device by `normalized`)."""
    from torchvision import transforms

    return transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                               transforms.PILToTensor()])


def normalized(batches, device: str):
    """(uint8 NCHW images, labels) batches on `device`, the images normalized (MEAN, STD) to fp16."""
    import torch

    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        yield ((x.float() - mean) / std).half(), y


def dali_loader(folder: Path, batch: int, threads: int, mean, std, size: int = 224, shard: tuple[int, int] = (0, 1)):
    """NVIDIA DALI on the JPEG files under `folder`, the usual GPU recipe: mixed decoder with the
    random crop fused in (`decoders.image_random_crop`), resize to `size`, flip + normalize (`mean`,
    `std` in 0-255) -> fp16 CHW, as torch tensors; `shard` (rank, ranks): the reader's shard, as
    DALI's own multi-GPU examples set it. Needs the nvidia-dali wheel for this CUDA: a comparison
    only, never a gpufeed dependency."""
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=torch.cuda.current_device(), seed=0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(folder), random_shuffle=True, shard_id=shard[0],
                                         num_shards=shard[1], name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_x=size, resize_y=size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW", mean=list(mean),
                                          std=list(std), mirror=fn.random.coin_flip())
        return images, labels.gpu()

    return DALIGenericIterator([pipe()], ["images", "labels"], reader_name="reader", auto_reset=True,
                               last_batch_policy=LastBatchPolicy.DROP)


def has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True
