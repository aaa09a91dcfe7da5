"""Train a timm model on gpufeed batches with timm's Mixup/CutMix and label smoothing.

    python examples/timm_train.py --store stores/train [--model resnet50] [--epochs 1]

gpufeed makes the batch (decode, RandomResizedCrop, flip, normalize) on the device; timm's `Mixup`
then mixes each batch there (it switches between MixUp and CutMix per batch) and turns the labels
into smoothed soft targets, which `SoftTargetCrossEntropy` takes. Nothing else changes in a timm
training loop.
"""

from __future__ import annotations

import argparse

import timm
import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy

import gpufeed
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    a = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader = gpufeed.Loader(a.store, batch_size=a.batch_size, device=device, dtype=torch.float32,
                            augment=[RandomResizedCrop(a.size), RandomHorizontalFlip(), Normalize()])
    classes = len(loader.store.classes)
    model = timm.create_model(a.model, num_classes=classes).to(device, memory_format=torch.channels_last)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, label_smoothing=0.1, num_classes=classes)
    criterion = SoftTargetCrossEntropy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    losses = []
    for _ in range(a.epochs):
        for images, labels in loader:
            images, targets = mixup(images, labels)  # soft targets (batch, classes), rows sum to 1
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"steps": len(losses), "losses": losses, "targets": targets}


if __name__ == "__main__":
    result = main()
    print(f"{result['steps']} steps, last loss {result['losses'][-1]:.3f}")
