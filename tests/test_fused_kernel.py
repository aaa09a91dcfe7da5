"""The Triton augment kernel computes what the CPU path computes (run in Triton's interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from gpufeed.augment import Augment, Normalize, RandomHorizontalFlip, RandomResizedCrop, Resize
    from gpufeed.augment import fused
    from gpufeed.augment.pipeline import _affine
    from gpufeed.decode.base import YCC420

    torch.manual_seed(0)
    images = torch.randint(0, 256, (6, 20, 24, 3), dtype=torch.uint8)
    for ops in ([RandomResizedCrop(16, scale=(0.2, 1)), RandomHorizontalFlip(), Normalize()],
                [Resize(9), RandomHorizontalFlip(1.0)],
                [RandomResizedCrop((12, 30), scale=(0.5, 1))]):
        aug = Augment(ops)
        p = aug.sample(6, 20, 24, torch.Generator().manual_seed(1))
        ref = aug.apply(images, p, torch.float32)
        for channels_last in (False, True):
            scale, shift = _affine(torch.device("cpu"), aug.normalize)
            got = fused.resample_normalize(images, p.boxes, p.flip, p.out_hw, scale, shift,
                                           torch.float32, channels_last)
            assert got.shape == ref.shape, (got.shape, ref.shape)
            err = (got - ref).abs().max().item()
            assert err < 1e-4, (ops, channels_last, err)

    # images of different sizes packed back to back (jpeg path), CHW and HWC, rows out of order
    sizes = [(20, 24), (13, 31), (40, 17)]
    imgs = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8) for h, w in sizes]
    hs, ws = torch.tensor([h for h, _ in sizes]), torch.tensor([w for _, w in sizes])
    aug = Augment([RandomResizedCrop(10, scale=(0.3, 1)), RandomHorizontalFlip(), Normalize()])
    p = aug.sample(3, hs, ws, torch.Generator().manual_seed(3))
    ref = torch.cat([aug.apply(im[None], type(p)(p.boxes[k:k + 1], p.flip[k:k + 1], p.out_hw, False, None, True),
                               torch.float32) for k, im in enumerate(imgs)])
    scale, shift = _affine(torch.device("cpu"), aug.normalize)
    for chw in (False, True):
        rows = torch.tensor([2, 0, 1])
        flat = [(imgs[r].permute(2, 0, 1) if chw else imgs[r]).reshape(-1) for r in rows]
        numels = torch.tensor([f.numel() for f in flat])
        offsets = torch.cumsum(numels, 0) - numels
        out = torch.full((3, 3, 10, 10), float("nan"))
        hw = [sizes[r] for r in rows]
        strides = torch.tensor([(h * w, w, 1) if chw else (1, w * 3, 3) for h, w in hw], dtype=torch.int64)
        fused.resample_packed(torch.cat(flat), offsets, torch.tensor(hw, dtype=torch.int32), strides, rows,
                              p.boxes, p.flip, out, scale, shift)
        err = (out - ref).abs().max().item()
        assert err < 1e-4, ("packed", chw, err)

    # YCbCr 4:2:0 planes (as the JPEG engines decode), odd sizes too: against the RGB their chroma,
    # upsampled with the JPEG's centred siting, and JFIF's conversion make (rounded to uint8). Colours
    # stay inside RGB's range (where the decoder's clamp before the resampling and the kernel's after
    # agree) and chroma is smooth, as in photos: the kernel samples the chroma planes at each point
    # instead of resampling upsampled chroma, which differs where chroma changes from pixel to pixel
    planes, rgbs = [], []
    for h, w in sizes:
        ch, cw = (h + 1) // 2, (w + 1) // 2
        y = torch.randint(40, 210, (h, w), dtype=torch.uint8)
        cb, cr = ((128 + torch.nn.functional.interpolate(torch.rand(1, 1, 3, 3) * 36 - 18, size=(ch, cw), mode="bilinear")[0, 0]
                   + torch.randint(-2, 3, (ch, cw))).round().to(torch.uint8) for _ in range(2))
        planes.append(torch.cat([y.reshape(-1), cb.reshape(-1), cr.reshape(-1)]))
        up = torch.nn.functional.interpolate(torch.stack([cb, cr])[None].float(), scale_factor=2, mode="bilinear",
                                             align_corners=False)[0, :, :h, :w] - 128
        yf = y.float()
        rgb = torch.stack([yf + 1.402 * up[1], yf - 0.344136 * up[0] - 0.714136 * up[1], yf + 1.772 * up[0]], -1)
        rgbs.append(rgb.clamp(0, 255).round().to(torch.uint8))
    rows = torch.tensor([0, 1, 2])
    numels = torch.tensor([t.numel() for t in planes])
    offsets = torch.cumsum(numels, 0) - numels
    strides = torch.tensor([(YCC420, w, 1) for _, w in sizes], dtype=torch.int64)
    got = torch.full((3, 3, 10, 10), float("nan"))
    fused.resample_packed(torch.cat(planes), offsets, torch.tensor(sizes, dtype=torch.int32), strides, rows,
                          p.boxes, p.flip, got, scale, shift)
    flat = [t.reshape(-1) for t in rgbs]
    numels = torch.tensor([t.numel() for t in flat])
    want = torch.full((3, 3, 10, 10), float("nan"))
    fused.resample_packed(torch.cat(flat), torch.cumsum(numels, 0) - numels, torch.tensor(sizes, dtype=torch.int32),
                          torch.tensor([(1, w * 3, 3) for _, w in sizes]), rows, p.boxes, p.flip, want, scale, shift)
    levels = (got - want).abs() * 255 * 0.226  # Normalize's std: back to levels of 255
    assert levels.max() < 3 and levels.mean() < 0.3, ("ycc420", levels.max(), levels.mean())
    print("fused kernel OK")
""")


