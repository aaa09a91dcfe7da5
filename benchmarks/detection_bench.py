"""Detection, segmentation and pose targets through the GPU augment, against torchvision's reference
detection pipeline, in one call.

The store: `--n` photo-like images of `--image`'s size (photos.py: crops of real photographs with
sensor noise; `--data smooth` keeps the older generated ones), each with 5 to 20 instances (COCO has
7 on average): an elliptic instance mask, its box, a category and 17 keypoints inside it, packed as
a jpeg store (q90). The augment:
RandomResizedCrop(`--size`, scale 0.3-1) + a horizontal flip (COCO's keypoint pairs swapped) +
RandomRotation(15) + Normalize, with every target.

- **loader**: images per second to the device with their boxes, masks, keypoints and categories
  over `--batches` batches after `--warmup`: gpufeed's Loader, and the reference (a torch DataLoader
  of `--workers` workers, each decoding the JPEG with torchvision.io, the masks from the store, and
  applying transforms.v2 to Image, BoundingBoxes, Mask and KeyPoints, then SanitizeBoundingBoxes;
  what torchvision's references/detection does), batches moved to the device as a training loop does.
- **ops**: one batch's GPU time (CUDA events, median of `--repeats`) of the image ops (the Augment
  on a uint8 batch of photos of `--image`'s size) and of its instance masks (`augment.masks`, from
  the store's runs), and the host time of its boxes and keypoints.
- **train**: each of `--models` (torchvision's Mask R-CNN, Keypoint R-CNN, RetinaNet or FCOS:
  ResNet-50 FPN, random init, bf16 autocast, SGD; its own resize off: min_size = max_size = `--size`)
  trained `--steps` steps after `--warmup` on one fixed batch of gpufeed's (the model's ceiling),
  then on each feed; `--train-repeats` rounds, the rows interleaved; img/s median (min-max) and %
  of the fixed batch. Both feeds make only the targets the model trains on (`MODEL_FIELDS`).
- **segmentation**: segmentation_bench's rows for `--segmentation` (DeepLabV3 by default) with the
  same settings, so one command gives the whole table.

    python benchmarks/detection_bench.py --n 800 --batch 8 --workers 16 --out detection.json
    # 3 models x 3 feeds x 3 repeats x (100 + 20) steps, then DeepLabV3's 3 x 3: about 11 minutes on
    # one H100 at batch 8 (--segmentation none leaves it out; fewer models with --models)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

import common

SMOKE = dict(n=6, image="64x48", size=32, device="cpu", batch=2, workers=0, batches=2, warmup=0, steps=1,
             repeats=1, workdir=None, models="maskrcnn", train_repeats=1, segmentation="none")
K = 17
FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]  # COCO's persons: left and right swapped
CATEGORIES = 10
TARGETS = ("boxes", "masks", "keypoints", "category")  # the loader rows' fields: every target
DATA = ("photos", "smooth")


class Photos:
    """The generated COCO-like samples, made when packing asks for each (a list of them all would
    hold gigabytes of masks). `data`: "photos" (photo-like pixels, photos.py) or "smooth"
    (`gpufeed.synth.natural_image`)."""

    def __init__(self, n: int, width: int, height: int, data: str = "photos"):
        if data not in DATA:
            raise SystemExit(f"--data {data}: choose from {', '.join(DATA)}")
        self.n, self.width, self.height, self.data = n, width, height, data
        self._sources: list[np.ndarray] | None = None

    def pixels(self, rng: np.random.Generator, k: int) -> np.ndarray:
        """Image `k`'s HWC uint8 pixels."""
        if self.data == "smooth":
            from gpufeed.synth import natural_image

            return natural_image(rng, self.height, self.width, k)
        import photos

        if self._sources is None:  # loaded once a process
            self._sources = [photos.load(path) for path in photos.sources()]
        return photos.photo(rng, self._sources[k % len(self._sources)], self.width, self.height)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> dict:
        if not 0 <= k < self.n:
            raise IndexError(k)
        rng, width, height = np.random.default_rng(k), self.width, self.height
        yy, xx = np.mgrid[:height, :width]
        count = int(rng.integers(5, 21))
        cx, cy = rng.uniform(0.1, 0.9, count) * width, rng.uniform(0.1, 0.9, count) * height
        rx, ry = rng.uniform(0.03, 0.2, count) * width, rng.uniform(0.03, 0.2, count) * height
        masks = np.stack([((xx - cx[j]) / rx[j]) ** 2 + ((yy - cy[j]) / ry[j]) ** 2 < 1 for j in range(count)])
        boxes = np.stack([np.clip(cx - rx, 0, width), np.clip(cy - ry, 0, height),
                          np.clip(cx + rx, 0, width), np.clip(cy + ry, 0, height)], 1)
        t = rng.uniform(0, 1, (count, K, 2))
        points = np.concatenate([boxes[:, None, :2] + t * (boxes[:, None, 2:] - boxes[:, None, :2]),
                                 np.full((count, K, 1), 2.0)], 2)
        return {"image": self.pixels(rng, k), "label": 0, "masks": masks.astype(np.uint8),
                "boxes": boxes, "keypoints": points, "category": rng.integers(1, CATEGORIES + 1, count).tolist()}


