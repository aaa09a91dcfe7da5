"""The process's stderr while nvImageCodec loads (`gpufeed.stderr`, `pixels.quiet_codecs`): its report
goes to the debug log, nothing else the process writes meanwhile is lost, and a child process started
then gets the process's own stderr."""

from __future__ import annotations

import os
import subprocess
import sys

OVERLAPPING = """
import os, threading
from gpufeed.decode.codecs import pixels
before = os.fstat(2)
a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
def a():
    with pixels.quiet_codecs("a"):
        a_in.set()
        b_in.wait()
    a_out.set()
def b():
    a_in.wait()
    with pixels.quiet_codecs("b"):
        b_in.set()
        a_out.wait()
        os.write(2, b"\\x1b[0;31m[ERROR] \\x1b[0m[nvtiff_ext] swallowed\\n")
threads = [threading.Thread(target=f) for f in (a, b)]
for t in threads:
    t.start()
for t in threads:
    t.join()
after = os.fstat(2)
os.write(2, b"heard\\n")
print((before.st_dev, before.st_ino) == (after.st_dev, after.st_ino))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)


def test_two_threads_quieting_the_codecs_at_once_give_stderr_back():
    """One thread in, a second in, the first out, the second out (the GPU decoders opening while CPU
    decode threads import nvImageCodec's module): stderr is the process's own again after both, and
    nvImageCodec's report printed meanwhile went to the sink. Each saving and restoring its own left
    it on the first one's sink."""
    done = _run(OVERLAPPING)
    assert done.stdout.split() == [b"True"] and done.stderr == b"heard\n", (done.stdout, done.stderr)


SORTED = """
import logging, os
from gpufeed.decode.codecs import pixels
logging.basicConfig(level=logging.DEBUG, filename=os.environ["LOG"], format="%(message)s")
logging.getLogger("user").addHandler(logging.StreamHandler())  # the user's own, on stderr
with pixels.quiet_codecs("loading"):
    os.write(2, b"Failed to load nvjpeg2k library! Please install nvJPEG2000.\\n")
    logging.getLogger("user").warning("a warning meanwhile")
    os.write(2, b"Note: If using nvImageCodec's Python distribution, it is enough to install the nvJPEG2000 wheel\\n")
    os.write(2, b"\\x1b[0;31m[ERROR] \\x1b[0m[nvjpeg2k_ext] Failed to load nvJPEG2000 library\\n")
    os.write(2, b"\\xff raw bytes\\n")
    os.write(2, b"[WARNING] a user's log line, as its format has it\\n")
print("done")
"""


def test_what_else_is_written_while_the_codecs_load_reaches_stderr_and_their_report_the_debug_log(tmp_path):
    """A descriptor is the process's: while nvImageCodec's report went to a sink, another thread's
    warning went there too, and all of it to the debug log. Now the report alone goes there; the rest
    reaches stderr as it was written, once stderr is back."""
    log = tmp_path / "log"
    done = subprocess.run([sys.executable, "-c", SORTED], capture_output=True, timeout=120,
                          env={**os.environ, "LOG": str(log)})
    assert done.stdout == b"done\n", done.stderr
    assert done.stderr == b"a warning meanwhile\n\xff raw bytes\n[WARNING] a user's log line, as its format has it\n"
    said = log.read_text(errors="replace")
    assert "nvImageCodec loading" in said and "Failed to load nvjpeg2k library" in said and "[nvjpeg2k_ext]" in said
    assert "a warning meanwhile" not in said.split("nvImageCodec loading")[1]


STARTED_MEANWHILE = """
import os
from gpufeed.decode.codecs import pixels
from gpufeed.decode.pool import protocol, spawn
board = os.memfd_create("board")  # empty: the worker can't map its rows, and says so on its stderr
tickets, done = os.pipe()
setup = protocol.WorkerSetup(parent=os.getpid(), index=0, board_fd=board, board_rows=64, tickets_fd=tickets, done_fd=done)
with pixels.quiet_codecs("loading"):
    workers = spawn.start(setup, 1)
print(workers[0].proc.wait(60))
"""


def test_a_decode_worker_started_while_the_codecs_load_keeps_the_process_stderr():
    """A worker started while nvImageCodec's report goes to a sink (another loader's GPU decoders
    opening) inherited the sink as its stderr for life: its traceback, written after the sink was
    read, was lost. It gets the process's own now."""
    done = _run(STARTED_MEANWHILE)
    assert done.stdout.split() == [b"1"], done.stderr
    assert b"Traceback" in done.stderr and b"mmap" in done.stderr, done.stderr


UNWRITABLE = """
import os, sys
from gpufeed.decode.codecs import pixels
with pixels.quiet_codecs("loading"):
    os.write(2, b"a line nobody will read\\n")
os.close(2)
with pixels.quiet_codecs("loading again"):
    os.write(1, b"")
print("done", flush=True)
"""


def test_a_stderr_that_cannot_be_written_or_is_closed_fails_nothing():
    """What went to the sink is written back to stderr once it is back: where nobody reads stderr any
    more (a pipe closed) that write failed, and the error escaped the codecs' loading. With stderr
    closed, sending it aside failed the same way."""
    proc = subprocess.Popen([sys.executable, "-c", UNWRITABLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stderr.close()  # nobody reads it: a write gets EPIPE
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out == b"done\n", out


SPAWNED_MEANWHILE = """
import os, threading, time
from gpufeed.processes import process_pool
from gpufeed.stderr import stderr_aside
inside = threading.Event()
def loading():
    with stderr_aside("loading", lambda whens, data: None):
        inside.set()
        time.sleep(1.0)
threading.Thread(target=loading).start()
inside.wait()
pool = process_pool(1)  # (this process has threads: spawned, at the first submit)
job = pool.submit(exec, "import os, time; time.sleep(1.5); os.write(2, b'written by the pool worker')")
job.result()
pool.shutdown()
print("done", flush=True)
"""


def test_a_pool_worker_spawned_while_the_codecs_load_keeps_the_process_stderr():
    """A spawned pool's worker (a video Loader's decode processes, a pack's workers where the process
    has threads) inherits descriptor 2 as it is: spawned while nvImageCodec's report went to a sink,
    what it wrote once the sink was read went nowhere. It is spawned once stderr is back."""
    done = _run(SPAWNED_MEANWHILE)
    assert done.stdout == b"done\n", done.stderr
    assert b"written by the pool worker" in done.stderr, done.stderr
