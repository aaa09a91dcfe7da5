"""A jpeg Loader's processes behave like a torch DataLoader's: they never re-run the user's script,
they end with the program however it ends (SIGKILL included), and exit never waits for close()."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import gpufeed
from conftest import save, smooth

SRC = str(Path(gpufeed.__file__).parent.parent)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("life")
    for i in range(16):
        save(root / "src" / f"c{i % 2}" / f"{i:03d}.png", smooth(i, 40, 56))
    gpufeed.pack(root / "src", root / "store", mode="jpeg", quality=90, workers=1, progress=False)
    return root / "store"


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(body))
    return path


def _run(path: Path, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    env = env if env is not None else dict(os.environ)
    env = dict(env, PYTHONPATH=os.pathsep.join([SRC, env.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(path), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _children(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = {int(k) for k in task.read_text().split()}
            except OSError:
                continue
            found |= kids
            todo += kids
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _kill_and_expect_gone(proc: subprocess.Popen, kids: set[int], sig: int) -> None:
    """Send `sig` to `proc`; it exits within 30 s and every one of `kids` within 5 s more."""
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 5
    while _alive(kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(kids), f"still running after {sig!r}: {_alive(kids)}"


UNGUARDED = """
import sys, gpufeed
from gpufeed.augment import RandomResizedCrop
print("BODY RAN", flush=True)
loader = gpufeed.Loader(sys.argv[1], batch_size=4, device="cpu", augment=[RandomResizedCrop(16)], num_workers=2)
assert loader.jpeg.workers.wait_ready(60)
print("BATCHES", sum(1 for _ in loader), flush=True)
"""


def test_an_unguarded_script_runs_once_and_exits_without_close(store, tmp_path):
    """No `if __name__ == "__main__"`, no close(): the body runs once (workers never import the
    main module), the workers decode, and the program exits promptly leaving no process behind."""
    proc = _run(_script(tmp_path, UNGUARDED), str(store))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.count("BODY RAN") == 1 and "BATCHES 4" in out, out
    assert "Traceback" not in err and "leaked" not in err, err
    assert "gpufeed" not in err, err  # the workers stopped at exit: no worker death, no undecodable sample


HOLDS = """
import signal, sys, time, gpufeed
# Ctrl-C raises KeyboardInterrupt, as in a program started from a terminal: one started by a
# non-interactive shell's `&` (a CI script, a backgrounded test run) inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from gpufeed.augment import RandomResizedCrop
loader = gpufeed.Loader(sys.argv[1], batch_size=4, device="cpu", augment=[RandomResizedCrop(16)], num_workers=2)
assert loader.jpeg.workers.wait_ready(60)
it = iter(loader)
next(it)
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_no_process_outlives_a_killed_program(store, tmp_path, sig):
    proc = _run(_script(tmp_path, HOLDS), str(store))
    assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
    kids = _children(proc.pid)
    assert len(kids) >= 2
    _kill_and_expect_gone(proc, kids, sig)


def test_a_loader_made_before_a_fork_refuses_to_run_in_the_child(store, tmp_path):
    body = """
    import os, sys, gpufeed
    from gpufeed.augment import RandomResizedCrop
    loader = gpufeed.Loader(sys.argv[1], batch_size=4, device="cpu", augment=[RandomResizedCrop(16)], num_workers=1)
    next(iter(loader))
    pid = os.fork()
    if pid == 0:
        try:
            next(iter(loader))
        except RuntimeError as e:
            print("CHILD", e, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print("PARENT", sum(1 for _ in loader), flush=True)
    """
    proc = _run(_script(tmp_path, body), str(store))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "CHILD this gpufeed.Loader was made in another process" in out and "PARENT" in out, out + err


PACKS = """
import sys, threading, time, gpufeed
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a process with threads is not forked
print("BODY RAN", flush=True)
report = gpufeed.pack(sys.argv[1], sys.argv[2], size=16, workers=2, progress=False)
print("PACKED", report.count, flush=True)
"""