def make_store(root: Path, n: int, width: int, height: int, data: str = "photos") -> Path:
    """The generated COCO-like jpeg store (made once per `root`)."""
    import gpufeed

    dest = root / f"store-{data}-{n}-{width}x{height}"
    if not (dest / "manifest.json").exists():
        gpufeed.pack(Photos(n, width, height, data), dest, mode="jpeg", progress=False, overwrite=True)
    return dest


def gpufeed_loader(store: Path, a, epochs_seed: int = 0, fields: tuple[str, ...] = TARGETS):
    import gpufeed
    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop, RandomRotation

    ops = [RandomResizedCrop(a.size, scale=(0.3, 1)), RandomHorizontalFlip(), RandomRotation(15), Normalize()]
    return gpufeed.Loader(store, batch_size=a.batch, device=a.device, augment=ops, seed=epochs_seed,
                          fields=fields, keypoint_flip=FLIP if "keypoints" in fields else None)


def gpufeed_targets(batch: dict) -> tuple[torch.Tensor, list[dict]]:
    """A gpufeed batch as Mask R-CNN's images and per-image targets (`gpufeed.loader.per_image`; before
    cf8418b a loop here, measured at 61e9913)."""
    from gpufeed.loader import per_image

    return batch["image"], per_image(batch, "category")


class StoreReference(torch.utils.data.Dataset):
    """A torchvision reference pipeline over a gpufeed store (opened in each worker): item i's JPEG
    decoded by torchvision.io as a `tv_tensors.Image`, then `item(store, i, image)`, with `transforms()`
    (transforms.v2) made once a worker."""

    def __init__(self, store: Path, size: int):
        self.path, self.size, self.store, self.transform = store, size, None, None

    def __len__(self) -> int:
        import gpufeed

        return len(gpufeed.open(self.path))

    def __getitem__(self, i: int):
        import gpufeed
        from torchvision import tv_tensors
        from torchvision.io import decode_jpeg

        if self.store is None:  # opened in the worker
            self.store = gpufeed.open(self.path)
            self.transform = self.transforms()
        s = self.store
        data = torch.from_numpy(np.array(s.data[int(s.offsets[i]):int(s.offsets[i + 1])]))  # a copy, as a file read
        return self.item(s, i, tv_tensors.Image(decode_jpeg(data)))

    def transforms(self):
        raise NotImplementedError

    def item(self, store, i: int, image):
        raise NotImplementedError


class Reference(StoreReference):
    """torchvision's reference detection pipeline over the store: decode, the targets as tv_tensors
    (those of `fields`), transforms.v2 (the same ops), SanitizeBoundingBoxes."""

    def __init__(self, store: Path, size: int, fields: tuple[str, ...] = TARGETS):
        super().__init__(store, size)
        self.fields = fields

    def transforms(self):
        from torchvision.transforms import v2

        return v2.Compose([
            v2.RandomResizedCrop(self.size, scale=(0.3, 1), antialias=True), v2.RandomHorizontalFlip(),
            v2.RandomRotation(15), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), v2.SanitizeBoundingBoxes()])

    def item(self, s, i: int, image):
        from torchvision import tv_tensors

        hw = tuple(image.shape[-2:])
        target = {
            "boxes": tv_tensors.BoundingBoxes(torch.from_numpy(s.field("boxes", i)), format="XYXY", canvas_size=hw),
            "labels": torch.as_tensor(s.field("category", i), dtype=torch.int64),
        }
        if "masks" in self.fields:
            target["masks"] = tv_tensors.Mask(torch.from_numpy(s.field("masks", i)))
        if "keypoints" in self.fields:
            points = torch.from_numpy(s.field("keypoints", i)[..., :2])
            target["keypoints"] = tv_tensors.KeyPoints(points, canvas_size=hw)
        return self.transform(image, target)


