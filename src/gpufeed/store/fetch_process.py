"""A store in a bucket's downloads in a process of their own (`Tuning.fetch_process`), so that no thread
of the training process stands between them and the link.

An object store's client (s3fs's event loop) takes the GIL for each piece of each response: beside a
thread that keeps the GIL (a training loop blocked in a kernel launch holds it) the fetch ahead
carried 24-26 MB/s of a 125 MB/s link, alone 104-108 (docs/benchmarks.md, "Open questions"). Here
one child process, started with exec (no fork, no multiprocessing, never the user's `__main__`),
runs the downloads on threads of its own: the cache sends the `fetch.Fetcher` once (`Warm`, pickled
with its filesystem), then each shard's `Ask` (its files and where they go), and waits for its `Done`; the files land in
the cache's folder, never through the pipe. The cache decides what and where as before
(`store.remote.ShardCache`); until the child says `Ready` (its imports and filesystem made: about a
second), and after it ended, the downloads run in this process, and the second is said once.

The child ends with this process, however it ends (it watches its parent, and its stdin closes), and
is killed at the cache's `close`; it leaves Ctrl-C to this process (SIGINT ignored, as the decode
workers do), and keeps its stdout, the messages' pipe, from anything else that writes to fd 1.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gpufeed.logs import logger
from gpufeed.stderr import child_stderr
from gpufeed.store.fetch import Fetcher
from gpufeed.store.format import StoreError

log = logger(__name__)

THREADS = 8  # downloads at once in the child: the fetch ahead's and the batches' own, with room


class Ended(StoreError):
    """The download process ended before it answered: the download is the caller's to do again."""


@dataclass
class Warm:
    """Sent first: the downloads' `Fetcher`, its filesystem made (and its libraries imported) before any
    download, and kept for them all."""

    fetcher: Fetcher


@dataclass
class Ready:
    """The child made its filesystem: downloads go to it from now on."""


@dataclass
class Ask:
    """Download shard files `files` of the remote folder `remote` into the local folder `into`, checked
    (`Fetcher.checked`)."""

    number: int
    remote: str
    files: dict[str, dict[str, Any]]
    into: str


@dataclass
class Done:
    """An `Ask`'s end: `error` None where its files are in place."""

    number: int
    error: BaseException | None


