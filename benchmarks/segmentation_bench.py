"""Semantic segmentation fed by gpufeed, against torchvision's reference transforms.v2 pipeline and the
model's own ceiling, in one call (issue 68).

The store: `--n` photo-like images (`--image`, q90 JPEGs; `--data smooth`: generated ones), each
with a label map (`masks`, uint8): detection_bench's 5 to 20 ellipses of its 10 categories over
background 0, packed as a jpeg store. The augment: RandomResizedCrop(`--size`, scale 0.3-1) + a
horizontal flip + RandomRotation(15) + Normalize, the label map through the same crops, flips and
turns (nearest), 255 where the image takes a fill (`mask_fill=255`, the loss's ignore index).

- **train**: torchvision's `--model` (deeplabv3_resnet50 or fcn_resnet50: random init, bf16
  autocast, SGD, cross entropy ignoring 255) trained `--steps` steps after `--warmup`, fed one fixed
  batch of gpufeed's (the model's ceiling), gpufeed's Loader, and the reference (a torch DataLoader of
  `--workers` workers: torchvision.io's decode, the label map as a `tv_tensors.Mask`, the same ops in
  transforms.v2, the fill 255 for the map); `--train-repeats` rounds, the rows interleaved: img/s
  median (min-max) and % of the fixed batch.

    python benchmarks/segmentation_bench.py --n 2000 --workers 16 --out segmentation.json
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import common
from detection_bench import CATEGORIES, DATA, Photos, StoreReference

SMOKE = dict(n=6, image="64x48", size=32, device="cpu", batch=2, workers=0, warmup=1, steps=1, train_repeats=1,
             workdir=None)
IGNORE = 255  # the label maps' fill, and the loss's ignore index


class Maps(Photos):
    """detection_bench's photo-like images (or `--data smooth` generated ones), each with its instances
    painted into one label map (each ellipse its category, later ones over earlier ones), made when
    packing asks for each."""

    def __getitem__(self, k: int) -> dict:
        sample = super().__getitem__(k)
        labels = np.zeros(sample["masks"].shape[1:], np.uint8)
        for mask, category in zip(sample["masks"], sample["category"], strict=True):
            labels[mask.astype(bool)] = category
        return {"image": sample["image"], "label": 0, "masks": labels}


def make_store(root: Path, a) -> Path:
    """The generated jpeg store of photos and label maps (made once per `root`)."""
    import gpufeed

    width, height = (int(x) for x in a.image.split("x"))
    dest = root / f"store-{a.data}-{a.n}-{a.image}"
    if not (dest / "manifest.json").exists():
        gpufeed.pack(Maps(a.n, width, height, a.data), dest, mode="jpeg", progress=False, overwrite=True)
    return dest


def gpufeed_loader(store: Path, a):
    import gpufeed
    from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop, RandomRotation

    ops = [RandomResizedCrop(a.size, scale=(0.3, 1)), RandomHorizontalFlip(), RandomRotation(15), Normalize()]
    return gpufeed.Loader(store, batch_size=a.batch, device=a.device, augment=ops, fields=("masks",),
                          mask_fill=IGNORE)


def gpufeed_batch(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["image"], batch["masks"].long()


class Reference(StoreReference):
    """torchvision's reference segmentation pipeline over the store: decode, the label map as a Mask,
    transforms.v2 (the same ops; 255 where the map takes a fill)."""

    def transforms(self):
        from torchvision import tv_tensors
        from torchvision.transforms import v2

        fill = {tv_tensors.Image: 0, tv_tensors.Mask: IGNORE}
        return v2.Compose([
            v2.RandomResizedCrop(self.size, scale=(0.3, 1), antialias=True), v2.RandomHorizontalFlip(),
            v2.RandomRotation(15, fill=fill), v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def item(self, s, i: int, image):
        from torchvision import tv_tensors

        image, labels = self.transform(image, tv_tensors.Mask(torch.from_numpy(s.field("masks", i))))
        return image, labels.long()


def reference_loader(store: Path, a):
    return torch.utils.data.DataLoader(
        Reference(store, a.size), batch_size=a.batch, shuffle=True, num_workers=a.workers, drop_last=True,
        persistent_workers=a.workers > 0, pin_memory=a.device != "cpu",
        # not forked: this process holds a CUDA context and gpufeed's threads by now
        multiprocessing_context="forkserver" if a.workers else None)


def reference_batch(batch, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch
    return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def trainer(a):
    """A step of torchvision's `--model` on (images, label maps): random init, bf16 autocast, SGD."""
    from torchvision.models import segmentation

    model = getattr(segmentation, a.model)(weights=None, weights_backbone=None, num_classes=CATEGORIES + 1,
                                           aux_loss=False).to(a.device).to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(images, labels):
        with torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16, enabled=a.device != "cpu"):
            out = model(images.float().contiguous(memory_format=torch.channels_last))["out"]
            loss = torch.nn.functional.cross_entropy(out.float(), labels, ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def parser():
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=2000, help="generated photos")
    p.add_argument("--image", default="640x480", help="their WIDTHxHEIGHT")
    p.add_argument("--data", default="photos", choices=DATA,
                   help="photo-like pixels (photos.py) or smooth generated ones")
    p.add_argument("--size", type=int, default=512, help="RandomResizedCrop's side")
    p.add_argument("--model", default="deeplabv3_resnet50", choices=["deeplabv3_resnet50", "fcn_resnet50"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=16, help="the reference DataLoader's workers")
    p.add_argument("--warmup", type=int, default=20, help="steps before the timing")
    p.add_argument("--steps", type=int, default=100, help="timed steps of each row")
    p.add_argument("--train-repeats", type=int, default=3, help="rounds of the rows, interleaved")
    p.add_argument("--workdir", default=None, help="keeps the generated store (reused)")
    return p


def main(argv: list[str] | None = None) -> dict:
    from detection_bench import cycle, fixed, timed

    a = common.parse(parser(), argv, SMOKE)
    samples: dict[str, list[float]] = {}
    each = common.Rows(a.out, __file__)  # every run as it ends: a time limit keeps what ran
    with common.workdir(a.workdir, "gpufeed-segmentation-bench-") as root:
        store = make_store(root, a)
        feeds = {
            "gpufeed": (lambda: gpufeed_loader(store, a), gpufeed_batch),
            f"torchvision reference, {a.workers} workers": (lambda: reference_loader(store, a),
                                                            lambda b: reference_batch(b, a.device)),
        }
        one = gpufeed_batch(next(iter(gpufeed_loader(store, a))))
        rows = {"one fixed batch": (lambda: fixed(one), lambda b: b), **feeds}
        step = trainer(a)
        for k in range(a.train_repeats):
            for name, (make, unpack) in rows.items():
                r = timed(cycle(make), unpack, a.device, a.steps, a.warmup, step)
                samples.setdefault(name, []).append(r["img_per_s"])
                each[f"{name}, round {k + 1}"] = r
    runs = {name: {"img_per_s": common.spread(values), "samples": values} for name, values in samples.items()}
    ceiling = runs["one fixed batch"]["img_per_s"]["median"]
    lines = [[name, common.cell(r["samples"]), f"{100 * r['img_per_s']['median'] / ceiling:.1f}"]
             for name, r in runs.items()]
    markdown = common.table([f"{a.model}, batch {a.batch} at {a.size}", "img/s", "% of the fixed batch"], lines)
    return common.write(a, __file__, runs, markdown, a.device)


if __name__ == "__main__":
    main()