def reference_loader(store: Path, a, fields: tuple[str, ...] = TARGETS):
    return torch.utils.data.DataLoader(
        Reference(store, a.size, fields), batch_size=a.batch, shuffle=True, num_workers=a.workers, collate_fn=as_lists,
        persistent_workers=a.workers > 0, pin_memory=a.device != "cpu", drop_last=True,
        # not forked: this process holds a CUDA context and gpufeed's threads by now
        multiprocessing_context="forkserver" if a.workers else None)


def as_lists(items: list) -> tuple:
    """A batch of (image, target) as (images, targets): detection targets differ in length."""
    return tuple(zip(*items))


def reference_targets(batch, device: str) -> tuple[torch.Tensor, list[dict]]:
    images, targets = batch
    moved = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
    return torch.stack(images).to(device, non_blocking=True), moved


def timed(batches, unpack, device: str, count: int, warmup: int, step=None) -> dict:
    """Images per second over `count` batches after `warmup`, each unpacked (and trained on)."""
    it = iter(batches)
    seen = 0
    t0 = time.perf_counter()
    for k in range(warmup + count):
        if k == warmup:
            if device != "cpu":
                torch.cuda.synchronize()
            t0, seen = time.perf_counter(), 0
        images, targets = unpack(next(it))
        if step is not None:
            step(images, targets)
        seen += len(images)
    if device != "cpu":
        torch.cuda.synchronize()
    return {"img_per_s": seen / (time.perf_counter() - t0), "images": seen}


def cycle(make):
    """Batches without end from one loader `make()` gives: epoch after epoch."""
    loader = make()
    while True:
        yield from loader


def op_times(store: Path, a) -> dict:
    """One batch's image ops and masks on the device, and its boxes and keypoints on the host."""
    import gpufeed
    from gpufeed.augment.boxes import transform_boxes_kept
    from gpufeed.augment.keypoints import transform_keypoints
    from gpufeed.augment.masks import DTYPES, transform_masks
    from gpufeed.synth import natural_image

    loader = gpufeed_loader(store, a)
    s = gpufeed.open(store)
    width, height = (int(x) for x in a.image.split("x"))
    rng = np.random.default_rng(1)
    images = torch.from_numpy(np.stack([natural_image(rng, height, width, k) for k in range(a.batch)])).to(a.device)
    params = loader.augment.sample(a.batch, height, width, torch.Generator().manual_seed(0))
    on_device = params.to(a.device)
    idx = np.arange(a.batch) % len(s)
    runs = [s.column("masks").runs(int(i)) for i in idx]
    boxes, points = [s.field("boxes", int(i)) for i in idx], [s.field("keypoints", int(i)) for i in idx]

    def gpu_ms(fn) -> float:
        return statistics.median(common.device_ms(fn, a.device, a.repeats))

    def host_ms(fn) -> float:  # the wall clock (fn synchronizes where it times GPU work)
        return statistics.median(common.device_ms(fn, "cpu", a.repeats))

    image_ms = gpu_ms(lambda: loader.augment.apply(images, on_device, torch.float16, channels_last=True))
    masks_ms = gpu_ms(lambda: transform_masks(runs, params, torch.device(a.device), True, DTYPES["|u1"]))
    # the floor of any masks op: writing its (N, M, H, W) uint8 output once
    shape = (a.batch, max(len(r) for r in runs), *params.final_hw)
    floor_ms = gpu_ms(lambda: torch.zeros(shape, dtype=torch.uint8, device=a.device))
    on_gpu = a.device.startswith("cuda")
    kernels = {name: common.kernel_ms(fn, a.repeats) if on_gpu else float("nan") for name, fn in (
        ("image_ops", lambda: loader.augment.apply(images, on_device, torch.float16, channels_last=True)),
        ("masks", lambda: transform_masks(runs, params, torch.device(a.device), True, DTYPES["|u1"])),
        ("floor", lambda: torch.zeros(shape, dtype=torch.uint8, device=a.device)))}
    masks_wall = host_ms(lambda: (transform_masks(runs, params, torch.device(a.device), True, DTYPES["|u1"]),
                                  torch.cuda.synchronize() if a.device != "cpu" else None))
    boxes_ms = host_ms(lambda: transform_boxes_kept(boxes, params))
    points_ms = host_ms(lambda: transform_keypoints(points, params, np.asarray(FLIP)))
    instances = sum(len(r) for r in runs)
    return {"image_ops_ms": image_ms, "masks_ms": masks_ms, "masks_floor_ms": floor_ms, "masks_wall_ms": masks_wall,
            "kernels_ms": kernels, "masks_kernels_of_image_ops": kernels["masks"] / kernels["image_ops"], "boxes_host_ms": boxes_ms,
            "keypoints_host_ms": points_ms, "instances": instances, "masks_of_image_ops": masks_ms / image_ms}