class FetchProcess:
    """The child process and this side of its pipes (the module's docstring)."""

    def __init__(self, fetcher: Fetcher):
        from gpufeed.processes import child_env  # (multiprocessing's import: only where this runs)

        self.fetcher = fetcher  # the child's too (`Warm`): each `Ask` is only what to download, and where
        warm = pickle.dumps(Warm(fetcher))  # (a filesystem that does not pickle: raised here, no child started)
        with child_stderr() as err:  # the process's own, even while nvImageCodec loads (`stderr_aside`)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gpufeed.store.fetch_process", str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=child_env(),
                close_fds=True,
            )
        self._lock = threading.Lock()  # the asks in flight and their numbers
        self._writing = threading.Lock()  # the pipe to the child (taken after `_lock`, never the other way)
        self._waiting: dict[int, Future] = {}
        self._number = 0
        self._ready = threading.Event()
        self._ended: str | None = None  # why the child is gone, once it is
        self.closed = False  # `close` ended it: its downloads are not to be done again here
        self._said = False
        self._write(warm)
        threading.Thread(target=self._listen, daemon=True, name="gpufeed-fetch-process").start()

    @property
    def asked(self) -> int:
        """Downloads sent to the child so far."""
        return self._number

    def ready(self) -> bool:
        """Whether downloads go to the child now (it made its filesystem and has not ended); said once
        where it ended before `close`."""
        if self._ended is not None and not self.closed:
            with self._lock:
                said, self._said = self._said, True
            if not said:
                log.warning("gpufeed: the download process ended (%s): downloads run in this process", self._ended)
        return self._ready.is_set() and self._ended is None

    def checked(self, remote: str, files: dict[str, dict[str, Any]], into: Path) -> None:
        """`fetcher.checked(remote, files, into)` in the child: its error raised here; `Ended` where the
        child ended first (what it left in `into` is the caller's to remove)."""
        future: Future = Future()
        with self._lock:
            if self._ended is not None:
                raise Ended(f"{self.fetcher.shown(remote)}: the download process ended ({self._ended})")
            self._number += 1
            data = pickle.dumps(Ask(self._number, remote, files, os.fspath(into)))
            self._waiting[self._number] = future
        self._write(data)  # (failing, it ends the child's side: the future then holds `Ended`)
        future.result()

    def close(self) -> None:
        """End the child at once (its downloads in flight stop; their asks fail with `Ended`, and
        `closed` says not to do them again here)."""
        self.closed = True
        self._stop("closed")

    def _stop(self, why: str) -> None:
        """Kill the child (a process a fork made after it holds its stdin too: its end can't be waited
        for), then fail what it was asked."""
        self._proc.kill()
        self._proc.wait()
        try:
            self._proc.stdin.close()  # type: ignore[union-attr]  # (started with stdin=PIPE)
        except OSError:
            pass
        self._end(why)

    def _write(self, data: bytes) -> None:
        """One message, pickled whole before any of it is written (an object that does not pickle leaves
        the pipe as it was); a pipe the child closed ends it here (`_end`)."""
        try:
            with self._writing:
                self._proc.stdin.write(data)  # type: ignore[union-attr]  # (started with stdin=PIPE)
                self._proc.stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError) as e:  # (its end of the pipe closed: it ended)
            self._stop(f"its pipe: {e}")

    def _listen(self) -> None:
        stdout: BinaryIO = self._proc.stdout  # type: ignore[assignment]  # (started with stdout=PIPE)
        while True:
            try:
                message = pickle.load(stdout)
            except Exception:  # noqa: BLE001 - EOF, a broken pipe, a message cut off or unreadable: it is over
                self._stop(f"exit status {self._proc.poll()}")  # (killed first: an unreadable one left it running)
                return
            if isinstance(message, Ready):
                self._ready.set()
            elif isinstance(message, Done):
                with self._lock:
                    future = self._waiting.pop(message.number, None)
                if future is not None:
                    if message.error is None:
                        future.set_result(None)
                    else:
                        future.set_exception(message.error)

    def _end(self, why: str) -> None:
        with self._lock:
            if self._ended is None:
                self._ended = why
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            future.set_exception(Ended(f"the download process ended ({why})"))


def _child(parent: int) -> None:
    """The child: downloads what the parent asks, on `THREADS` threads, each answered as it ends."""
    from gpufeed.processes import watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C (the whole foreground group's) is the parent's
    watch_parent(parent)
    stdin = sys.stdin.buffer
    stdout = os.fdopen(os.dup(1), "wb")  # the messages' pipe, on a descriptor of its own
    os.dup2(2, 1)  # what else writes to fd 1 (a library, a program it starts) goes to stderr
    sys.stdout = sys.stderr
    said = threading.Lock()

    def answer(message: Ready | Done) -> None:
        try:
            data = pickle.dumps(message)
            if isinstance(message, Done) and message.error is not None:
                pickle.loads(data)  # (an exception whose class can't be made again from its args fails here)
        except Exception:  # noqa: BLE001 - an error that does not pickle (a client library's): said as text
            assert isinstance(message, Done)
            try:
                text = f"{type(message.error).__name__}: {message.error}"
            except Exception:  # noqa: BLE001 - (its str() failing too)
                text = type(message.error).__name__
            data = pickle.dumps(Done(message.number, StoreError(text)))
        with said:
            stdout.write(data)
            stdout.flush()

    def run(fetcher: Fetcher, ask: Ask) -> None:
        try:
            fetcher.checked(ask.remote, ask.files, Path(ask.into))
            answer(Done(ask.number, None))
        except BaseException as e:  # noqa: BLE001 - every error goes back to the shard's download
            answer(Done(ask.number, e))

    with ThreadPoolExecutor(THREADS, thread_name_prefix="gpufeed-fetch") as pool:
        while True:
            try:
                message = pickle.load(stdin)
            except EOFError:  # the parent closed the pipe, or ended
                os._exit(0)
            if isinstance(message, Warm):  # its filesystem made as it was unpickled
                fetcher = message.fetcher
                answer(Ready())
            elif isinstance(message, Ask):  # (after the `Warm` the parent sends first)
                pool.submit(run, fetcher, message)


if __name__ == "__main__":  # (run as a script: the messages' classes are the imported module's, not __main__'s)
    from gpufeed.store import fetch_process

    fetch_process._child(int(sys.argv[1]))
