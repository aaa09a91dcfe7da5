"""The process's stderr, sent aside while a C library that prints is loaded, and the stderr a child
process started meanwhile gets.

nvImageCodec prints a report on file descriptor 2 for every codec library it can't load
(`decode.codecs.pixels.quiet_codecs`). A descriptor is the process's, not a thread's: while it
points at a sink, whatever else the process writes there (another thread's warning, a traceback)
goes to the sink too, and a child process started then keeps the sink as its stderr for its whole
life (a decode worker's traceback was lost so). `stderr_aside` hands what went to the sink to its
caller once the last thread is out, to be sorted (the library's report from the rest);
`child_stderr` is the process's own stderr for a child, at any time; `steady` holds descriptor 2
as the process's own for a child that can only inherit it (multiprocessing's spawn). Light: the
decode workers import it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO


class _Aside:
    """Descriptor 2 while `stderr_aside` holds it: one sink for all the threads inside at once (the last one out
    puts stderr back). Each saving and putting back its own would leave stderr on a sink where two
    overlap: the GPU decoders opening on their thread while CPU decode threads import nvImageCodec's
    module."""

    lock = threading.Condition()  # (notified as the last thread leaves: `steady` waits for it)
    inside: list[tuple[str, int]] = []  # (`when`, thread ident) of each thread inside
    saved = -1  # stderr's own descriptor, kept while a sink is on it
    sink: IO[bytes] | None = None


@contextmanager
def stderr_aside(when: str, written: Callable[[list[str], bytes], None]) -> Iterator[None]:
    """Descriptor 2 sent to a sink while the block runs (and while any other thread is inside);
    the last thread out puts it back and calls `written(whens, data)` with what went to the sink and
    the `when` of every thread that was inside, once stderr is the process's own again."""
    with _Aside.lock:
        if not _Aside.inside:
            try:
                _Aside.saved = os.dup(2)
            except OSError:  # no stderr open (a daemon's): nothing to send aside
                _Aside.saved = -1
            if _Aside.saved >= 0:
                _Aside.sink = tempfile.TemporaryFile()  # noqa: SIM115  closed by the last thread out
                os.dup2(_Aside.sink.fileno(), 2)
        _Aside.inside.append((when, threading.get_ident()))
    data, whens = b"", []
    try:
        yield
    finally:
        with _Aside.lock:
            whens = [w for w, _ in _Aside.inside]
            _Aside.inside.remove((when, threading.get_ident()))
            sink = _Aside.sink
            if not _Aside.inside and sink is not None:
                os.dup2(_Aside.saved, 2)
                os.close(_Aside.saved)
                _Aside.sink, _Aside.saved = None, -1
                sink.seek(0)
                data = sink.read()
                sink.close()
            if not _Aside.inside:
                _Aside.lock.notify_all()
        if data:
            written(whens, data)


@contextmanager
def child_stderr() -> Iterator[int | None]:
    """A descriptor of the process's own stderr, for a child process started in the block
    (`subprocess.Popen(..., stderr=fd)`), even while `stderr_aside` holds descriptor 2; None (the
    child inherits descriptor 2 as it is) where the process has no stderr open."""
    with _Aside.lock:
        try:
            fd: int | None = os.dup(_Aside.saved if _Aside.inside else 2)
        except OSError:  # closed (a daemon's)
            fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


# how long `steady` waits for descriptor 2 to come back before it lets the block run with the sink on it
STEADY_WAIT = 10.0


@contextmanager
def steady() -> Iterator[None]:
    """Descriptor 2 the process's own for the block: waits for every thread in `stderr_aside` to be out
    (`STEADY_WAIT` seconds at most; not in a thread inside it), and keeps any from coming in until the
    block ends. For starting a child that inherits descriptor 2 and can't be handed another
    (multiprocessing's spawn: a video Loader's decode processes, a pack's workers in a process with
    threads): started while nvImageCodec loaded, it kept the sink for life, and what it wrote after
    went nowhere."""
    with _Aside.lock:
        if all(thread != threading.get_ident() for _, thread in _Aside.inside):  # (one inside waits for none)
            _Aside.lock.wait_for(lambda: not _Aside.inside, timeout=STEADY_WAIT)
        yield
