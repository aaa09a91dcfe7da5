"""Starting and stopping the CPU decode worker processes (`decode.pool.worker`), as `DecodeWorkers` uses them.

Each worker is a fresh interpreter started with exec (never fork, never multiprocessing): it shares
no threads or locks with the loader and never imports the user's `__main__`. It sees no GPU and
decodes on one thread; it takes tickets from the pipe the workers share (`protocol`) and says
`Ready` on its stdout, which the loader then watches for its end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace

from gpufeed.decode.pool import protocol
from gpufeed.processes import child_env
from gpufeed.stderr import child_stderr


@dataclass
class Worker:
    proc: subprocess.Popen
    ready: bool = False
    ready_at: float | None = None  # when its `Ready` was heard (time.perf_counter)
    spawned_at: float = 0.0  # when it was started (time.perf_counter)
    said: protocol.Ready | None = None  # its `Ready`, with when its start's steps ended
    dead: str | None = None  # why, once it is gone


def start(setup: protocol.WorkerSetup, count: int) -> list[Worker]:
    """`count` workers on `setup` (numbered 0..count-1), started now (each says `protocol.Ready` once
    it decodes); they inherit the board and the pipes' worker ends, nothing else (what the rows read
    and the pixels' segments they open through /proc)."""
    env = child_env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    shared = (setup.board_fd, setup.tickets_fd, setup.done_fd)
    with child_stderr() as err:  # the process's own, even while nvImageCodec loads (`stderr_aside`)
        return [
            Worker(
                spawned_at=time.perf_counter(),
                proc=subprocess.Popen(
                    [sys.executable, "-m", "gpufeed.decode.pool.worker", json.dumps(replace(setup, index=k).__dict__)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    close_fds=True,
                    pass_fds=shared,
                ),
            )
            for k in range(count)
        ]


def stop(workers: list[Worker], tickets: int) -> None:
    """Close the ticket pipe's write end `tickets` (every worker's read ends: they exit at once) and
    the workers' stdout, wait a moment, kill what still runs."""
    try:
        os.close(tickets)
    except OSError:
        pass
    for w in workers:
        try:
            w.proc.stdout.close()  # type: ignore[union-attr]  # started with stdout=PIPE
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
