"""Predict the top-5 classes of every image of a folder (or store) with a torchvision model, into a CSV.

    python examples/predict_folder.py INPUT --out predictions.csv [--weights imagenet | PATH]
        [--classes FILE] [--model resnet50] [--batch-size 256] [--device cuda] [--limit N]

INPUT is anything `gpufeed.Loader` reads: a store, or a folder, CSV/JSONL list or tar shards read in
place (no packing for one pass). The Loader makes one pass in order, each image once (`pad=False`,
`drop_last=False`), with torchvision's evaluation transform (Resize 256, CenterCrop 224, Normalize)
done on the device; the model runs channels_last under `torch.inference_mode`, in bf16 on a GPU and in
fp32 on the CPU (where bf16 was 4 times slower on the CPU tried: 1 image a second against 4). Each CSV
row is `source,top1,p1,...,top5,p5` (softmax probabilities).

Weights: `imagenet` takes torchvision's ImageNet weights (IMAGENET1K_V2 where the model has them;
downloaded once into torch's cache), PATH a state dict or a checkpoint with a "model" entry (as
README's training loop saves). Without `--weights` the model has random weights: the file is right in
form, the predictions are meaningless. Class names: `--classes` (one per line), else the input's
class folders when they number the model's outputs, else ImageNet's names with `--weights imagenet`,
else the class indices.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
import warnings
from pathlib import Path

import torch
import torchvision

import gpufeed
from gpufeed.augment import CenterCrop, Normalize, Resize

TOP = 5


def build_model(name: str, weights: str | None, classes: int | None) -> tuple[torch.nn.Module, list[str] | None]:
    """The model and, for ImageNet weights, their class names. Random weights get `classes` outputs
    (or torchvision's 1000); a checkpoint as many as its last layer has."""
    if weights == "imagenet":
        kinds = torchvision.models.get_model_weights(name)
        chosen = getattr(kinds, "IMAGENET1K_V2", None) or kinds.DEFAULT
        return torchvision.models.get_model(name, weights=chosen), list(chosen.meta["categories"])
    if weights is None:
        warnings.warn(f"{name} has random weights (no --weights): the CSV's predictions are meaningless", stacklevel=2)
        return torchvision.models.get_model(name, num_classes=classes or 1000), None
    state = torch.load(weights, map_location="cpu", weights_only=True)
    state = state.get("model", state.get("state_dict", state))
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state.items()}
    head = [v for k, v in state.items() if k.endswith("weight") and v.ndim == 2][-1]  # the classifier
    model = torchvision.models.get_model(name, num_classes=head.shape[0])
    model.load_state_dict(state)
    return model, None


def class_names(given: list[str] | None, store: list[str], outputs: int, imagenet: list[str] | None) -> list:
    """The name of each model output: `--classes`, else the input's classes if they number the
    outputs, else the weights' own (ImageNet's), else the indices."""
    if given is not None:
        if len(given) != outputs:
            raise SystemExit(f"--classes names {len(given)} classes; the model has {outputs} outputs")
        return given
    if store and len(store) == outputs:
        return list(store)
    if store:
        print(f"the input's {len(store)} classes don't match the model's {outputs} outputs: not used", file=sys.stderr)
    return imagenet if imagenet is not None else list(range(outputs))


def skipped(loader: gpufeed.Loader) -> list[tuple[str, str]]:
    """(source, reason) of each image left out: files a folder read in place can't read at all, and
    samples no decoder could read during the pass (an evaluation pass leaves them out, never counting
    another image twice in their place)."""
    out = [(s["path"], s["reason"]) for s in getattr(loader.store, "skipped", [])]
    return out + [(s.source or f"sample {s.sample}", s.reason) for s in loader.skipped]


def write(rows, sources: list[str], probs: torch.Tensor, idx: torch.Tensor, names: list) -> int:
    for source, p, i in zip(sources, probs.tolist(), idx.tolist(), strict=True):
        rows.writerow([source, *(x for c, q in zip(i, p) for x in (names[c], f"{q:.4f}"))])
    return len(sources)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input", help="a store, or a folder, CSV/JSONL list or tar shards of JPEGs")
    p.add_argument("--out", default="predictions.csv")
    p.add_argument("--weights", help='"imagenet" (torchvision\'s, downloaded) or a .pt file; default: random')
    p.add_argument("--classes", help="a file of class names, one per line, in the model's output order")
    p.add_argument("--model", default="resnet50", help="a torchvision classification model")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--limit", type=int, help="stop after this many images")
    a = p.parse_args(argv)
    if a.model not in torchvision.models.list_models(module=torchvision.models):
        p.error(f"--model {a.model!r} is not a torchvision classification model")
    given = [n.strip() for n in Path(a.classes).read_text().splitlines() if n.strip()] if a.classes else None

    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loader = gpufeed.Loader(
        a.input,
        batch_size=a.batch_size,
        device=device,
        shuffle=False,
        drop_last=False,
        pad=False,
        augment=[Resize(256), CenterCrop(224), Normalize()],
        dtype=dtype,
        channels_last=True,
        fields=("source",),
    )
    store_classes = list(loader.store.classes)
    model, imagenet = build_model(a.model, a.weights, len(given or store_classes) or None)
    model = model.to(device, memory_format=torch.channels_last).eval()
    with torch.inference_mode():
        outputs = model(torch.zeros(1, 3, 224, 224, device=device)).shape[1]
    names = class_names(given, store_classes, outputs, imagenet)
    top = min(TOP, outputs)
    # no cuDNN autotuning: a single pass pays for it (about 2 s for ResNet-50's batch and its last,
    # shorter one) and gains nothing back (H100, 20,000 photos: 6,433-6,851 img/s without it,
    # 3,913-4,325 with it, 6,780-6,889 with it done before the pass)
    torch.backends.cudnn.benchmark = False

    count, pending, start = 0, None, time.perf_counter()
    with (
        loader,
        open(a.out, "w", newline="") as f,
        torch.inference_mode(),
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16),
    ):
        rows = csv.writer(f)
        rows.writerow(["source", *(x for k in range(1, top + 1) for x in (f"top{k}", f"p{k}"))])
        for batch in loader:
            images, sources = batch["image"], batch["source"]
            if a.limit is not None:
                images, sources = images[: a.limit - count], sources[: a.limit - count]
            probs, idx = model(images).float().softmax(1).topk(top)
            if pending is not None:  # the previous batch's rows, while the device works on this one
                write(rows, *pending, names)
            pending, count = (sources, probs, idx), count + len(sources)
            if a.limit is not None and count >= a.limit:
                break
        if pending is not None:
            write(rows, *pending, names)
        left_out = skipped(loader)
    seconds = time.perf_counter() - start
    print(
        f"{count} images in {seconds:.1f} s ({count / seconds:.0f} img/s) on {device} in {str(dtype)[6:]}, "
        f"{len(left_out)} skipped; predictions in {a.out}"
    )
    for source, reason in left_out[:10]:
        print(f"  skipped {source}: {reason}")
    return {"rows": count, "skipped": left_out, "seconds": seconds, "out": a.out, "dtype": dtype}


if __name__ == "__main__":
    main()
