"""Train torchvision's Mask R-CNN (or Keypoint R-CNN) on gpufeed batches: the images, boxes, instance
masks and keypoints cropped, flipped and turned together on the device.

    python examples/train_detection.py STORE [--model maskrcnn | keypointrcnn] [--size 512]
        [--batch-size 8] [--steps 100] [--device cuda] [--lr 0.01]
    python examples/train_detection.py --coco annotations/instances_val2017.json --images val2017/ STORE
    python examples/train_detection.py --demo STORE      # packs 16 generated photos first, to try it
    python examples/train_detection.py STORE --aspect    # native aspect ratios, batches by aspect ratio

STORE is a store with the fields "boxes" and "category" (a JSON list per image, as a COCO file
packs), and "masks" (Mask R-CNN) or "keypoints" (Keypoint R-CNN, 17 per person as COCO's). With
`--coco` the annotation file and its images folder are packed into STORE first (once). The batch
is `Loader(fields=(...))`'s: a zero-padded (N, M, 4) "boxes" with "boxes_count" and "boxes_kept",
"masks" (N, M, H, W), "keypoints" (N, M, K, 3); `gpufeed.loader.per_image` cuts them into the
per-image dicts torchvision's detection models take (boxes, labels, masks or keypoints). The models'
own resize is off (min_size = max_size = --size: the Loader already made that size) and their
normalisation too (the Loader's Normalize does it). Weights are random: the losses fall, the model
learns nothing useful in a few steps.

With `--aspect` the images keep their aspect ratio, as torchvision's reference scripts train:
shorter side --size, longer at most 5/3 of it, batches of one aspect group padded to a multiple of
32 (`Loader(group_by_aspect=True)`); each image and its masks are passed as views of their part of
the padded batch ("image_size"), which the model's own resize (set to the same sides) keeps.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torchvision

import gpufeed
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop, RandomRotation, Resize
from gpufeed.loader import per_image

COCO_FLIP = [0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15]  # COCO's persons: left and right swapped


def demo_store(dest: Path, keypoints: bool) -> None:
    """16 generated 96x128 photos with 1-4 elliptic objects each: masks, boxes, categories, keypoints."""
    from gpufeed.synth import natural_image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:96, :128]
    data = []
    for k in range(16):
        count = int(rng.integers(1, 5))
        cx, cy = rng.uniform(30, 98, count), rng.uniform(25, 71, count)
        rx, ry = rng.uniform(10, 25, count), rng.uniform(10, 20, count)
        masks = np.stack([((xx - cx[j]) / rx[j]) ** 2 + ((yy - cy[j]) / ry[j]) ** 2 < 1 for j in range(count)])
        boxes = np.stack([cx - rx, cy - ry, cx + rx, cy + ry], 1).clip(0, [128, 96, 128, 96])
        sample = {"image": natural_image(rng, 96, 128, k), "label": 0, "boxes": boxes,
                  "masks": masks.astype(np.uint8), "category": rng.integers(1, 4, count).tolist()}
        if keypoints:
            t = rng.uniform(0.2, 0.8, (count, 17, 2))
            xy = boxes[:, None, :2] + t * (boxes[:, None, 2:] - boxes[:, None, :2])
            sample["keypoints"] = np.concatenate([xy, np.full((count, 17, 1), 2.0)], 2)
        data.append(sample)
    gpufeed.pack(data, dest, mode="jpeg", progress=False)


def build(model: str, classes: int, size: int, longest: int) -> torch.nn.Module:
    """A detection model with random weights whose resize and normalisation are the Loader's."""
    kw = dict(weights=None, weights_backbone=None, min_size=size, max_size=longest, image_mean=[0.0] * 3,
              image_std=[1.0] * 3)
    if model == "maskrcnn":
        return torchvision.models.detection.maskrcnn_resnet50_fpn(num_classes=classes, **kw)
    return torchvision.models.detection.keypointrcnn_resnet50_fpn(num_classes=2, num_keypoints=17, **kw)


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--model", choices=("maskrcnn", "keypointrcnn"), default="maskrcnn")
    p.add_argument("--coco", help="an annotation file to pack into STORE first (with --images)")
    p.add_argument("--images", help="the annotation file's images folder")
    p.add_argument("--demo", action="store_true", help="pack 16 generated photos into STORE first")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--aspect", action="store_true", help="native aspect ratios, batches by aspect ratio")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    store = Path(a.store)
    if not (store / "manifest.json").exists():
        if a.demo:
            demo_store(store, keypoints=a.model == "keypointrcnn")
        elif a.coco:
            gpufeed.pack(a.coco, store, images=a.images, mode="jpeg")
        else:
            p.error(f"{store} is not a store: give one, or --coco FILE --images DIR, or --demo")
    opened = gpufeed.open(store)
    target = "masks" if a.model == "maskrcnn" else "keypoints"
    longest = a.size * 5 // 3 if a.aspect else a.size
    if a.aspect:
        ops = [Resize(a.size, max_size=longest), RandomHorizontalFlip(), Normalize()]
    else:
        ops = [RandomResizedCrop(a.size, scale=(0.5, 1)), RandomHorizontalFlip(), RandomRotation(10), Normalize()]
    loader = gpufeed.Loader(opened, batch_size=a.batch_size, device=a.device, augment=ops, dtype=torch.float32,
                            fields=("boxes", target, "category"), group_by_aspect=a.aspect,
                            keypoint_flip=COCO_FLIP if target == "keypoints" else None)
    classes = 1 + max((max(c) for c in (opened.field("category", i) for i in range(len(opened))) if c), default=1)
    model = build(a.model, classes, a.size, longest).to(a.device).train()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9, weight_decay=1e-4)
    losses, step, t0 = [], 0, time.perf_counter()
    while step < a.steps:
        for batch in loader:
            with torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16, enabled=a.device != "cpu"):
                # per image: its kept boxes, their categories (Keypoint R-CNN: persons, 1), masks or keypoints
                targets = per_image(batch, "category" if a.model == "maskrcnn" else None)
                images = list(batch["image"])
                if a.aspect:  # each image (and its masks) without its batch's padding: views
                    sizes = batch.host["image_size"]  # (the host's copy: no wait for the device)
                    images = [im[:, :h, :w] for im, (h, w) in zip(images, sizes)]
                    for t, (h, w) in zip(targets, sizes):
                        if "masks" in t:
                            t["masks"] = t["masks"][:, :h, :w]
                loss = sum(model(images, targets).values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            print(f"step {step}: loss {losses[-1]:.3f}", flush=True)
            if step == a.steps:
                break
    seconds = time.perf_counter() - t0
    print(f"{step} steps of {a.batch_size} in {seconds:.1f} s ({step * a.batch_size / seconds:.1f} img/s)")
    return losses


if __name__ == "__main__":
    main()
