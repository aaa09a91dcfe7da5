"""Run a list of augmentation ops on a whole uint8 batch in a handful of kernels.

`sample` draws every random parameter for the batch on the CPU from a seeded generator (so
GPU and CPU runs, and resumed runs, crop identically); `apply` then does one resampling pass
for crops, resizes and flips (torchvision's roi_align: bilinear, box-averaged when
downscaling), one warp pass if an op turns, shears or pads, the colour and pixel ops (a
policy's first), normalisation and the cast, then RandomErasing and the user's own callables,
on whatever device the batch is.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from gpufeed.augment import checks
from gpufeed.augment.affine import Filled, RandomAffine, RandomRotation, Warp, warp
from gpufeed.augment.colour import constant
from gpufeed.augment.mix import BATCH_OPS
from gpufeed.augment.ops import (
    CenterCrop,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RandomVerticalFlip,
    Resize,
)
from gpufeed.augment.params import Params
from gpufeed.augment.pixel import AFTER_NORMALIZE, PIXEL_OPS
from gpufeed.augment.policies import POLICIES
from gpufeed.augment.view import View, column, pair
from gpufeed.logs import logger

log = logger(__name__)
GEOMETRIC = (
    RandomResizedCrop,
    Resize,
    CenterCrop,
    RandomCrop,
    RandomHorizontalFlip,
    RandomVerticalFlip,
    RandomAffine,
    RandomRotation,
)
COLOUR = PIXEL_OPS
SIZED = (RandomResizedCrop, Resize, CenterCrop, RandomCrop)  # geometric ops with a `size`


class Augment:
    """A validated chain of ops: geometric ops, then colour and pixel ops (in the order given), then
    Normalize, then RandomErasing and any callables of the user's on the finished batch tensor, then
    at most one batch op on (images, labels) (MixUp, CutMix), which the Loader applies."""

    def __init__(self, ops: Sequence[object]):
        self.ops = list(ops)
        rank = (
            {cls: 0 for cls in GEOMETRIC}
            | {cls: 0.5 for cls in POLICIES}
            | {cls: 1 for cls in COLOUR}
            | {Normalize: 2}
            | {cls: 3 for cls in AFTER_NORMALIZE}
            | {cls: 4 for cls in BATCH_OPS}
        )
        order = []
        for op in self.ops:
            kind = next((r for cls, r in rank.items() if isinstance(op, cls)), None)  # subclasses too
            if kind is not None:
                order.append(kind)
            elif callable(op) and not isinstance(op, type):  # the user's own op on the batch tensor
                order.append(3)
            else:
                raise TypeError(
                    f"{op!r} is not a gpufeed.augment op ({', '.join(c.__name__ for c in rank)}) "
                    "nor a callable taking and returning the batch tensor"
                )
        if order != sorted(order) or any(order.count(r) > 1 for r in (0.5, 2, 4)):
            raise ValueError(
                "augment order must be: geometric ops, then at most one policy (RandAugment, "
                "TrivialAugmentWide, AutoAugment), then colour and pixel ops, then at most one "
                "Normalize, then RandomErasing and your own callables, then at most one of MixUp, "
                "CutMix, MixUpOrCutMix"
            )
        self.geometric = [op for op in self.ops if isinstance(op, GEOMETRIC)]
        # ops of several classes, sorted by `rank`, which a type checker does not follow: typed loosely
        self.policy: Any = next((op for op, r in zip(self.ops, order) if r == 0.5), None)
        self.colour: list[Any] = [op for op, r in zip(self.ops, order) if r in (0.5, 1)]
        self.after: list[Any] = [op for op, r in zip(self.ops, order) if r == 3]
        self.batch_op: Any = next((op for op, r in zip(self.ops, order) if r == 4), None)  # the Loader applies it
        self.random = self.colour + [op for op in self.after if isinstance(op, AFTER_NORMALIZE)]
        self.normalize = next((op for op in self.ops if isinstance(op, Normalize)), None)

    def at_size(self, hw: tuple[int, int]) -> Augment:
        """This chain making (h, w) images: the last op that fixes the output size (RandomResizedCrop,
        Resize((h, w)), CenterCrop, RandomCrop) makes (h, w), and each size before it is scaled by as
        much (Resize(256) + CenterCrop(224) at 160: Resize(183) + CenterCrop(160)). ValueError if no
        op fixes the size."""
        sized: list[tuple[int, Any]] = [(k, op) for k, op in enumerate(self.ops) if isinstance(op, SIZED)]
        fixed = [k for k, op in sized if not (isinstance(op, Resize) and isinstance(op.size, int))]
        if not fixed:
            raise ValueError(
                f"augment ops {self.ops!r}: a resolution schedule needs an op that fixes the output size "
                "(RandomResizedCrop, Resize((h, w)), CenterCrop or RandomCrop)"
            )
        h0, w0 = pair(dict(sized)[fixed[-1]].size)
        fy, fx = hw[0] / h0, hw[1] / w0
        ops = list(self.ops)
        for k, op in sized:
            if k < fixed[-1]:  # (a Resize's int is its shorter side: scaled as the height)
                h, w = (op.size, None) if isinstance(op.size, int) else op.size
                ops[k] = dataclasses.replace(
                    op, size=max(1, round(h * fy)) if w is None else (round(h * fy), round(w * fx))
                )
            elif k == fixed[-1]:
                ops[k] = dataclasses.replace(op, size=(int(hw[0]), int(hw[1])))
        return Augment(ops)

    def sample(
        self,
        n: int,
        height: int | torch.Tensor,
        width: int | torch.Tensor,
        g: torch.Generator,
        batches: Sequence[int] | None = None,
        multiple: int = 32,
    ) -> Params:
        """Draw the parameters of a batch of `n` height×width images (per-sample tensors if sizes differ).

        `batches` (the first sample of each batch, then n): the ops may leave images of different
        sizes, and each batch's images are padded at the right and bottom to one shape, its largest
        image's rounded up to a `multiple` (detection's batches: `Loader(group_by_aspect=...)`)."""
        zeros = torch.zeros(n, dtype=torch.float64)
        full = torch.stack([zeros, zeros, column(width, n), column(height, n)], 1)
        view = View(full, torch.zeros(n, dtype=torch.bool), height, width)
        for op in self.geometric:
            view = op(view, g)
        drawn, choices = {}, None
        if self.policy is not None:
            view, drawn[id(self.policy)], choices = self.policy.sample(view, g)
        content, batch_hw = None, None
        if batches is not None:
            view, content, batch_hw = self._padded(view, batches, multiple)
        out_h, out_w = (view.height, view.width) if batch_hw is None else batch_hw[0]
        if not (isinstance(out_h, int) and isinstance(out_w, int)):  # not view.uniform
            raise ValueError(
                "the augment ops leave images of different sizes: end with RandomResizedCrop, "
                "Resize((h, w)) or CenterCrop, or batch by aspect ratio (Loader(group_by_aspect=True))"
            )
        out_hw = (out_h, out_w)
        box_hw = view.bounds[0].hw if view.bounds else out_hw
        identity = isinstance(height, int) and box_hw == (height, width) and bool((view.boxes == full).all())
        columns = [drawn[id(op)] if id(op) in drawn else op.draw(n, out_hw, g) for op in self.random]
        pixel = torch.cat([c.float() for c in columns], 1) if columns else None
        warp = None
        if view.bounds:
            matrices = torch.stack([b.matrix[:, :2] for b in view.bounds]).float()
            resampling = view.resampling  # set: the op that made the first bound passed one, as every such op does
            warp = Warp(matrices, [b.hw for b in view.bounds], out_hw, resampling, self.policy is not None)  # type: ignore[arg-type]
        vflip = None if view.vflip is None else view.vflip.to(torch.uint8)
        noisy = any(getattr(op, "noise", False) for op in self.after)
        seeds = torch.randint(0, 2**62, (n,), generator=g) if noisy else None
        return Params(
            view.boxes.float(),
            view.flip.to(torch.uint8),
            box_hw,
            identity and content is None,
            pixel,
            bool(view.flip.any()),
            vflip,
            warp,
            choices,
            seeds,
            content,
            batch_hw,
        )

    def _padded(
        self, view: View, batches: Sequence[int], multiple: int
    ) -> tuple[View, torch.Tensor, tuple[tuple[int, int], ...]]:
        """`view` extended past each image's right and bottom edges to its batch's shape (the box pass
        then reads outside the image there; `after_ops` pads it), each image's size, every batch's shape."""
        if view.bounds or self.policy is not None or any(isinstance(op, AFTER_NORMALIZE) for op in self.after):
            raise ValueError(
                "batches by aspect ratio take crops, resizes, flips, colour and pixel ops: not rotations, "
                "affine ops, padding, policies or RandomErasing"
            )
        checks.integer(multiple, "Loader", "size_divisible", 1, "a positive int")
        n = view.n
        h, w = column(view.height, n).long(), column(view.width, n).long()
        starts = np.asarray(batches, np.int64)
        if len(starts) < 2 or starts[0] != 0 or starts[-1] != n or (np.diff(starts) <= 0).any():
            raise ValueError(f"batches must rise from 0 to {n} (the samples), got {list(batches)[:8]}")
        tall = -(-np.maximum.reduceat(h.numpy(), starts[:-1]) // multiple) * multiple
        wide = -(-np.maximum.reduceat(w.numpy(), starts[:-1]) // multiple) * multiple
        sizes = torch.from_numpy(np.diff(starts))
        out_h = torch.repeat_interleave(torch.from_numpy(tall), sizes)
        out_w = torch.repeat_interleave(torch.from_numpy(wide), sizes)
        zero = torch.zeros(n, dtype=torch.float64)
        view = view.crop(zero, zero, out_h.double(), out_w.double(), out_h, out_w)
        shapes = tuple((int(a), int(b)) for a, b in zip(tall.tolist(), wide.tolist(), strict=True))
        return view, torch.stack([h, w], 1).to(torch.int32), shapes

    @overload
    def _columns(self, pixel: torch.Tensor) -> dict[int, torch.Tensor]: ...
    @overload
    def _columns(self, pixel: None = None) -> dict[int, int]: ...
    def _columns(self, pixel: torch.Tensor | None = None) -> dict[int, torch.Tensor] | dict[int, int]:
        """Each random op's columns of `pixel` by the op's id (without `pixel`: where they start)."""
        out: dict[int, Any] = {}
        at = 0
        for op in self.random:
            out[id(op)] = at if pixel is None else pixel[:, at : at + op.width]
            at += op.width
        return out

    def colour_ops(
        self, y: torch.Tensor, params: Params, filled: Filled | None = None, ops: list | None = None
    ) -> torch.Tensor:
        """The policy's and then the other colour and pixel ops (or those of them in `ops`), in order, on
        float NCHW 0..255."""
        columns = self._columns(params.pixel)
        for op in self.colour if ops is None else ops:
            if op is self.policy:
                y = op.apply(y, columns[id(op)], params.choices, filled)
            else:
                y = op.apply(y, columns[id(op)])
        return y

    def after_ops(self, y: torch.Tensor, params: Params) -> torch.Tensor:
        """The padding of batches by aspect ratio, then RandomErasing and the user's callables, in order,
        on the finished batch."""
        if params.content is not None:
            y = pad_outside(y, params.content)
        columns = self._columns(params.pixel) if params.pixel is not None else {}
        seed = None if params.seeds is None or not len(params.seeds) else int(params.seeds[0])
        for op in self.after:
            y = op.apply(y, columns[id(op)], seed) if isinstance(op, AFTER_NORMALIZE) else op(y)
        return y

    def finish(self, y: torch.Tensor, params: Params, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
        """From the box pass's float NCHW 0..255 (mirrored left-right already): vertical flips, the warp,
        colour ops, Normalize and the cast, then the ops after."""
        if self._kernels_cover(y, params):
            return self.after_ops(self._finish_in_kernels(y, params, dtype, channels_last), params)
        y = flip_rows(y, params.vflip)
        filled = None
        if params.warp is not None:
            y, filled = warp(y, params.warp)
        if self.colour:
            y = self.colour_ops(y, params, filled)
        return self.after_ops(finish(y, dtype, self.normalize, channels_last), params)

    def _kernels_cover(self, y: torch.Tensor, params: Params) -> bool:
        """Whether the warp and policy kernels run this batch's warp and policy: on a GPU with Triton,
        a warp they support (constant padding; said once where one is not)."""
        if not y.is_cuda or (params.warp is None and self.policy is None):
            return False
        if self.policy is not None and not self.policy.slots or fused_kernels("fused_policy") is None:
            return False  # (no Triton: said once by fused_kernels)
        if params.warp is not None and not fused_kernels("fused_warp").supports(params.warp):
            _torch_warp(params.warp.resampling.padding, len(params.warp.sizes))
            return False
        return True

    def _finish_in_kernels(
        self, y: torch.Tensor, params: Params, dtype: torch.dtype, channels_last: bool
    ) -> torch.Tensor:
        """The warp (with the vertical flips) and the policy in kernels: one for the warp, one per policy
        slot (plus statistics passes for the ops that need them). The last also normalises and casts
        unless colour ops follow the policy (then float 0..255 for them) or the output is uint8."""
        n, dev = len(y), y.device
        out_hw = params.final_hw
        rest = [op for op in self.colour if op is not self.policy]
        last = not rest and dtype.is_floating_point
        unit = _affine_on(dev, None, False, True)  # 0..255 kept, for the torch ops or kernel after
        if last:
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            out = torch.empty((n, 3, *out_hw), dtype=dtype, device=dev, memory_format=fmt)
            scale, shift = _affine(dev, self.normalize)
        else:
            out = torch.empty((n, 3, *out_hw), device=dev)
            scale, shift = unit
        y = y.contiguous()
        w = params.warp
        fill = constant(w.resampling.fill or (0.0,) if w is not None else (0.0,), dev, torch.float32)
        if w is not None and self.policy is None:
            y = fused_kernels("fused_warp").warp(y, w, params.vflip, fill, out, scale, shift)
        else:
            if w is not None:
                y = fused_kernels("fused_warp").warp(
                    y, w, params.vflip, fill, torch.empty((n, 3, *out_hw), device=dev), *unit
                )
            else:
                y = flip_rows(y, params.vflip)
            first = self._columns()[id(self.policy)]
            y = fused_kernels("fused_policy").apply(y, params.pixel, first, params.choices, w, fill, out, scale, shift)
        if last:
            return y
        return finish(self.colour_ops(y, params, ops=rest), dtype, self.normalize, channels_last)

    def kernel_output(
        self, params: Params, dtype: torch.dtype, channels_last: bool, device: torch.device
    ) -> tuple[torch.dtype, bool, torch.Tensor, torch.Tensor]:
        """What a resampling kernel writes (dtype, channels_last, per-channel scale and shift from 0..255):
        the finished batch when only flips and the ops after Normalize follow, else float 0..255."""
        if self.colour or params.warp is not None:
            return (torch.float32, False, *_affine_on(device, None, False, True))
        return (dtype, channels_last, *_affine(device, self.normalize, uint8=dtype == torch.uint8))

    def complete(self, y: torch.Tensor, params: Params, dtype: torch.dtype, channels_last: bool) -> torch.Tensor:
        """The rest of the chain after a kernel wrote what `kernel_output` asked for."""
        if self.colour or params.warp is not None:
            return self.finish(y, params, dtype, channels_last)
        return self.after_ops(flip_rows(y, params.vflip), params)

    def apply(
        self,
        images: torch.Tensor,
        params: Params,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Augment NHWC uint8 `images` (or `images[index]`) on any device to NCHW `dtype`."""
        if dtype == torch.uint8 and self.normalize:
            raise ValueError("Normalize needs a floating output dtype, not uint8")
        if images.is_cuda and dtype != torch.uint8 and fused_kernels() is not None:
            # one Triton kernel for gather + resample + flip (+ normalise + cast when nothing else follows)
            out_dtype, out_last, scale, shift = self.kernel_output(params, dtype, channels_last, images.device)
            y = fused_kernels().resample_normalize(
                images, params.boxes, params.flip, params.out_hw, scale, shift, out_dtype, out_last, index
            )
            return self.complete(y, params, dtype, channels_last)
        if index is not None:
            images = images.index_select(0, index)
        return self.finish(box_pass(images, params), params, dtype, channels_last)