WARP_AND_POLICY = textwrap.dedent("""
    import torch
    from gpufeed.augment import (Augment, AutoAugment, ColorJitter, Normalize, RandAugment, RandomAffine,
                                 RandomCrop, RandomGrayscale, RandomHorizontalFlip, RandomResizedCrop,
                                 RandomRotation, RandomVerticalFlip, TrivialAugmentWide)
    from gpufeed.augment.pipeline import box_pass
    from gpufeed.augment.policies import ID, OPS, magnitudes

    class Forced(RandAugment):
        def __init__(self, names):
            super().__init__(num_ops=len(names), magnitude=12)
            self.names = names

        def _choose(self, n, h, w, g):
            ops = torch.tensor([ID[name] for name in self.names]).repeat(n, 1)
            return ops, magnitudes(False, self.num_magnitude_bins, h, w)[ops, self.magnitude]

    torch.manual_seed(0)
    images = torch.randint(0, 256, (4, 20, 24, 3), dtype=torch.uint8)
    images[1] = images[1] // 4 + 60  # a narrow range: autocontrast and equalize stretch it
    chains = [
        [RandomResizedCrop(16), RandomHorizontalFlip(), RandomRotation(30), Normalize()],
        [RandomVerticalFlip(), RandomResizedCrop(16),
         RandomAffine(20, (0.1, 0.2), (0.8, 1.2), 10, interpolation="bilinear", fill=(10, 20, 30))],
        [RandomCrop(18, padding=3), Normalize()],
        [RandomResizedCrop(16), RandomHorizontalFlip(), RandAugment(2, 9), Normalize()],
        [RandomResizedCrop(16), TrivialAugmentWide(fill=(5, 6, 7))],
        [RandomResizedCrop(16), AutoAugment("imagenet"), Normalize()],
        # colour ops after the kernels: the kernels hand over float 0..255
        [RandomResizedCrop(16), RandomRotation(30), ColorJitter(0.4, 0.4, 0.4), Normalize()],
        [RandomResizedCrop(16), RandAugment(2, 9), RandomGrayscale(0.5), Normalize()],
    ]
    pairs = [(a, OPS[(k + 5) % len(OPS)]) for k, a in enumerate(OPS)]
    pairs += [("Sharpness", "Equalize"), ("Rotate", "Contrast"), ("Equalize", "AutoContrast")]
    chains += [[RandomResizedCrop(16), Forced(pair), Normalize()] for pair in pairs]
    for ops in chains:
        aug = Augment(ops)
        p = aug.sample(4, 20, 24, torch.Generator().manual_seed(1))
        dtypes = [(torch.float32, False), (torch.float16, True)] + [(torch.uint8, False)] * (not aug.normalize)
        for dtype, channels_last in dtypes:
            want = aug.apply(images, p, dtype, channels_last)  # the torch ops on the CPU
            got = aug._finish_in_kernels(box_pass(images, p), p, dtype, channels_last)
            assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype
            scale = 255 * 0.226 if aug.normalize else 1 if dtype == torch.uint8 else 255
            levels = (got.float() - want.float()).abs() * scale
            # within one level of 255 (a smoothed value rounding the other way, for Sharpness), rarely
            assert levels.max() <= (1.0 if dtype == torch.uint8 else 0.999) and levels.mean() < 0.01, \
                (ops, dtype, levels.max(), levels.mean())
    print("warp and policy kernels OK")
""")


def test_the_kernels_match_the_torch_ops_in_interpreter():
    """Both scripts in one interpreter process (Triton's interpreter and torch imported once)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT + WARP_AND_POLICY], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fused kernel OK" in proc.stdout and "warp and policy kernels OK" in proc.stdout
