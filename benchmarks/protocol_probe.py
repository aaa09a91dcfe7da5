"""The CPU decode workers' protocol, as the training process pays for it: CPU time per batch share
of the thread that submits and collects it, and of the replies reader. Both hold the GIL a training
loop needs, so less is better. Tiny images, so the workers' decode (in their own processes) is not
what is measured; the copy out of the shared segment is left out (a GPU does it by DMA). Needs no GPU.

    PYTHONPATH=src python benchmarks/protocol_probe.py --workers 2 --share 150 --batches 300 [--cycle-ms 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import gpufeed
from gpufeed.decode import workers as workers_module
from gpufeed.decode.base import Encoded
from gpufeed.decode.shares import Asks
from gpufeed.decode.workers import DecodeWorkers
from gpufeed.store.reader import as_tensor
from gpufeed.synth import make_image_folder

sys.path.insert(0, str(Path(__file__).parent))
import train_bench  # noqa: E402


def _thread_ms(name: str) -> float:
    """CPU ms so far of this process's thread called `name` (Linux schedstat; 0 elsewhere)."""
    return sum(run for thread, run, _, _ in train_bench._schedstat().values() if thread == name) / 1e6


def _switches() -> int:
    """Voluntary context switches so far of all this process's threads: each is a thread going to sleep
    (a pipe, a lock, an event, the GIL) and, woken, taking the GIL back from whoever holds it."""
    total = 0
    for task in Path("/proc/self/task").glob("*"):
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt"))
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--share", type=int, default=150, help="images per submitted share")
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--cycle-ms", type=float, default=0.0,
                   help="collect each share one cycle (a sleep this long) after submitting it, as the loader does")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "gpufeed-protocol-probe"))
    a = p.parse_args()
    work = Path(a.workdir)
    if not (work / "store").exists():
        make_image_folder(work / "src", per_class=a.share, classes=1, height=24, width=32)
        gpufeed.pack(work / "src", work / "store", mode="jpeg", progress=False)
    store = gpufeed.open(work / "store")
    pool = DecodeWorkers(store.data, a.workers)
    assert pool.wait_ready(60)
    idx = np.arange(a.share)
    batch = Encoded.of(as_tensor(store.data), np.asarray(store.offsets), idx)
    shapes = np.asarray(store.shapes)[idx]
    asks = Asks.whole(a.share)
    asks.regions[1::2] = (0, 0, 8, 8)
    def no_copy(host, end, device, staging, buf, pin):  # the segment free again at once
        staging.give_back(buf, None)
        return host[:end], None

    workers_module.to_device = no_copy
    for _ in range(20):
        pool.collect(pool.submit(batch, shapes, asks), torch.device("cpu"), False)
    caller, reader = time.thread_time(), _thread_ms("gpufeed-decode-replies")
    switches = _switches()
    t0 = time.perf_counter()
    ahead = None
    for _ in range(a.batches):
        if a.cycle_ms:  # as the loader does: the next share submitted, a cycle of other work, this one collected
            share = pool.submit(batch, shapes, asks)
            time.sleep(a.cycle_ms / 1e3)
            if ahead is not None:
                pool.collect(ahead, torch.device("cpu"), False)
            ahead = share
        else:
            pool.collect(pool.submit(batch, shapes, asks), torch.device("cpu"), False)
    if ahead is not None:
        pool.collect(ahead, torch.device("cpu"), False)
    wall = time.perf_counter() - t0
    caller, reader = 1e3 * (time.thread_time() - caller), _thread_ms("gpufeed-decode-replies") - reader
    switches = (_switches() - switches) / a.batches
    print(f"{a.workers} workers, shares of {a.share} images: per share {1e3 * wall / a.batches:.2f} ms wall, "
          f"CPU {caller / a.batches:.3f} ms submitting and collecting, {reader / a.batches:.3f} ms reading replies, "
          f"{switches:.1f} voluntary context switches of this process's threads")
    pool.close()


if __name__ == "__main__":
    main()