def test_packing_from_a_threaded_unguarded_script_runs_its_body_once(tmp_path):
    for i in range(6):
        save(tmp_path / "src" / f"c{i % 2}" / f"{i:03d}.png", smooth(i, 20, 24))
    proc = _run(_script(tmp_path, PACKS), str(tmp_path / "src"), str(tmp_path / "out"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.count("BODY RAN") == 1 and "PACKED 6" in out, out + err


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_killed_pack_leaves_no_worker(tmp_path, sig):
    for i in range(400):
        save(tmp_path / "src" / f"c{i % 2}" / f"{i:04d}.png", smooth(i, 48, 64))
    # each chunk's results taken in 0.25 s later: the pack is still running when the signal comes (400
    # small images packed in 0.5 s, and on 2 busy cores one was committed before SIGINT arrived)
    code = f"""
import signal, time, gpufeed
from gpufeed.packing import packer
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see HOLDS)
add = packer._add
packer._add = lambda *a: (time.sleep(0.25), add(*a))[1]
gpufeed.pack({str(tmp_path / 'src')!r}, {str(tmp_path / 'dest')!r}, size=64, workers=2, progress=False)
"""
    proc = _run(_script(tmp_path, code))
    deadline = time.monotonic() + 60
    while len(_alive(_children(proc.pid))) < 2:  # its two workers are running
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    kids = _children(proc.pid)
    _kill_and_expect_gone(proc, kids, sig)
    assert not (tmp_path / "dest").exists(), (proc.returncode, proc.stdout.read(), proc.stderr.read()[-3000:])


def test_a_ctrl_c_as_a_pack_forks_its_workers_stops_the_pack(tmp_path):
    """Right after a fork Python runs its fork callbacks in the parent (logging's among them), and a
    KeyboardInterrupt raised inside one is printed as "Exception ignored" and lost: a Ctrl-C that came
    as a pack's workers were forked let the pack run on and commit (the test above, one suite run in
    two on 2 busy cores). Here the Ctrl-C comes inside such a callback, every time."""
    for i in range(40):
        save(tmp_path / "src" / f"c{i % 2}" / f"{i:04d}.png", smooth(i, 20, 24))
    code = """
import os, signal, sys, gpufeed

def forked():
    print("FORKED", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGINT)

signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see HOLDS)
os.register_at_fork(after_in_parent=forked)
gpufeed.pack(sys.argv[1], sys.argv[2], size=16, workers=2, progress=False)
print("PACKED", flush=True)
"""
    # one thread, so that the pool forks (BLAS's threads would have it spawn)
    one = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = _run(_script(tmp_path, code), str(tmp_path / "src"), str(tmp_path / "dest"), env=dict(os.environ, **one))
    out, err = proc.communicate(timeout=120)
    assert "FORKED" in err and proc.returncode != 0 and "PACKED" not in out and "KeyboardInterrupt" in err, out + err
    assert "Exception ignored" not in err and not (tmp_path / "dest").exists(), err
    assert not list(tmp_path.glob(".dest.*")), list(tmp_path.iterdir())



def test_a_pool_stopped_as_its_workers_fork_leaves_no_thread_running(tmp_path):
    """A pool whose start is interrupted (the Ctrl-C of the test above) is shut down before the error
    goes on: its manager thread, left to end on its own, closed its wake-up pipe just as the
    interpreter's exit wrote to it, and the exit printed "Exception ignored ... Bad file descriptor"
    (Python 3.11's concurrent.futures; the test above failed so once in CI)."""
    code = """
import threading
from gpufeed import processes
fork = processes._fork_now

def interrupted(pool):
    fork(pool)
    raise KeyboardInterrupt

processes._fork_now = interrupted
try:
    processes.process_pool(2)
except KeyboardInterrupt:
    print("LEFT", sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()), flush=True)
"""
    one = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # (a forked pool)
    proc = _run(_script(tmp_path, code), env=dict(os.environ, **one))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "LEFT []" in out and "Exception ignored" not in err, out + err


READY = """
import os, pathlib
from gpufeed import processes

def ready(parent, niceness):  # a pool worker's initializer that says it ran: the worker waits for work
    processes._worker(parent, niceness)
    (pathlib.Path(__file__).parent / f"ready-{os.getpid()}").touch()
"""


@pytest.mark.parametrize("where", ["worker", "manager"])
def test_a_ctrl_c_as_a_spawning_pool_starts_a_worker_ends_the_pack(tmp_path, where):
    """A pool in a process with threads (numpy's BLAS threads: on 2 cores, every pack) spawns its
    workers inside `submit`, and records each a few steps after it started. A Ctrl-C in between left
    a worker the pool never ended, and the exit waited on it for ever (test_a_killed_pack_leaves_no_worker
    hung so once in CI); one as the pool's manager thread started ended the pack with "RuntimeError:
    cannot join thread before it is started". Here the Ctrl-C comes right there, every time."""
    for i in range(40):
        save(tmp_path / "src" / f"c{i % 2}" / f"{i:04d}.png", smooth(i, 20, 24))
    (tmp_path / "ready.py").write_text(READY)
    code = f"""
import pathlib, signal, sys, threading, time, gpufeed, ready
from concurrent.futures import process
from gpufeed import processes
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()  # a process with threads: spawned
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (see HOLDS)
if {where!r} == "worker":
    processes._worker = ready.ready
    start = processes._SpawnWithoutMain._start_without_main
    def interrupted(self):
        start(self)  # the worker runs, and the pool has not recorded it yet
        while not (pathlib.Path(ready.__file__).parent / f"ready-{{self.pid}}").exists():
            time.sleep(0.01)
        signal.raise_signal(signal.SIGINT)
    processes._SpawnWithoutMain._start_without_main = interrupted
else:
    manager = process._ExecutorManagerThread.start
    def interrupted(self):
        signal.raise_signal(signal.SIGINT)
        manager(self)
    process._ExecutorManagerThread.start = interrupted
gpufeed.pack(sys.argv[1], sys.argv[2], size=16, workers=2, progress=False)
print("PACKED", flush=True)
"""
    path = _script(tmp_path, code)
    proc = _run(path, str(tmp_path / "src"), str(tmp_path / "dest"), env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the pack did not end after Ctrl-C: {err[-3000:]}") from None
    assert proc.returncode != 0 and "PACKED" not in out and "KeyboardInterrupt" in err, out + err
    assert "RuntimeError" not in err and "Exception ignored" not in err, err
    assert not (tmp_path / "dest").exists() and not list(tmp_path.glob(".dest.*")), list(tmp_path.iterdir())


def test_a_pools_deferred_signals_keep_ignored_ones_ignored_and_come_after_it_sigterm_first(monkeypatch):
    """`processes._signals_deferred` (a spawning pool's submit): SIG_IGN stays as it is inside it (a
    worker spawned then inherits it); a SIGINT and a SIGTERM that came inside come after it, SIGTERM
    first (raising the KeyboardInterrupt first lost the SIGTERM); a Ctrl-C as the handlers are put back
    (`signal.signal` runs a pending handler first, and swaps nothing then) leaves neither swapped."""
    from gpufeed import processes

    got = []
    real = signal.signal
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
        with processes._signals_deferred():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGTERM)
            assert got == []
        assert got == [signal.SIGTERM]
        got.clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):
            with processes._signals_deferred():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGTERM)
                assert got == []
        assert got == [signal.SIGTERM]
        term = signal.getsignal(signal.SIGTERM)
        pending = [True]

        def interrupted(signum, handler):  # a Ctrl-C pending as SIGTERM's handler is put back
            if signum == signal.SIGTERM and handler is term and pending:
                pending.clear()
                raise KeyboardInterrupt
            return real(signum, handler)

        monkeypatch.setattr(signal, "signal", interrupted)
        with pytest.raises(KeyboardInterrupt):
            with processes._signals_deferred():
                pass
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is term
    finally:
        for s, handler in saved.items():
            real(s, handler)


