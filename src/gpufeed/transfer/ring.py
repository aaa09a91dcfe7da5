"""Host→device transfer: a ring of pinned slots, copies on a side stream, an event per slot.

A slot is refilled only after the event recorded behind its last copy has fired, so the CPU
never overwrites bytes the DMA engine is still reading. Tensors produced on the side stream
are handed to the consumer with `hand_over`, which makes the consumer's stream wait for the
copy and tells the caching allocator the consumer uses them (`record_stream`), so their
memory is not reused while the consumer's kernels may still read it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from gpufeed.logs import logger

log = logger(__name__)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer, page-locked if asked and possible (says so once if not)."""
    if pin:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as e:
            log.warning("pinned host memory unavailable (%s): host->device copies will be pageable and slower", e)
    return torch.empty(shape, dtype=dtype)


class Turns:
    """Which of `slots` reusable buffers is filled next: they are taken in order, each once it was
    released (a producer on another thread may still fill it) and the event recorded behind its last
    copy has fired. Producers on several threads may take turns; each releases what it takes, an
    error or not."""

    def __init__(self, slots: int):
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._taken = [False] * slots
        self._next = 0
        self._turn = threading.Condition()

    def acquire(self) -> int:
        """Index of the next slot, once it was released and the last copy out of it has finished."""
        with self._turn:
            k = self._next
            self._next = (k + 1) % len(self._events)
            while self._taken[k]:  # (a producer that fell behind still fills it)
                self._turn.wait()
            self._taken[k] = True
            event, self._events[k] = self._events[k], None
        if event is not None:
            event.synchronize()
        return k

    def release(self, k: int, event: torch.cuda.Event | None) -> None:
        """Slot `k` may be refilled once `event` (recorded after its copy; None: nothing reads it) has fired."""
        with self._turn:
            self._events[k] = event
            self._taken[k] = False
            self._turn.notify_all()

    def drain(self) -> None:
        """Return once every copy out of the slots has finished (before they are freed)."""
        for event in list(self._events):
            if event is not None:
                event.synchronize()


class PinnedRing:
    """`slots` reusable host buffers for batches of images and labels."""

    def __init__(self, slots: int, image_shape: tuple[int, ...], batch_size: int, pin: bool):
        self.images = [pinned_empty((batch_size, *image_shape), torch.uint8, pin) for _ in range(slots)]
        self.labels = [pinned_empty((batch_size,), torch.int64, pin) for _ in range(slots)]
        self.pinned = self.images[0].is_pinned()
        self._turns = Turns(slots)

    def acquire(self) -> int:
        """Index of the next slot, once the last copy out of it has finished."""
        return self._turns.acquire()

    def release(self, k: int, event: torch.cuda.Event | None) -> None:
        """Slot `k` may be refilled once `event` (recorded after its copy) has fired."""
        self._turns.release(k, event)

    @contextlib.contextmanager
    def filling(self) -> Iterator[int]:
        """The next slot (`acquire`) to fill in the block, given back at once where the block raises
        (nothing was copied out of it); else the caller `send`s it."""
        k = self.acquire()
        try:
            yield k
        except BaseException:
            self.release(k, None)
            raise

    def send(
        self, k: int, n: int, stream: torch.cuda.Stream, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        """Slot `k`'s first `n` images and labels copied to `device` on `stream`: (images, labels, the
        event recorded after the copies); the slot is refilled once that event has fired."""
        with torch.cuda.stream(stream):
            images = self.images[k][:n].to(device, non_blocking=True)
            labels = self.labels[k][:n].to(device, non_blocking=True)
            event = stream.record_event()
        self.release(k, event)
        return images, labels, event


def hand_over(event: torch.cuda.Event | None, *tensors: torch.Tensor) -> None:
    """Make the current stream wait for `event` and own `tensors` for the allocator."""
    if event is None or not tensors:
        return
    stream = torch.cuda.current_stream(tensors[0].device)
    stream.wait_event(event)
    for t in tensors:
        t.record_stream(stream)
