"""The augment stage alone, on one batch already on the device, in three parts (`--parts`):

- `chains`: whole chains, gpufeed against torchvision v2 (one parameter draw per call, as its batch
  API does, and a loop over samples for per-sample draws) and Kornia's AugmentationSequential (per
  sample) where it is installed;
- `ops`: each colour/pixel op and RandomErasing alone on a float batch (what a policy's op costs);
- `kernel` (CUDA only): the fused resample + normalize kernel by Triton block size, reading rows of a
  store-sized tensor itself or a gathered batch, against a `torch.index_select` gather: how
  `gpufeed.augment.fused.BLOCK` was chosen.

GPU ms from CUDA events; on the CPU (`--device cpu`) wall ms. The table: median (min-max) over
`--repeats` after 3 warm-ups.

    python benchmarks/augment_chain_bench.py --batch 256 --size 224 --repeats 20 --out augment.json
"""

from __future__ import annotations


import torch

import common
import feeds

SMOKE = dict(batch=4, size=32, source=40, repeats=2, device="cpu", parts="chains,ops")


def chains(a, images):
    from gpufeed.augment import Augment, RandAugment, RandomRotation, TrivialAugmentWide

    g = torch.Generator().manual_seed(0)
    extra = {"": [], " + RandAugment(2, 9)": [RandAugment(2, 9)], " + TrivialAugmentWide": [TrivialAugmentWide()],
             " + RandomRotation(15)": [RandomRotation(15)]}
    for name, ops in extra.items():
        recipe = feeds.ops(size=a.size)
        aug = Augment([*recipe[:2], *ops, recipe[-1]])
        params = aug.sample(len(images), images.shape[1], images.shape[2], g).to(a.device)
        yield f"gpufeed RRC + flip{name} + normalize", common.device_ms(lambda: aug.apply(images, params, torch.float16),
                                                             a.device, a.repeats)
    from torchvision.transforms import v2

    chain = v2.Compose([v2.RandomResizedCrop(a.size, antialias=True), v2.RandomHorizontalFlip(), v2.RandAugment(2, 9),
                        v2.ToDtype(torch.float16, scale=True), v2.Normalize(feeds.MEAN, feeds.STD)])
    batch = images.permute(0, 3, 1, 2)
    yield "torchvision v2 RandAugment chain, one draw per batch", common.device_ms(lambda: chain(batch), a.device, a.repeats)
    yield "torchvision v2 RandAugment chain, per sample (loop)", common.device_ms(
        lambda: torch.stack([chain(x) for x in batch]), a.device, a.repeats)
    try:
        import kornia.augmentation as K
    except ImportError:
        print("(kornia not installed: no Kornia row)")
        return
    chain = K.AugmentationSequential(K.RandomResizedCrop((a.size, a.size)), K.RandomHorizontalFlip(),
                                     K.auto.RandAugment(n=2, m=9),
                                     K.Normalize(torch.tensor(feeds.MEAN), torch.tensor(feeds.STD)))
    batch = images.permute(0, 3, 1, 2).float() / 255
    yield "Kornia AugmentationSequential RandAugment chain (per sample)", common.device_ms(lambda: chain(batch), a.device,
                                                                                a.repeats)


def ops(a, images):
    """Each pixel op alone on a float NCHW batch of the output size, 0..255."""
    from gpufeed.augment import (ColorJitter, GaussianBlur, RandomAdjustSharpness, RandomAutocontrast, RandomEqualize,
                                 RandomErasing, RandomGrayscale, RandomInvert, RandomPosterize, RandomSolarize)

    y = torch.rand(a.batch, 3, a.size, a.size, device=a.device) * 255
    g = torch.Generator().manual_seed(0)
    for op in (ColorJitter(0.4, 0.4, 0.4), ColorJitter(0.4, 0.4, 0.4, 0.1), RandomEqualize(), RandomGrayscale(0.2),
               RandomSolarize(128), RandomPosterize(4), RandomInvert(), RandomAutocontrast(),
               RandomAdjustSharpness(2.0), GaussianBlur(min(23, a.size // 2 * 2 - 1)), RandomErasing()):
        cols = op.draw(a.batch, (a.size, a.size), g).to(a.device)
        yield f"{op!r}", common.device_ms(lambda: op.apply(y, cols), a.device, a.repeats)


def kernel(a, images, store_n: int = 10000):
    """The fused kernel reading rows of a store-sized tensor (by BLOCK), or a gathered batch."""
    from gpufeed.augment import Augment, fused
    from gpufeed.augment.pipeline import _affine

    store = torch.randint(0, 256, (store_n, a.source, a.source, 3), dtype=torch.uint8, device=a.device)
    aug = Augment(feeds.ops(size=a.size))
    p = aug.sample(a.batch, a.source, a.source, torch.Generator().manual_seed(0)).to(a.device)
    idx = torch.randperm(store_n, device=a.device)[:a.batch].sort().values
    scale, shift = _affine(torch.device(a.device), aug.normalize)
    chosen = fused.BLOCK
    try:
        for block in (128, 256, 512, 1024):
            fused.BLOCK = block
            yield f"fused kernel, reading store rows, BLOCK={block}", common.device_ms(
                lambda: fused.resample_normalize(store, p.boxes, p.flip, p.out_hw, scale, shift, torch.float16, False,
                                                 idx), a.device, a.repeats)
        fused.BLOCK = chosen
        gathered = store.index_select(0, idx)
        yield f"fused kernel, gathered batch, BLOCK={chosen}", common.device_ms(
            lambda: fused.resample_normalize(gathered, p.boxes, p.flip, p.out_hw, scale, shift, torch.float16, False),
            a.device, a.repeats)
        yield "torch.index_select gather alone", common.device_ms(lambda: store.index_select(0, idx), a.device, a.repeats)
    finally:
        fused.BLOCK = chosen


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224, help="output side")
    p.add_argument("--source", type=int, default=256, help="side of the uint8 source images")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", default="chains,ops,kernel", help="comma-separated: chains, ops, kernel (CUDA only)")
    a = common.parse(p, argv, SMOKE)
    images = torch.randint(0, 256, (a.batch, a.source, a.source, 3), dtype=torch.uint8, device=a.device)
    parts = {"chains": chains, "ops": ops, "kernel": kernel}
    runs = {}
    for part in a.parts.split(","):
        if part == "kernel" and not a.device.startswith("cuda"):
            print("(no CUDA device: no kernel part)")
            continue
        for name, ms in parts[part](a, images):
            runs[name] = {"part": part, "ms": ms}
            print(f"{name:70s} {common.cell(ms, '{:.3f}')} ms", flush=True)
    lines = [[name, r["part"], common.cell(r["ms"], "{:.3f}")] for name, r in runs.items()]
    markdown = common.table(["op or chain", "part", "ms per batch"], lines)
    return common.write(a, __file__, runs, markdown, a.device,
                        workload=f"batch {a.batch} of {a.source}x{a.source} uint8 -> {a.size}x{a.size} float16 "
                                 f"({'GPU time' if a.device.startswith('cuda') else 'CPU wall time'})")


if __name__ == "__main__":
    main()