FETCHES = """
import socket, sys, threading, time, fsspec
from gpufeed.store.fetch import Fetcher
from gpufeed.store.fetch_process import FetchProcess

silent = socket.create_server(("127.0.0.1", 0))  # never answers: the download below waits for ever
url = f"http://127.0.0.1:{silent.getsockname()[1]}"
fetcher = Fetcher(fsspec.filesystem("http"), url, url, sys.argv[1])
away = FetchProcess(fetcher)
deadline = time.monotonic() + 60
while not away.ready():
    if time.monotonic() > deadline:
        sys.exit("the download process was not ready in 60 s")
    time.sleep(0.05)
threading.Thread(target=away.checked, args=(f"{url}/shard", {"data.bin": {"bytes": 4, "digest": "0" * 64}},
                                            __import__("pathlib").Path(sys.argv[1])), daemon=True).start()
print("CHILD", away._proc.pid, flush=True)
time.sleep(0.5)
if sys.argv[2] == "exit":
    sys.exit(3)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["exit", "SIGKILL"])
def test_a_download_process_ends_with_its_parent_and_never_holds_its_exit(tmp_path, how):
    """`store.fetch_process`: with a download in flight (a server that never answers), the parent exits at
    once with its own status, and its download process ends with it, SIGKILL included."""
    pytest.importorskip("aiohttp")
    proc = _run(_script(tmp_path, FETCHES), str(tmp_path), how)
    line = proc.stdout.readline()
    assert line.startswith("CHILD"), line + proc.stderr.read()
    child = int(line.split()[1])
    if how == "SIGKILL":
        time.sleep(0.6)
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == (3 if how == "exit" else -signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive({child}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive({child}), f"the download process {child} outlived its parent"


RANK = """
import sys, torch.distributed as dist, gpufeed
from gpufeed.augment import RandomResizedCrop
rank, store, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
for name in ("raw", "jpeg"):
    loader = gpufeed.Loader(f"{store}-{name}", batch_size=2, device="cpu", augment=[RandomResizedCrop(16)])
    assert loader.world_size == 2
    for _ in loader:
        pass
