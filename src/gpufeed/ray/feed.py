"""`RayLoader`: the GPU half of remote preprocessing. Batches of fixed-size uint8 images stream
in from Ray; each is copied into a pinned ring slot, sent over the bus on a side stream, and
augmented on the device by the same kernels as `gpufeed.Loader`, so the output is the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import ray.data
import torch

from gpufeed.augment.pipeline import Augment
from gpufeed.decode.base import as_tensor
from gpufeed.loader.settings import resolve_device
from gpufeed.loader.stats import Stats, stage_range
from gpufeed.ray.remote import fixed_size
from gpufeed.transfer.ring import PinnedRing, hand_over


class RayLoader:
    """Iterate `(images, labels)` on `device` from a Ray Dataset (or a rank's DataIterator shard).

    `size` fits every image to size×size uint8 on the Ray workers first (see `fixed_size`);
    pass `size=None` if the dataset's images are already one fixed size. `augment`, `dtype`
    and `channels_last` mean what they mean for `gpufeed.Loader`; the random parameters are
    drawn from (seed, epoch, batch number). `shuffle_buffer` rows are shuffled locally as
    batches are formed (Ray's `local_shuffle_buffer_size`); 0 keeps the dataset's order.
    """

    def __init__(
        self,
        dataset: ray.data.Dataset | ray.data.DataIterator,
        batch_size: int = 256,
        device: str | torch.device = "cuda",
        size: int | None = 256,
        augment: Sequence | None = None,
        dtype: torch.dtype = torch.float16,
        channels_last: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 0,
        drop_last: bool = True,
        prefetch: int = 4,
        image_column: str = "image",
        label_column: str = "label",
    ):
        if size is not None:
            if not isinstance(dataset, ray.data.Dataset):
                raise TypeError("size= needs a ray.data.Dataset; fit a DataIterator's dataset before splitting it")
            dataset = fixed_size(dataset, size, image_column=image_column)
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.device = resolve_device(device)
        self.augment = Augment(augment) if augment is not None else None
        self.dtype = dtype if self.augment is not None else torch.uint8
        self.channels_last, self.seed, self.prefetch = channels_last, seed, max(1, prefetch)
        self.shuffle_buffer, self.columns = shuffle_buffer, (image_column, label_column)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.counters = Stats("ray")
        self.epoch = 0
        self._ring: PinnedRing | None = None

    def set_epoch(self, epoch: int) -> None:
        """Draw the next iteration's augment parameters (and local shuffle) for `epoch`."""
        self.epoch = epoch

    def stats(self) -> dict:
        """Images, seconds waiting on Ray (`wait`), copying into pinned memory and issuing the H2D."""
        return self.counters.as_dict()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        g = torch.Generator().manual_seed(hash((self.seed, epoch)) & (2**63 - 1))
        shuffle: dict[str, Any] = (
            {"local_shuffle_buffer_size": self.shuffle_buffer, "local_shuffle_seed": self.seed + epoch}
            if self.shuffle_buffer
            else {}
        )
        batches = iter(
            self.dataset.iter_batches(
                batch_size=self.batch_size,
                batch_format="numpy",
                prefetch_batches=self.prefetch,
                drop_last=self.drop_last,
                **shuffle,
            )
        )
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            self.counters.add("wait", time.perf_counter() - t0)
            if batch is None:
                return
            images, labels = self._to_device(batch)
            yield self._finish(images, labels, g)

    def _to_device(self, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        image_column, label_column = self.columns
        images = np.ascontiguousarray(batch[image_column])
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
            raise ValueError(
                f"column {image_column!r} must hold N×H×W×3 uint8 images of one size, got "
                f"{images.dtype} {images.shape}: pass size= to fit them on the Ray workers"
            )
        n = len(images)
        labels = (
            np.asarray(batch[label_column], dtype=np.int64) if label_column in batch else np.full(n, -1, dtype=np.int64)
        )
        if self.copy_stream is None:
            return as_tensor(images), torch.from_numpy(labels)
        with stage_range("gpufeed.gather+h2d", True):
            t0 = time.perf_counter()
            ring = self._slots(images.shape[1:])
            with ring.filling() as k:
                ring.images[k][:n].numpy()[:] = images
                ring.labels[k][:n].numpy()[:] = labels
            t1 = time.perf_counter()
            self.counters.add("copy", t1 - t0, images.nbytes)
            on_device, labels_on_device, event = ring.send(k, n, self.copy_stream, self.device)
            self.counters.add("h2d_issue", time.perf_counter() - t1, images.nbytes)
        hand_over(event, on_device, labels_on_device)
        return on_device, labels_on_device

    def _slots(self, shape: tuple[int, ...]) -> PinnedRing:
        if self._ring is None or tuple(self._ring.images[0].shape[1:]) != shape:
            self._ring = PinnedRing(self.prefetch + 2, shape, self.batch_size, pin=True)
            if not self._ring.pinned:
                self.counters.note("pinned memory unavailable: pageable copies")
        return self._ring

    def _finish(self, images: torch.Tensor, labels: torch.Tensor, g: torch.Generator):
        t0 = time.perf_counter()
        with stage_range("gpufeed.augment", self.copy_stream is not None):
            if self.augment is None:
                fmt = torch.channels_last if self.channels_last else torch.contiguous_format
                out = images.permute(0, 3, 1, 2).contiguous(memory_format=fmt)
            else:
                n, h, w = images.shape[:3]
                params = self.augment.sample(n, h, w, g).to(self.device, non_blocking=True)
                out = self.augment.apply(images, params, self.dtype, self.channels_last)
        self.counters.add("augment", time.perf_counter() - t0)
        self.counters.count(len(labels))
        return out, labels