MODELS = {"maskrcnn": "Mask R-CNN", "keypointrcnn": "Keypoint R-CNN", "retinanet": "RetinaNet", "fcos": "FCOS"}
# the targets each model trains on: both feeds make only these for its rows, as its user would ask
MODEL_FIELDS = {"maskrcnn": ("boxes", "masks", "category"), "keypointrcnn": ("boxes", "keypoints", "category"),
                "retinanet": ("boxes", "category"), "fcos": ("boxes", "category")}


def trainer(a, name: str = "maskrcnn"):
    """A step of torchvision's detection model `name` (`MODELS`; ResNet-50 FPN, random init, bf16
    autocast, SGD; its own resize off) on (images, targets), given the targets that model takes:
    Mask R-CNN boxes, labels and masks; Keypoint R-CNN boxes and keypoints (every instance a person:
    label 1; keypoints without a visibility get one); RetinaNet and FCOS boxes and labels."""
    from torchvision.models import detection

    kw = dict(weights=None, weights_backbone=None, min_size=a.size, max_size=a.size, image_mean=[0.0] * 3,
              image_std=[1.0] * 3)
    if name == "keypointrcnn":
        model = detection.keypointrcnn_resnet50_fpn(num_classes=2, num_keypoints=K, **kw)
    else:
        model = getattr(detection, f"{name}_resnet50_fpn")(num_classes=CATEGORIES + 1, **kw)
    model = model.to(a.device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)

    def taken(t: dict) -> dict:
        if name == "maskrcnn":
            return {k: t[k] for k in ("boxes", "labels", "masks")}
        if name == "keypointrcnn":
            points = t["keypoints"]
            if points.shape[-1] == 2:  # (the reference's KeyPoints: x, y)
                points = torch.cat([points, torch.ones_like(points[..., :1])], -1)
            return {"boxes": t["boxes"], "labels": torch.ones_like(t["labels"]), "keypoints": points.float()}
        return {k: t[k] for k in ("boxes", "labels")}

    def step(images, targets):
        with torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16, enabled=a.device != "cpu"):
            loss = sum(model(list(images.float()), [taken(t) for t in targets]).values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def train_rows(a, feeds_, each: dict) -> dict:
    """Each of `--models` trained `--steps` steps after `--warmup`, fed one fixed batch (its ceiling)
    and then each feed (`feeds_(fields)`: the feeds making only the targets that model trains on,
    `MODEL_FIELDS`), `--train-repeats` times, the rows interleaved: img/s median (min-max). Every run
    goes into `each` as it ends."""
    samples: dict[str, list[float]] = {}
    steps = {name: trainer(a, name) for name in a.models.split(",")}
    ones = {}
    for model in steps:
        make, unpack = feeds_(MODEL_FIELDS[model])["gpufeed"]
        ones[model] = unpack(next(iter(make())))
    for k in range(a.train_repeats):
        for model, step in steps.items():
            rows = {"one fixed batch": (lambda one=ones[model]: fixed(one), lambda b: b), **feeds_(MODEL_FIELDS[model])}
            for feed, (make, unpack) in rows.items():
                r = timed(cycle(make), unpack, a.device, a.steps, a.warmup, step)
                samples.setdefault(f"{MODELS[model]}: {feed}", []).append(r["img_per_s"])
                each[f"{MODELS[model]}: {feed}, round {k + 1}"] = r
    return {name: {"img_per_s": common.spread(values), "samples": values} for name, values in samples.items()}


def fixed(batch):
    """The same unpacked batch without end: a model's ceiling (its step alone, no loader)."""
    while True:
        yield batch


def parser():
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=2000, help="generated photos")
    p.add_argument("--image", default="640x480", help="their WIDTHxHEIGHT")
    p.add_argument("--data", default="photos", choices=DATA,
                   help="photo-like pixels (photos.py) or smooth generated ones")
    p.add_argument("--size", type=int, default=512, help="RandomResizedCrop's side")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=16, help="the reference DataLoader's workers")
    p.add_argument("--batches", type=int, default=80, help="timed batches of the loader rows")
    p.add_argument("--warmup", type=int, default=20,
                   help="batches (and steps) before the timing: Triton compiles each kernel's variants in the first")
    p.add_argument("--steps", type=int, default=100, help="timed steps of each train row (0: no train rows)")
    p.add_argument("--models", default="maskrcnn,keypointrcnn,retinanet",
                   help=f"the train rows' models, comma-separated: {', '.join(MODELS)}")
    p.add_argument("--train-repeats", type=int, default=3,
                   help="the train rows' repeats, interleaved (each model: one fixed batch, gpufeed, the reference)")
    p.add_argument("--repeats", type=int, default=10, help="the ops rows' repeats")
    p.add_argument("--workdir", default=None, help="keeps the generated store (reused)")
    p.add_argument("--segmentation", default="deeplabv3_resnet50",
                   choices=["deeplabv3_resnet50", "fcn_resnet50", "none"],
                   help="then segmentation_bench's rows for this model, with the same images and settings")
    return p


