"""Time of whole augment chains on one uint8 batch: gpufeed against torchvision v2 (one parameter
draw per call, as its batch API does, and a loop over samples for per-sample draws) and Kornia's
AugmentationSequential (per sample) where it is installed. GPU time from CUDA events; on the CPU
(`--device cpu`, a smoke test) wall time. Median of repeats.

    PYTHONPATH=src python benchmarks/augment_chain_bench.py [--batch 256] [--size 224] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpufeed.augment import (Augment, Normalize, RandAugment, RandomHorizontalFlip, RandomResizedCrop,
                             RandomRotation, TrivialAugmentWide)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def timed(fn, device: str, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` (after 3 warm-ups)."""
    times = []
    for _ in range(repeats + 3):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[3:])


def gpufeed_rows(images, size, device, repeats):
    chains = {
        "RRC + flip + normalize": [],
        "+ RandAugment(2, 9)": [RandAugment(2, 9)],
        "+ TrivialAugmentWide": [TrivialAugmentWide()],
        "+ RandomRotation(15)": [RandomRotation(15)],
    }
    g = torch.Generator().manual_seed(0)
    for name, extra in chains.items():
        aug = Augment([RandomResizedCrop(size), RandomHorizontalFlip(), *extra, Normalize(MEAN, STD)])
        params = aug.sample(len(images), images.shape[1], images.shape[2], g).to(device)
        yield f"gpufeed {name}", timed(lambda: aug.apply(images, params, torch.float16), device, repeats)


def torchvision_rows(images, size, device, repeats):
    from torchvision.transforms import v2

    chain = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.RandAugment(2, 9),
                        v2.ToDtype(torch.float16, scale=True), v2.Normalize(MEAN, STD)])
    batch = images.permute(0, 3, 1, 2)
    yield "torchvision v2, one draw per batch", timed(lambda: chain(batch), device, repeats)
    yield "torchvision v2, per sample (loop)", timed(lambda: torch.stack([chain(x) for x in batch]), device, repeats)


def kornia_rows(images, size, device, repeats):
    try:
        import kornia.augmentation as K
    except ImportError:
        print("(kornia not installed: no Kornia row)")
        return
    chain = K.AugmentationSequential(K.RandomResizedCrop((size, size)), K.RandomHorizontalFlip(),
                                     K.auto.RandAugment(n=2, m=9), K.Normalize(torch.tensor(MEAN), torch.tensor(STD)))
    batch = images.permute(0, 3, 1, 2).float() / 255
    yield "Kornia AugmentationSequential (per sample)", timed(lambda: chain(batch), device, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--source", type=int, default=256, help="side of the uint8 source images")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    images = torch.randint(0, 256, (a.batch, a.source, a.source, 3), dtype=torch.uint8, device=a.device)
    where = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (wall time)"
    print(f"{where}, batch {a.batch} of {a.source}x{a.source} uint8 -> {a.size}x{a.size} float16")
    print("| chain | ms per batch |\n|---|---:|")
    for rows in (gpufeed_rows, torchvision_rows, kornia_rows):
        for name, ms in rows(images, a.size, a.device, a.repeats):
            print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