def box_pass(images: torch.Tensor, params: Params) -> torch.Tensor:
    """The crops, resizes and left-right flips of NHWC uint8 `images` with torch ops: float NCHW 0..255."""
    y = images.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    if not params.identity:
        idx = torch.arange(len(y), device=y.device, dtype=torch.float32)[:, None]
        rois = torch.cat([idx, params.boxes], 1)
        out_h, out_w = params.out_hw
        # torchvision.ops.roi_align's own call: spatial scale 1, adaptive sampling, aligned
        y = roi_align()(y, rois, 1.0, out_h, out_w, -1, True)
    if params.any_flip:
        y = torch.where(params.flip.view(-1, 1, 1, 1).bool(), y.flip(3), y)
    return y


@functools.cache
def roi_align():
    """torchvision's `roi_align` op (`torch.ops.torchvision.roi_align`), loaded without importing
    torchvision's Python package where its C extension can be loaded alone: that import brings
    torch._dynamo's and sympy's, 2.2 s at the first batch of a process's CPU Loader on the development
    box (a Loader on a CPU, one with uint8 output, one without Triton), where the op is all the box pass
    needs. Else (a torchvision laid out otherwise) through its import, which registers the same op."""
    try:
        return torch.ops.torchvision.roi_align  # registered already: torchvision imported, or loaded before
    except (AttributeError, RuntimeError):
        pass
    spec = importlib.util.find_spec("torchvision")  # (finds the package without importing it)
    folders = spec.submodule_search_locations if spec is not None else None
    for lib in sorted(Path(folders[0]).glob("_C*.so")) if folders else []:
        try:
            torch.ops.load_library(str(lib))
            return torch.ops.torchvision.roi_align
        except (OSError, RuntimeError, AttributeError):
            continue
    import torchvision.ops  # noqa: F401  (registers the op)

    return torch.ops.torchvision.roi_align


