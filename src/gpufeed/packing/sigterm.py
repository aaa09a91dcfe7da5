"""SIGTERM during a pack (kill, `timeout`, a scheduler) cleans up as Ctrl-C does.

Its default action would end the process on the spot, leaving the hidden scratch folder beside the
destination (as large as the store) for nothing to remove. While a pack runs in the main thread,
SIGTERM instead becomes `Terminated`, a SystemExit with the status a shell reports for the signal
(143), raised where the pack can unwind: no library's machinery is interrupted half-way.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType


class Terminated(SystemExit):
    """SIGTERM ended a pack, after the cleanup Ctrl-C gets (scratch folder and lock removed, workers
    stopped). It ends the process, as SIGTERM's default action would have, with the status a shell
    reports for that signal: 128 + 15."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


class SigtermStop:
    """SIGTERM during a pack, made `Terminated` where it can unwind: at once if only gpufeed's code was
    running in the pack, else (a wait on the workers, the pool's or threading's machinery, a decoder,
    a dataset's code, the store's commit or cleanup) at the pack's next `check`, made after each
    chunk and before and after the data files are finished. So no library is interrupted half-way,
    and the cleanup (workers stopped, scratch folder and lock removed) runs whole, as on Ctrl-C."""

    def __init__(self, within: CodeType) -> None:
        self.within = within  # the code of the function packing (whose frame is the top of its own code)
        self.requested = False

    def check(self) -> None:
        if self.requested:
            raise Terminated()

    def on_sigterm(self, signum: int, frame) -> None:
        if self.requested:  # a second SIGTERM must not cut the cleanup short
            return
        self.requested = True
        while frame is not None and frame.f_globals.get("__name__", "").startswith("gpufeed."):
            if frame.f_code is self.within:  # only gpufeed's code between here and the pack
                raise Terminated()
            frame = frame.f_back


@contextmanager
def sigterm_stops(within: CodeType) -> Iterator[SigtermStop]:
    """A `SigtermStop` handling SIGTERM while packing, instead of its default action ending the process
    on the spot and leaving the scratch folder behind; the default is restored after.

    Only where SIGTERM has its default action and this is the main thread (Python runs handlers there
    only); a handler the caller installed, or SIG_IGN, is theirs and stays (the stop then never
    fires). A forked worker inherits the handler: in it, the signal takes its default action.
    `within`: the code of the function packing, up to which the stack is checked."""
    stop = SigtermStop(within)
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield stop
        return
    owner = os.getpid()

    def on_sigterm(signum: int, frame) -> None:
        if os.getpid() != owner:  # a forked worker
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        else:
            stop.on_sigterm(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield stop
    except BaseException as e:
        if stop.requested and not isinstance(e, Terminated):  # an error SIGTERM caused (workers it ended)
            raise Terminated() from e
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