def main(argv: list[str] | None = None) -> dict:
    a = common.parse(parser(), argv, SMOKE)
    width, height = (int(x) for x in a.image.split("x"))
    runs: dict = {}
    each = common.Rows(a.out, __file__)  # every row and train run as it ends: a time limit keeps what ran
    with common.workdir(a.workdir, "gpufeed-detection-bench-") as root:
        store = make_store(root, a.n, width, height, a.data)
        def feeds_(fields: tuple[str, ...] = TARGETS) -> dict:
            return {
                "gpufeed": (lambda: gpufeed_loader(store, a, fields=fields), gpufeed_targets),
                f"torchvision reference, {a.workers} workers": (lambda: reference_loader(store, a, fields),
                                                                lambda b: reference_targets(b, a.device)),
            }

        for name, (make, unpack) in feeds_().items():
            runs[f"loader: {name}"] = each[f"loader: {name}"] = timed(cycle(make), unpack, a.device, a.batches, a.warmup)
        runs["ops"] = each["ops"] = op_times(store, a)
        train = train_rows(a, feeds_, each) if a.steps else {}
    ops = runs.pop("ops")
    k = ops["kernels_ms"]
    lines = [[name, f"{r['img_per_s']:,.0f}", ""] for name, r in runs.items()]
    for name, r in train.items():
        model = name.split(":")[0]
        ceiling = train.get(f"{model}: one fixed batch", {}).get("img_per_s", {}).get("median")
        share = "" if not ceiling else f"{100 * r['img_per_s']['median'] / ceiling:.1f}"
        lines.append([name, common.cell(r["samples"]), share])
    runs |= train
    markdown = common.table(["row", "img/s", "% of the fixed batch"], lines) + "\n\n" + common.table(
        ["one batch of " + str(a.batch), "ms"],
        [["image ops: GPU kernels / events around the call", f"{k['image_ops']:.3f} / {ops['image_ops_ms']:.2f}"],
         [f"instance masks, {ops['instances']}: GPU kernels / events around the call",
          f"{k['masks']:.3f} / {ops['masks_ms']:.2f}"],
         ["instance masks, wall with host preparation", f"{ops['masks_wall_ms']:.2f}"],
         ["writing the masks' output once, (N, M, H, W) uint8 (the floor): GPU kernels",
          f"{k['floor']:.3f}"],
         ["boxes (host)", f"{ops['boxes_host_ms']:.2f}"], ["keypoints (host)", f"{ops['keypoints_host_ms']:.2f}"],
         ["masks' GPU kernels / image ops'", f"{ops['masks_kernels_of_image_ops']:.2f}"],
         ["the floor's / image ops'", f"{k['floor'] / k['image_ops']:.2f}"]])
    if a.segmentation != "none":  # the whole table of issue 68 from one command
        segmentation = segmentation_rows(a)
        runs["segmentation"] = segmentation["runs"]
        markdown += "\n\n" + segmentation["table"]
    return common.write(a, __file__, {**runs, "ops": ops}, markdown, a.device)


def segmentation_rows(a) -> dict:
    """segmentation_bench's train rows for `--segmentation` on the same kind of images, with the same
    size, batch, workers, steps and rounds (its own store of label maps)."""
    import segmentation_bench

    return segmentation_bench.main(segmentation_argv(a))


def segmentation_argv(a) -> list[str]:
    """segmentation_bench's arguments for this run's settings."""
    argv = ["--n", str(a.n), "--image", a.image, "--data", a.data, "--size", str(a.size), "--model", a.segmentation,
            "--device", a.device, "--batch", str(a.batch), "--workers", str(a.workers), "--warmup", str(a.warmup),
            "--steps", str(max(1, a.steps)), "--train-repeats", str(a.train_repeats)]
    return argv + (["--workdir", a.workdir] if a.workdir else [])


if __name__ == "__main__":
    main()