def pad_outside(y: torch.Tensor, content: torch.Tensor) -> torch.Tensor:
    """Zeros in `y` (N, C, H, W) right of and below each image's `content` (N, 2: h, w), as torchvision's
    detection models pad their normalised batches: one pass, in place (the box pass sampled past the
    image's edge there)."""
    content = content.to(y.device, non_blocking=True)
    rows = torch.arange(y.shape[2], device=y.device).view(1, -1, 1) < content[:, 0].view(-1, 1, 1)
    cols = torch.arange(y.shape[3], device=y.device).view(1, 1, -1) < content[:, 1].view(-1, 1, 1)
    return y.masked_fill_(~(rows & cols).unsqueeze(1), 0)


def flip_rows(y: torch.Tensor, vflip: torch.Tensor | None) -> torch.Tensor:
    """Turn upside down the samples where `vflip` is 1, keeping y's layout."""
    if vflip is None:
        return y
    return y.copy_(torch.where(vflip.view(-1, 1, 1, 1).bool(), y.flip(2), y))


def _affine(
    device: torch.device, normalize: Normalize | None, uint8: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, shift) taking 0..255 to the output scale, made once per device: called for
    every batch, so a lookup in plain Python (small torch ops would each give up the GIL and wait to
    win it back from the training thread).

    For uint8 output the values stay 0..255 and 0.5 is added, so the kernel's truncating cast rounds."""
    return _affine_on(device, None if normalize is None else (tuple(normalize.mean), tuple(normalize.std)), uint8)


