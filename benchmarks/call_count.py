"""Which C functions the loader's threads call per batch, and how often: each torch op, system call or
lock a thread of the training process enters lets go of the GIL or may, and the training thread
then waits to take it back. A profile hook counts the calls of every thread but the main one.

    PYTHONPATH=src python benchmarks/call_count.py --store /tmp/tb10/jpeg --batches 40

The main thread takes one batch every `--pace` seconds (a training loop's pace), as
train_bench's loop would; the profile hook slows the loader, so only the counts mean anything.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

import gpufeed
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=40, help="batches counted, after --warmup")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pace", type=float, default=0.02, help="seconds between the main thread's batches")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    counts: collections.Counter = collections.Counter()
    counting = threading.Event()

    def hook(frame, event, arg):
        if event == "c_call" and counting.is_set():
            owner = getattr(arg, "__self__", None)
            where = getattr(arg, "__module__", None) or type(owner).__name__
            name = getattr(arg, "__qualname__", getattr(arg, "__name__", repr(arg)))
            counts[(threading.current_thread().name, f"{where}.{name}")] += 1

    threading.setprofile(hook)  # threads started from now on: the loader's
    loader = gpufeed.Loader(a.store, batch_size=a.batch, device=a.device,
                            augment=[RandomResizedCrop(224), RandomHorizontalFlip(), Normalize()])

    def forever():
        while True:
            yield from loader

    batches = forever()
    for _ in range(a.warmup):
        next(batches)
    counting.set()
    for _ in range(a.batches):
        next(batches)
        time.sleep(a.pace)
    counting.clear()
    per_thread: collections.Counter = collections.Counter()
    for (thread, _), n in counts.items():
        per_thread[thread] += n
    for thread, n in per_thread.most_common():
        print(f"{thread}: {n / a.batches:.1f} C calls per batch")
    for (thread, name), n in counts.most_common(a.top):
        print(f"{n / a.batches:8.2f}  {thread:24s} {name}")
    print("decoded by:", loader.stats()["decoded_by"])


if __name__ == "__main__":
    main()