dist.barrier()
dist.destroy_process_group()
print("DONE", rank, flush=True)
"""


def test_two_ranks_exit_without_close(tmp_path, store):
    """Two gloo ranks iterate a raw and a jpeg Loader and never close them: both exit promptly."""
    src = tmp_path / "src"
    for i in range(8):
        save(src / f"c{i % 2}" / f"{i:03d}.png", smooth(i, 20, 24))
    gpufeed.pack(src, tmp_path / "s-raw", size=16, workers=1, progress=False)
    gpufeed.pack(src, tmp_path / "s-jpeg", mode="jpeg", workers=1, progress=False)
    script = _script(tmp_path, RANK)
    procs = [_run(script, str(rank), str(tmp_path / "s"), str(tmp_path / "init")) for rank in (0, 1)]
    t0 = time.monotonic()
    outs = [p.communicate(timeout=120) for p in procs]
    assert time.monotonic() - t0 < 60
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DONE {rank}" in out, err


def _resources() -> dict:
    shm = Path("/dev/shm")
    return {"children": len(_alive(_children(os.getpid()))), "fds": len(os.listdir("/proc/self/fd")),
            "shm": len(list(shm.iterdir())) if shm.is_dir() else 0,
            "threads": len(os.listdir("/proc/self/task"))}


@pytest.mark.parametrize("close", [True, False])
def test_twenty_loaders_leave_nothing_behind(store, close):
    """20 jpeg Loaders made, iterated and closed (or dropped): no process, fd, shared-memory entry or
    thread is left over (what one Loader leaves, 20 leave 20 times; 50 cost the suite 9 s more)."""
    import gc

    from gpufeed.augment import RandomResizedCrop

    def cycle():
        loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=[RandomResizedCrop(16)], num_workers=1)
        assert sum(1 for _ in loader) == 4
        if close:
            loader.close()

    cycle()  # imports, thread pools made once per process
    gc.collect()
    time.sleep(0.5)
    before = _resources()
    for _ in range(20):
        cycle()
    gc.collect()
    def leaked() -> dict:  # what grew (what earlier tests left may have ended meanwhile)
        now = _resources()
        return {k: (before[k], now[k]) for k in now if now[k] > before[k]}

    deadline = time.monotonic() + 10
    while leaked() and time.monotonic() < deadline:  # workers reaped, threads ended
        gc.collect()
        time.sleep(0.1)
    assert not leaked()


def test_a_loader_dropped_mid_epoch_shuts_down_in_order_as_it_is_collected(store, monkeypatch):
    """Dropped without close() after one batch (a batch started ahead still decoding): its collection
    starts close()'s ordered shutdown, and the tier (which keeps a jpeg store's bytes page-locked on a
    GPU) goes only after the decoders stopped. Before, the loader's attributes went in the order they
    were set, the tier's first: on an H100 the store's bytes were unregistered under a GPU decode still
    reading them, and the CUDA context faulted in 2 to 4 of 6 runs of twelve dropped loaders."""
    import gc
    import threading
    import weakref

    from gpufeed.augment import RandomResizedCrop
    from gpufeed.loader import loader as loader_module

    gc.collect()  # earlier tests' loaders left in cycles shut down now, before the recording (it saw two)
    for thread in [t for t in threading.enumerate() if t.name == "gpufeed-shutdown"]:
        thread.join(60)
    seen = []
    original = loader_module._shut_down

    def recorded(production, jpeg, gather, source, planner, tier, pid):
        alive = weakref.ref(tier)
        original(production, jpeg, gather, source, planner, tier, pid)
        seen.append((alive() is not None, {t.name for t in threading.enumerate() if t.name.startswith("gpufeed-producer")}))

    monkeypatch.setattr(loader_module, "_shut_down", recorded)
    loader = gpufeed.Loader(store, batch_size=4, device="cpu", augment=[RandomResizedCrop(16)], num_workers=1)
    it = iter(loader)
    next(it)
    del it, loader
    gc.collect()
    for thread in [t for t in threading.enumerate() if t.name == "gpufeed-shutdown"]:
        thread.join(60)  # the shutdown runs on a thread of its own (the collecting thread may be any)
    assert seen == [(True, set())]  # once, the tier alive through it, no producer left


def test_a_process_with_threads_starts_its_pools_without_fork(tmp_path, monkeypatch):
    """Photos made for a demo or a benchmark (`synth.make_image_folder`) from a process that runs
    threads (CUDA's, a Loader's) come from spawned workers: forking it could copy a lock another
    thread holds, or CUDA's state, into the child."""
    import threading

    from gpufeed.synth import make_image_folder

    def fork():
        raise AssertionError("a process with threads was forked")

    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    monkeypatch.setattr(os, "fork", fork)
    try:
        make_image_folder(tmp_path, per_class=130, classes=2, height=32, width=32)
    finally:
        stop.set()
    assert len(list(tmp_path.rglob("*.jpg"))) == 260