@functools.lru_cache(maxsize=64)
def _affine_on(
    device: torch.device, mean_std: tuple | None, uint8: bool, unit: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`unit`: 0..255 kept as it is (float, for the ops that follow)."""
    if unit:
        scale, shift = torch.ones(3), torch.zeros(3)
    elif uint8:
        scale, shift = torch.ones(3), torch.full((3,), 0.5)
    elif mean_std is None:
        scale, shift = torch.full((3,), 1 / 255), torch.zeros(3)
    else:
        mean, std = torch.tensor(mean_std[0]), torch.tensor(mean_std[1])
        scale, shift = 1 / (255 * std), -mean / std
    return scale.float().to(device), shift.float().to(device)


def fused_kernels(module: str = "fused", launch: bool = True):
    """A Triton kernel module of this package, or None where Triton cannot be imported (said once).
    `launch`: the caller launches one of its kernels next, so Triton's work ahead (`triton_ahead`),
    if started, is waited for first."""
    if launch:
        for ahead in _ahead:
            ahead.join()  # (in `_ahead` once started only)
    return _kernels(module)


@functools.cache
def _kernels(module: str):
    try:
        return importlib.import_module(f"gpufeed.augment.{module}")
    except ImportError as e:
        _no_triton(str(e))
        return None


_ahead: list[threading.Thread] = []  # Triton's once-a-process work, on its thread (`triton_ahead`)
_AHEAD = threading.Lock()
_triton_done: list[float] = []  # when that work ended (time.perf_counter), once it has


def triton_ready_at() -> float | None:
    """When Triton's once-a-process work ahead (`triton_ahead`) ended, by time.perf_counter; None if it
    was not started (a CPU) or has not ended (for `Loader.stats()["start"]`)."""
    return _triton_done[0] if _triton_done else None


def triton_ahead(device: torch.device) -> None:
    """Start what Triton does once a process before its first kernel, on a thread of its own, as a GPU
    Loader starts: its import, and the hashes of its own files and of its compiler backend that key its
    kernel cache (0.3-0.5 s on an H200 host, mostly hashing its library, which lets go of the GIL; kept
    for the next process by `triton_key.known`).
    Without this, a first batch waited for them: they come with the first kernel's launch, even when
    every kernel is in the cache on disk. `fused_kernels` waits for the thread before a launch (two
    threads hashing at once would both pay: Triton keeps the key without a lock). Once a process;
    nothing on a CPU. Nothing is said where a step fails: the first kernel then does it and says why."""
    if device.type != "cuda":
        return
    with _AHEAD:
        if _ahead:
            return
        ahead = threading.Thread(target=_prepare_triton, args=(device,), name="gpufeed-triton")
        try:
            ahead.start()
        except RuntimeError:  # no new thread now (the interpreter is exiting, a thread limit): none ahead
            return
        _ahead.append(ahead)


def _prepare_triton(device: torch.device) -> None:
    try:
        if _kernels("fused") is None:
            return
        from triton.compiler.compiler import make_backend
        from triton.runtime import cache
        from triton.runtime.driver import driver

        from gpufeed.augment.triton_key import known

        known()  # the key a process before computed for these files, if one did
        cache.triton_key()
        with torch.cuda.device(device):
            make_backend(driver.active.get_current_target()).hash()
    except Exception as e:  # noqa: BLE001  another Triton's internals: its first kernel does this instead
        log.debug("Triton's work ahead stopped: %s", e)
    finally:
        _triton_done.append(time.perf_counter())


@functools.cache
def _torch_warp(padding: str, bounds: int) -> None:
    log.warning(
        "augment: a warp with %s padding (%d images read) runs as torch ops on the GPU, slower than the "
        "warp kernel (which takes constant padding and up to %d images)",
        padding,
        bounds,
        fused_kernels("fused_warp").MAX_BOUNDS,
    )


@functools.cache
def _no_triton(reason: str) -> None:
    log.warning("Triton unavailable (%s): GPU augmentation falls back to several torch kernels (slower)", reason)


def finish(y: torch.Tensor, dtype: torch.dtype, normalize: Normalize | None, channels_last: bool) -> torch.Tensor:
    """Normalise (or scale to 0..1), cast, and lay out the batch."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if dtype == torch.uint8:
        return y.round_().clamp_(0, 255).to(torch.uint8, memory_format=fmt)
    if normalize is None:
        return (y * (1 / 255)).to(dtype, memory_format=fmt)
    std = constant(tuple(normalize.std), y.device, torch.float32)
    mean = constant(tuple(normalize.mean), y.device, torch.float32)
    return torch.addcmul(-mean / std, y, 1 / (255 * std)).to(dtype, memory_format=fmt)
