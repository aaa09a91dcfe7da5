"""Starting and stopping the CPU decode worker processes (`decode.worker`), as `DecodeWorkers` uses them.

Each worker is a fresh interpreter started with exec (never fork, never multiprocessing): it shares
no threads or locks with the loader and never imports the user's `__main__`. It sees no GPU and
decodes on one thread; it reads the loader's `protocol.Chunk`s on stdin and answers on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gpufeed
from gpufeed.decode import protocol


@dataclass
class Worker:
    proc: subprocess.Popen
    ready: bool = False
    dead: str | None = None  # why, once it is gone


def start(setup: protocol.WorkerSetup, count: int) -> list[Worker]:
    """`count` workers on `setup`, started now (each says `protocol.Ready` once it decodes)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(gpufeed.__file__).parent.parent),
                                           os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return [Worker(subprocess.Popen([sys.executable, "-m", "gpufeed.decode.worker", json.dumps(setup.__dict__)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True))
            for _ in range(count)]


def stop(workers: list[Worker]) -> None:
    """Close the workers' stdin (they exit at once), wait a moment, kill what still runs."""
    for w in workers:
        for pipe in (w.proc.stdin, w.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
