"""Training from a store in a bucket over an emulated link (issue 48): the link's own ceiling, a cold
epoch, a warm one, and epochs through a cache a quarter of the store's size, against the model's
synthetic-data ceiling and the same store on a local disk, in one process.

    PYTHONPATH=src python benchmarks/remote_bench.py --n 10000 --workdir /tmp/rb --link 2gbit --latency 20ms
    # needs moto[server] and s3fs (the tests' S3 server; on the device, carried as wheels)

moto's S3 server runs on 127.0.0.1, and in front of it a link (`Link`): a TCP relay that holds every
chunk it relays for --latency (one way, both directions) and sends what the server sends at most at
--link bits per second, one pace for all connections (one link). Both run in a child process of
their own: in the benchmark's process their threads would take the GIL from the loader's. One such
process sends 200-300 MB/s on a GPU host, below a 10 Gbit/s link: --servers N runs N, each with a
copy of the bucket and its relay, the relays on one port (the kernel hands each connection to one of
them) and one pace (the link's rate for all of them together). The
images (photo-like by default, as train_bench's: `--data`) are packed straight into the bucket as a
sharded jpeg store (--shard-size), and into a local folder. Rows, each timed over whole epochs (from
the Loader's first batch asked for to its last one trained on, with ResNet-18 in bf16 on batches of
--batch):

- server: every shard's file downloaded once from the servers themselves (no link; the files dealt
  to the --servers in turn) by --link-threads threads (fsspec): what they can send, which must be
  well above the link for the rows below to measure the link;
- link: the same through the link, the link's ceiling in bytes/s, and in images/s (the store's
  images over that time);
- fetch: every shard downloaded through the link by an empty cache's fetch ahead, nothing else
  running (gpufeed's own download, without a training loop beside it; % of link);
- synthetic: the model on one fixed batch, --steps steps (the model's ceiling);
- local: the same store on the local disk, one epoch after one to warm up;
- cold: `Loader("s3://...")` with an empty cache, its first epoch (of the link's ceiling);
- --fetch-process: "cold, downloads in a process" (`Tuning(fetch_process=True)`: store.fetch_process;
  the shards downloaded there, the others in this process before it was ready), then "cold, again"
  as the cold row, to compare them in one call;
- --tuning KEY=VALUE,...: "cold, KEY=VALUE,..." (a cold epoch with those `Tuning` settings), then
  "cold, again (the defaults)", to compare them in one call;
- warm: the same Loader's next epoch, every shard in its cache;
- quarter: a new Loader with `cache_limit` a quarter of the store, --epochs epochs (each of the link's
  ceiling: a cache that small downloads about the whole store every epoch);
- --ranks N (N > 1): N processes, each a rank (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE set as torchrun
  does; the rank's own GPU where there are N, else they share), all reading `s3://...` through one
  `cache_dir`, a cold epoch and a warm one: the node's images/s (all ranks' images over the slowest
  rank's time, of the link) and the bytes downloaded by all of them (each shard once a node: the
  store's size cold, nothing warm);
- --compare streaming,litdata (default: those installed): the same photos written by MosaicML
  streaming and LitData (others.py: shards of --shard-size, uploaded to the bucket), read through
  the same link by each library's dataset and data loader (one worker a core, PIL decode and
  torchvision's crop and flip on the CPU, as neither decodes on the GPU): a cold epoch, a warm one,
  and --epochs through a cache of the quarter rows' limit. Each library runs in a process of its
  own: one that fails leaves a "NAME: failed" row and the others' rows (the server is started
  again if it died).

With --out, the JSON holds every row measured so far (`"partial": true`) until the run ends.

Each epoch's row also says how long a thread of the benchmark's process waited for the GIL meanwhile
(`gil_lateness`, waits.py's `Lateness`: the fetch ahead's downloads run on such threads), and how
busy the host's cores were (`host_cpu_busy`: the link's relay and the server share them with the
loader's workers, where a real network card would not), and the garbage collector's collections
(`gc`, waits.py's `GcWatch`: a full one of a process this size holds the GIL for a quarter second or
more, and every thread, the downloads' too, waits it out). Each
gpufeed row's JSON also says where its epoch spent the link (`downloads`, from the cache's
records of each shard it downloaded): the shards that came, those downloaded on demand (a batch
asked before the fetch ahead did), the seconds with a download under way, and when the last one
ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common
import waits

SMOKE = dict(n=16, image="48x32", data="smooth", size=32, batch=8, device="cpu", shard_size="8KB", link="200mbit",
             latency="1ms", epochs=1, steps=2, workdir=None, compare="")
KEY, SECRET = "AKIAGPUFEEDBENCH", "gpufeed-bench-secret"
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
PLAIN = {"server": "plain parallel download", "link": "plain parallel download",
         "fetch": "gpufeed's fetch ahead alone"}  # the rows of downloads alone


def parser():
    p = common.parser(__doc__)
    p.add_argument("--n", type=int, default=10000, help="generated images (made once per --workdir)")
    p.add_argument("--image", default="500x375", help="--data smooth: the images' WIDTHxHEIGHT (q90 JPEGs)")
    p.add_argument("--data", default="photos", choices=("photos", "smooth"),
                   help="photos: photo-like JPEGs of ImageNet's spread of sizes and qualities (photos.py); "
                        "smooth: generated --image-sized q90 ones")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop's side")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gpufeed-remote-bench"))
    p.add_argument("--shard-size", default="16MB", help="16MB: a quarter of 10,000 photos (600 MB) holds 9 shards")
    p.add_argument("--link", default="2gbit", help="the link's bandwidth: a number and bit, kbit, mbit or gbit")
    p.add_argument("--latency", default="20ms", help="one way, in ms (or s)")
    p.add_argument("--link-threads", type=int, default=16, help="threads of the plain parallel download")
    p.add_argument("--servers", type=int, default=1,
                   help="S3 servers, each a process with a copy of the bucket and a relay, all on one link "
                        "(one moto server sends 200-300 MB/s: 10gbit needs 4 or more)")
    p.add_argument("--epochs", type=int, default=2, help="epochs through the quarter-size cache")
    p.add_argument("--steps", type=int, default=60, help="synthetic row's steps")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ranks", type=int, default=1, help="also N ranks through one cache_dir (rows 'N ranks, ...')")
    p.add_argument("--compare", default=None, help="other libraries' rows, comma-separated: streaming, litdata "
                   "(default: those installed; '' for none)")
    p.add_argument("--fetch-process", action="store_true",
                   help="also a cold epoch with the downloads in a process of their own (Tuning.fetch_process), "
                        "then the plain cold epoch again")
    p.add_argument("--tuning", default="", help="KEY=VALUE,...: also a cold epoch with these `Tuning` settings "
                   "(e.g. lead_lands_first=True), then the plain cold epoch again")
    p.add_argument("--compare-timeout", type=float, default=900,
                   help="seconds a --compare library's process may run before it is killed (a hung download)")
    return p


def bits(text: str) -> float:
    """'2gbit' -> 2e9 (bits per second)."""
    t = text.strip().lower()
    unit = next((u for u in sorted(UNITS, key=len, reverse=True) if t.endswith(u)), None)
    if unit is None:
        raise SystemExit(f"--link {text!r}: a number and bit, kbit, mbit or gbit (e.g. 2gbit)")
    return float(t[: -len(unit)]) * UNITS[unit]


def seconds(text: str) -> float:
    t = text.strip().lower()
    return float(t[:-2]) / 1e3 if t.endswith("ms") else float(t.rstrip("s"))


class Pace:
    """One link's pace, shared by the relays of every server process (`Served`): when the link is free
    next (CLOCK_MONOTONIC, one clock for the machine's processes), 8 bytes of the file `path`, taken
    under a lock of the file (processes) and a thread lock (a process's relay threads: a file lock is
    the open file's, which they share)."""

    def __init__(self, path: str, rate: float):
        self.rate = rate
        self._fd = os.open(path, os.O_RDWR)
        self._next = mmap.mmap(self._fd, 8)
        self._threads = threading.Lock()

    def until(self, nbytes: int) -> float:
        """When `nbytes` more will have gone: the link taken for them from when it is free."""
        with self._threads:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                end = max(time.monotonic(), struct.unpack("d", self._next[:8])[0]) + nbytes / self.rate
                self._next[:8] = struct.pack("d", end)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return end


class Link:
    """A TCP relay on 127.0.0.1 in front of `upstream`: each chunk held `latency` seconds (one way), and
    what the upstream sends paced by `pace`, one for every connection of every relay. Daemon threads,
    two a direction a connection: enough for a benchmark's few dozen connections."""

    def __init__(self, upstream: tuple[str, int], pace: Pace, latency: float, port: int = 0):
        """`port` 0: a free port; else one another `Link` listens on too (SO_REUSEPORT: the kernel
        hands each new connection to one of them, `Served`'s servers)."""
        self.upstream, self.pace, self.latency = upstream, pace, latency
        self._server = socket.create_server(("127.0.0.1", port), reuse_port=True)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="link-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            for src, dst, paced in ((client, upstream, False), (upstream, client, True)):
                chunks: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(src, chunks), daemon=True).start()
                threading.Thread(target=self._write, args=(dst, chunks, paced), daemon=True).start()

    def _read(self, src: socket.socket, chunks: queue.Queue) -> None:
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            chunks.put((time.monotonic() + self.latency, data))
            if not data:
                return

    def _write(self, dst: socket.socket, chunks: queue.Queue, paced: bool) -> None:
        while True:
            due, data = chunks.get()
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            if paced:  # the link is busy until the bytes before these have gone
                due = max(due, self.pace.until(len(data)))
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._server.close()


def options(endpoint: str) -> dict:
    return {"client_kwargs": {"endpoint_url": endpoint}, "key": KEY, "secret": SECRET}


def store_files(fs, root: str) -> list[tuple[str, int]]:
    """Every file of the store in the bucket with its size."""
    return [(path, int(info["size"])) for path, info in fs.find(root, detail=True).items()]


def plain_download(filesystems: list, files: list[tuple[str, int]], threads: int) -> tuple[float, int]:
    """(seconds, bytes) to read every file once on `threads` threads, through `filesystems` in turn
    (the servers' own: all of them at once)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(len(b) for b in pool.map(lambda k: filesystems[k % len(filesystems)].cat_file(files[k][0]),
                                           range(len(files))))
    return time.perf_counter() - t0, got


def fetch_alone(work: Path, storage_options: dict, n: int) -> dict:
    """The "fetch" row: every shard downloaded by an empty cache's fetch ahead (`ReadAhead.follow`, in
    shard order, no limit) with nothing else running: gpufeed's own download against the plain
    one, without a training loop beside it."""
    import gpufeed
    from gpufeed.store.readahead import ReadAhead, Want

    with tempfile.TemporaryDirectory(dir=work) as cache:
        store = gpufeed.open("s3://bench/train", cache_dir=cache, storage_options=storage_options)
        shards = range(len(store.manifest.shards))
        t0 = time.perf_counter()
        ahead = ReadAhead(store.cache)
        ahead.follow([Want(k, 0, 1, k) for k in shards])
        for k in shards:
            store.cache.ensure(k)  # (waits for the fetch ahead's download)
        took = time.perf_counter() - t0
        got = store.cache.downloaded
        ahead.close()
        store.close()
    return {"bytes": got, "seconds": took, "bytes_per_s": got / took, "img_per_s": n / took}


def epochs(loader, step, count: int, device: str, together=None) -> list[dict]:
    """Each of `count` epochs of `loader` trained on: images, seconds from its first batch asked for, and
    how long that first batch took (a cold epoch's waits for its first shards); when it began and
    ended on the wall clock (`began_at`, `ended_at`: the ranks of `rank_rows` are timed as a node).
    `together(k)`: called before epoch k begins (the ranks' barrier)."""
    from gpufeed.bench.common import sync

    cache = getattr(getattr(loader, "store", None), "cache", None)  # gpufeed's (others.py's rows: none)
    records: list = []  # the cache's downloads, as it tells of each (`ShardCache.on_download`)
    if hasattr(cache, "on_download"):
        cache.on_download = records.append

    def downloaded() -> int:
        return getattr(cache, "downloaded", 0)

    out = []
    for k in range(count):
        if together is not None:
            together(k)
        fetched = downloaded()
        began, began_at = time.monotonic(), time.time()
        lateness, cpu, collections = waits.Lateness(), waits.host_cpu(), waits.GcWatch()
        t0 = time.perf_counter()
        images, first = 0, None
        for x, y in loader:
            if first is None:
                first = time.perf_counter() - t0
            step(x, y)
            images += len(y)
        sync(device)
        after = downloaded()
        row = {"images": images, "seconds": time.perf_counter() - t0, "first_batch_s": first,
               "began_at": began_at, "ended_at": time.time(), "gil_lateness": lateness.stop()}
        collections.stop()
        row["gc"] = collections.summary()  # a collection holds the GIL: every thread waits it out
        busy, ticks = (b - a for a, b in zip(cpu, waits.host_cpu()))
        row["host_cpu_busy"] = round(busy / ticks, 3) if ticks > 0 else None
        if hasattr(loader, "cached"):  # another library's: the bytes its cache folder holds now
            row["cached"] = loader.cached()
        else:
            row["downloaded"] = after - fetched
        if hasattr(cache, "on_download"):  # (a tree before the hook: none)
            row["downloads"] = timeline(list(records), began, time.monotonic())
        if not out and hasattr(loader, "stats"):  # gpufeed's first pass: seconds from its constructor's call
            row["loader_start"] = loader.stats()["start"]  # (its plan's wait: first_plan_s - first_pass_s)
        out.append(row)
    return out


def timeline(downloads, began: float, ended: float) -> dict:
    """Where an epoch (`began` to `ended`, monotonic) spent its link, from the cache's `Download`s that
    ended in it: how many shards came, and how many of them on demand (a batch asked for it before
    the fetch ahead did; a batch may also wait for one the fetch ahead is downloading); the seconds
    with at least one download under way (the link idle otherwise); when the last one ended, from
    the epoch's start; when the first began; and each shard's (number, began, ended), from the epoch's
    start, in the order they began (which the first batches waited for, and whether the link was
    kept full at the epoch's start and end)."""
    mine = [d for d in downloads if began <= d.ended <= ended]
    busy, start, end = 0.0, began, began  # the union of the downloads' spans within the epoch
    for a, b in sorted((max(d.began, began), d.ended) for d in mine):
        if a > end:
            busy, start = busy + end - start, a
        end = max(end, b)
    busy += end - start
    return {"shards": len(mine), "on_demand": sum(not d.ahead for d in mine), "busy_s": busy,
            "last_ended_s": max((d.ended for d in mine), default=began) - began,
            "first_began_s": round(min((d.began for d in mine), default=began) - began, 3),
            "each": [[d.shard, round(d.began - began, 3), round(d.ended - began, 3)]
                     for d in sorted(mine, key=lambda d: d.began)]}


def compare(a, work: Path, served: Served, limit: int, runs: dict) -> None:
    """The --compare rows (others.py) into `runs`: per library a cold and a warm epoch, then --epochs
    through a cache of `limit` bytes, each library in a process of its own (`other_rows`), its rows
    recorded as they come: a library that raises, or kills its process, costs its own rows only
    (said in a "NAME: failed" row with the end of its error), and a server that died with it is
    started again for the next (a LitData row that failed ended the whole benchmark, and no row of
    that call was written)."""
    import others

    names = others.available() if a.compare is None else [n for n in a.compare.split(",") if n]
    unknown = sorted(set(names) - set(others.LIBRARIES))
    if unknown:
        raise SystemExit(f"--compare {','.join(unknown)}: not one of {', '.join(others.LIBRARIES)}")
    for name in names:
        if not served.alive():
            served.restart()
        spec = {"name": name, "work": str(work), "directs": served.directs, "link": served.link, "limit": limit,
                "batch": a.batch, "size": a.size, "device": a.device, "model": a.model, "epochs": a.epochs,
                "shard_size": a.shard_size}
        code, said, timed_out = rows_of([sys.executable, __file__, "--other", json.dumps(spec)], a.compare_timeout,
                                        lambda row, figures, name=name: runs.__setitem__(f"{name}: {row}", figures))
        if code != 0:
            killed = f"killed after --compare-timeout {a.compare_timeout:g} s\n" if timed_out else ""
            runs[f"{name}: failed"] = {"exit": code, "error": (said + killed)[-1500:]}


def rows_of(argv: list[str], timeout: float, row) -> tuple[int, str, bool]:
    """Run `argv` (a library's rows, `other_rows`) in a session of its own, calling `row(name, figures)`
    for each row it prints as it comes: (its exit code, its error output, whether it ran past `timeout`
    seconds and was killed, its session with it: its DataLoader workers hold its pipes too, and a hung
    one would keep this waiting). What is left of its session when it ends is killed."""
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    said: list[str] = []  # its error output (read on a thread: a full pipe stalls it)
    reader = threading.Thread(target=said.extend, args=(child.stderr,), daemon=True)
    reader.start()
    timed_out = threading.Event()

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)

    def time_out() -> None:
        timed_out.set()
        kill()

    hung = threading.Timer(timeout, time_out)  # its rows so far stay; its output ends with it
    hung.daemon = True
    hung.start()
    ended = False
    try:
        for line in child.stdout:  # type: ignore[union-attr]
            if line.startswith(OTHER_ROW):
                row(*json.loads(line[len(OTHER_ROW):]))
        ended = True
    finally:
        hung.cancel()
        try:
            child.wait(timeout=120 if ended else 0)
        except subprocess.TimeoutExpired:  # this loop failed, or its output ended and it did not
            kill()
        code = child.wait()
        kill()  # what is left of its session (workers it did not stop)
    reader.join(10)
    return code, "".join(said), timed_out.is_set()


OTHER_ROW = "other-row "  # how `other_rows` prints a row to its parent
RANK_ROWS = "rank-rows "  # how `one_rank` prints its epochs to its parent
RANK_READY = "rank-ready "  # and says it is ready to begin epoch k (`rank_rows`' barrier)
RANK_WAIT = 1800  # seconds a rank may say nothing before it is taken for hung


def rank_rows(a, work: Path, served: Served, shard_bytes: int, runs: dict) -> None:
    """The --ranks rows: `a.ranks` processes (`one_rank`), each a rank of the same job on this machine,
    read the bucket through one cache folder for a cold and a warm epoch, each epoch begun by all of
    them at once (a barrier: each says it is ready, then all are told to go, as a training job's ranks
    meet at every step); per epoch the node's rate (every rank's images over the time from the first
    rank's start to the last one's end) and the bytes all of them downloaded, which a cache shared by
    the node keeps at one download a shard (`shard_bytes`, every shard's, cold; none warm). Without
    the barrier a rank that started later read shards the earlier one fetched for its next epoch,
    and the node's cold epoch seemed to beat the link (114 %)."""
    with tempfile.TemporaryDirectory(dir=work) as cache:
        spec = {"cache": cache, "link": served.link, "batch": a.batch, "size": a.size, "device": a.device,
                "model": a.model, "world": a.ranks}
        children, lines, said = [], [], []
        for rank in range(a.ranks):
            env = os.environ | {"RANK": str(rank), "WORLD_SIZE": str(a.ranks), "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": str(a.ranks)}
            child = subprocess.Popen([sys.executable, __file__, "--rank", json.dumps(spec)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out: queue.Queue = queue.Queue()
            err: list[str] = []
            threading.Thread(target=_lines, args=(child.stdout, out), daemon=True).start()
            threading.Thread(target=err.extend, args=(child.stderr,), daemon=True).start()
            children.append(child)
            lines.append(out)
            said.append(err)
        results: list = [None] * a.ranks
        failed: list[str] = []
        for k in range(2):  # each epoch begun together
            for rank, out in enumerate(lines):
                if _until(out, f"{RANK_READY}{k}") is None:
                    failed.append(f"rank {rank}: ended (or said nothing for {RANK_WAIT} s) before epoch {k}")
            if failed:
                break
            for rank, child in enumerate(children):
                try:
                    child.stdin.write("go\n")  # type: ignore[union-attr]
                    child.stdin.flush()  # type: ignore[union-attr]
                except OSError:  # it died waiting (the OOM killer's choice, say): its row says so below
                    failed.append(f"rank {rank}: gone before epoch {k} began")
            if failed:
                break
        for rank, out in enumerate(lines):
            if not failed:
                line = _until(out, RANK_ROWS)
                results[rank] = None if line is None else json.loads(line[len(RANK_ROWS) :])
                if line is None:
                    failed.append(f"rank {rank}: no rows")
        for rank, child in enumerate(children):  # a failed job stops every rank (each waits for the others)
            if failed:
                child.kill()
            with contextlib.suppress(OSError):
                child.stdin.close()  # type: ignore[union-attr]
            try:
                child.wait(timeout=RANK_WAIT)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                failed.append(f"rank {rank}: did not end after its rows")
            if child.returncode and child.returncode != -9:
                failed.append(f"rank {rank}: exit {child.returncode}: {''.join(said[rank]).strip()[-1000:]}")
    if failed:
        runs[f"{a.ranks} ranks: failed"] = {"exit": 1, "error": "\n".join(failed)}
        return
    for k, name in enumerate(("cold", "warm")):
        each = [r[k] for r in results]
        runs[f"{a.ranks} ranks, one cache folder: {name}"] = {
            "images": sum(e["images"] for e in each),
            "seconds": max(e["ended_at"] for e in each) - min(e["began_at"] for e in each),
            "first_batch_s": max(e["first_batch_s"] for e in each),
            "downloaded": sum(e["downloaded"] for e in each), "shard_bytes": shard_bytes, "ranks": each}


def _lines(stream, out: queue.Queue) -> None:
    """Each line of a rank's output into `out`, then None at its end (read on a thread of its own)."""
    for line in stream:
        out.put(line)
    out.put(None)


def _until(out: queue.Queue, prefix: str) -> str | None:
    """The next line from a rank's output queue that starts with `prefix` (others skipped), or None
    where the rank's output ended first, or it said nothing for `RANK_WAIT` seconds (hung)."""
    while True:
        try:
            line = out.get(timeout=RANK_WAIT)
        except queue.Empty:
            return None
        if line is None:
            return None
        if line.startswith(prefix):
            return line.strip()


def one_rank(spec: dict) -> None:
    """The child process of `rank_rows`: this rank's Loader on the bucket through the shared cache
    folder, a cold epoch and a warm one trained on, printed to the parent (`RANK_ROWS`)."""
    import torch
    from feeds import ops

    import gpufeed
    from gpufeed.bench.training import training_step

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    device = spec["device"]
    if device.startswith("cuda") and torch.cuda.device_count() >= spec["world"]:
        device = f"cuda:{os.environ['LOCAL_RANK']}"  # a GPU a rank, as torchrun's ranks have
    step = training_step(spec["model"], device, 1000)
    loader = gpufeed.Loader("s3://bench/train", cache_dir=spec["cache"], storage_options=options(spec["link"]),
                            batch_size=spec["batch"], device=device, augment=ops(size=spec["size"]))
    def together(k: int) -> None:  # the parent's barrier: ready, then wait for its word
        print(f"{RANK_READY}{k}", flush=True)
        sys.stdin.readline()

    print(RANK_ROWS + json.dumps(epochs(loader, step, 2, device, together), default=str), flush=True)


def other_rows(spec: dict) -> None:
    """The child process of `compare`: library `spec["name"]`'s photos written in its format, uploaded
    to the bucket, then its rows, each printed to the parent as it is measured (`OTHER_ROW`)."""
    import others
    import s3fs

    from gpufeed.bench.training import training_step
    from gpufeed.store.locations import parse_size

    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")  # moto's region: a bucket made without a location
    name, work = spec["name"], Path(spec["work"])
    local = others.write(name, work / "images", work / name, parse_size(spec["shard_size"], "--shard-size"))
    fs = s3fs.S3FileSystem(**options(spec["directs"][0]))
    if not fs.exists("bench"):  # (a server started again: empty)
        fs.mkdir("bench")
    fs.put(str(local), f"bench/{name}", recursive=True)
    replicate(spec["directs"], f"bench/{name}")
    step = training_step(spec["model"], spec["device"], 1000)
    cores = len(os.sched_getaffinity(0))
    quarter = [f"quarter cache, epoch {k}" for k in range(spec["epochs"])]
    for cache_limit, rows in ((None, ["cold", "warm"]), (spec["limit"], quarter)):
        workers = others.workers_for(name, cores, cache_limit, parse_size(spec["shard_size"], "--shard-size"))
        # a failed row's own error is reported, not the cleanup's (LitData's download threads were still
        # writing into the folder when its quarter-cache row failed: "Directory not empty")
        with tempfile.TemporaryDirectory(dir=work, ignore_cleanup_errors=True) as cache:
            other = others.Other(name, f"s3://bench/{name}", Path(cache), spec["link"], (KEY, SECRET), spec["batch"],
                                 spec["size"], spec["device"], workers, cache_limit)
            for row, e in zip(rows, epochs(other, step, len(rows), spec["device"]), strict=True):
                print(OTHER_ROW + json.dumps([row, e | {"workers": workers}], default=str), flush=True)
            del other  # its loader's workers end before its cache folder goes


def serve(rate: float, latency: float, port: int, pace: str) -> None:
    """The child process: moto's server and the link in front of it (on `port`, 0: a free one; paced by
    the file `pace`, `Pace`), their URLs on stdout as one JSON line; it ends when its parent closes its
    stdin (or ends)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port_ = server.get_host_and_port()
    link = Link((host, port_), Pace(pace, rate), latency, port)
    print(json.dumps({"direct": f"http://{host}:{port_}", "link": link.url}), flush=True)
    sys.stdin.read()
    link.close()
    server.stop()


class Served:
    """`count` `serve` processes, each a moto server with a copy of the bucket (`replicate`) and a relay
    in front of it, the relays on one port (`link`: the kernel gives each connection to one of them)
    and one pace (`Pace`: one link, whichever relay a connection went to); `direct`: the first
    server's URL, `directs`: all of them; `close()` ends them. One moto server, a Python process,
    sends 200-300 MB/s on a GPU host, below a 10 Gbit/s link."""

    def __init__(self, rate: float, latency: float, count: int = 1):
        self.rate, self.latency, self.count = rate, latency, count
        self._procs: list[subprocess.Popen] = []
        self.directs: list[str] = []
        handle, self._pace = tempfile.mkstemp(prefix="remote-bench-pace-")
        os.write(handle, struct.pack("d", 0.0))
        os.close(handle)
        port = 0
        for _ in range(count):
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", str(rate), str(latency), str(port), self._pace],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            self._procs.append(proc)
            line = proc.stdout.readline()  # type: ignore[union-attr]
            try:
                urls = json.loads(line)
                self.directs.append(urls["direct"])
                self.link = urls["link"]
            except (ValueError, KeyError, TypeError):
                self.close()
                raise SystemExit(f"remote_bench: an S3 server's process did not start ({line!r})") from None
            port = int(self.link.rsplit(":", 1)[1])
        self.direct = self.directs[0]

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in self._procs)

    def restart(self) -> None:
        """New servers and links (empty: the old ones' buckets went with them), at new URLs."""
        self.close()
        self.__init__(self.rate, self.latency, self.count)  # type: ignore[misc]

    def close(self) -> None:
        for proc in self._procs:
            proc.stdin.close()  # type: ignore[union-attr]
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self._pace)


def replicate(directs: list[str], prefix: str) -> None:
    """Every object under `prefix` of the first server's bucket, written to the others' (`Served`:
    each link relays to its own server, so each must hold the whole bucket)."""
    import s3fs

    if len(directs) < 2:
        return
    source = s3fs.S3FileSystem(**options(directs[0]), skip_instance_cache=True)
    targets = [s3fs.S3FileSystem(**options(url), skip_instance_cache=True) for url in directs[1:]]
    bucket = prefix.split("/")[0]
    for target in targets:
        if not target.exists(bucket):
            target.mkdir(bucket)

    def copy(path: str) -> None:  # read once, written to every other server
        data = source.cat_file(path)
        for target in targets:
            target.pipe_file(path, data)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(copy, source.find(prefix)))


def main(argv: list[str] | None = None) -> dict:
    a = common.parse(parser(), argv, SMOKE)
    try:
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"remote_bench needs moto[server] and s3fs ({e}): pip install 'moto[server]' s3fs") from None
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")  # moto's region: a bucket made without a location
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    with common.workdir(a.workdir, "gpufeed-remote-bench-") as work:
        return _measure(a, Path(work))


def _measure(a, work: Path) -> dict:
    import s3fs
    import torch
    from feeds import described, make_images, ops

    import gpufeed
    from gpufeed.bench.common import sync
    from gpufeed.bench.training import training_step
    from gpufeed.loader.inputs.remote import smallest_cache

    width, height = (int(v) for v in a.image.split("x"))
    make_images(work, a.n, (width, height), a.data)
    if not (work / "local").exists():
        gpufeed.pack(work / "images", work / "local", mode="jpeg", reencode=False, progress=False)
    served = Served(bits(a.link) / 8, seconds(a.latency), a.servers)
    direct = served.direct
    runs: dict = common.Rows(a.out, __file__)
    try:
        fs = s3fs.S3FileSystem(**options(direct))
        fs.mkdir("bench")
        gpufeed.pack(work / "images", "s3://bench/train", mode="jpeg", reencode=False, progress=False,
                     shard_size=a.shard_size, storage_options=options(direct))
        replicate(served.directs, "bench/train")
        files = store_files(fs, "bench/train")
        total = sum(size for _, size in files)
        n = len(gpufeed.open(work / "local"))
        took, got = plain_download([s3fs.S3FileSystem(**options(url), skip_instance_cache=True)
                                    for url in served.directs], files, a.link_threads)
        runs["server"] = {"bytes": got, "seconds": took, "bytes_per_s": got / took, "img_per_s": n / took}
        through = s3fs.S3FileSystem(**options(served.link), skip_instance_cache=True)
        took, got = plain_download([through], files, a.link_threads)
        runs["link"] = {"bytes": got, "seconds": took, "bytes_per_s": got / took, "img_per_s": n / took,
                        "files": len(files), "threads": a.link_threads}
        ceiling = runs["link"]["img_per_s"]
        runs["fetch"] = fetch_alone(work, options(served.link), n)
        step = training_step(a.model, a.device, 1000)
        kw = dict(batch_size=a.batch, device=a.device, augment=ops(size=a.size))
        images = torch.randn(a.batch, 3, a.size, a.size, device=a.device).half()
        labels = torch.randint(0, 1000, (a.batch,), device=a.device)
        for _ in range(3):
            step(images, labels)
        sync(a.device)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(images, labels)
        sync(a.device)
        runs["synthetic"] = {"img_per_s": a.steps * a.batch / (time.perf_counter() - t0)}
        local = gpufeed.Loader(work / "local", **kw)
        runs["local"] = epochs(local, step, 2, a.device)[1]
        local.close()
        with tempfile.TemporaryDirectory(dir=work) as cache:
            remote = gpufeed.Loader("s3://bench/train", cache_dir=cache, storage_options=options(served.link), **kw)
            runs["cold"], runs["warm"] = epochs(remote, step, 2, a.device)
            remote.close()
        # the same cold epoch with other settings, then again without them, each a new Loader
        cold: list = []
        if a.fetch_process:  # the downloads in a process, then in this one
            from gpufeed.decode.tuning import Tuning

            cold += [("cold, downloads in a process", Tuning(fetch_process=True)),
                     ("cold, again (downloads here)", Tuning(fetch_process=False))]
        if a.tuning:  # --tuning's settings, then the defaults
            from feeds import settings, tuning

            cold += [(f"cold, {a.tuning}", tuning(settings(":" + a.tuning))), ("cold, again (the defaults)", None)]
        for name, chosen in cold:
            with tempfile.TemporaryDirectory(dir=work) as cache:
                remote = gpufeed.Loader("s3://bench/train", cache_dir=cache, storage_options=options(served.link),
                                        tuning=chosen, **kw)
                runs[name] = epochs(remote, step, 1, a.device)[0]
                elsewhere = remote.store.cache.elsewhere
                runs[name]["shards_downloaded_in_the_process"] = 0 if elsewhere is None else elsewhere.asked
                remote.close()
        # a quarter of the store, or what a Loader of these batches needs at least (a small store's quarter)
        peek = gpufeed.open("s3://bench/train", storage_options=options(direct), cache_dir=work / "peek")
        limit = max(total // 4, smallest_cache(peek, a.batch))
        runs["quarter cache"] = {"cache_limit": limit, "shards": len(peek.manifest.shards)}
        with tempfile.TemporaryDirectory(dir=work) as cache:
            small = gpufeed.Loader("s3://bench/train", cache_dir=cache, cache_limit=limit,
                                   storage_options=options(served.link), **kw)
            for k, e in enumerate(epochs(small, step, a.epochs, a.device)):
                runs[f"quarter cache, epoch {k}"] = e
            small.close()
        if a.ranks > 1:
            rank_rows(a, work, served, sum(int(shard["bytes"]) for shard in peek.manifest.shards), runs)
        compare(a, work, served, limit, runs)
    finally:
        served.close()
    limit = runs.pop("quarter cache")
    for name, r in runs.items():
        if "seconds" in r and name not in PLAIN:
            r["img_per_s"] = r["images"] / r["seconds"]
            r["of_link"] = r["img_per_s"] / ceiling
    top = runs["synthetic"]["img_per_s"]
    lines = [[f"{name}: {what}", f"{runs[name]['img_per_s']:,.0f}", f"{runs[name]['bytes_per_s'] / 1e6:,.0f} MB/s",
              "", "" if name != "fetch" else f"{100 * runs[name]['img_per_s'] / ceiling:.1f}", "", "", ""]
             for name, what in PLAIN.items()]
    for name, r in runs.items():
        if name in PLAIN:
            continue
        if "error" in r:  # a library's process that failed: its last line
            last = (r["error"].strip().splitlines() or [""])[-1][:80]
            lines.append([name, "-", "", "", "", "", f"exit {r['exit']}: {last}", ""])
            continue
        got = "" if "downloaded" not in r else f"{r['downloaded'] / 1e6:,.1f} MB"
        d = r.get("downloads")
        link = "" if not d else (f"{d.get('first_began_s', 0):.2f} / {d['busy_s']:.2f} / {d['last_ended_s']:.2f} s; "
                                 f"{d['on_demand']} of {d['shards']}")
        g = r.get("gil_lateness") or {}
        gil = "" if not g else f"{g['p50_ms']:.1f} / {g['p99_ms']:.1f} ms; {100 * g['late_share']:.0f} %"
        if r.get("host_cpu_busy") is not None:
            gil += f"; {100 * r['host_cpu_busy']:.0f} %"
        full = (r.get("gc") or {}).get("gen2")
        if full:
            gil += f"; gen-2 GC {full['count']} x, longest {full['max_ms']:.0f} ms"
        lines.append([name, f"{r['img_per_s']:,.0f}", got,
                      f"{100 * r['img_per_s'] / top:.1f}", "" if "of_link" not in r else f"{100 * r['of_link']:.1f}",
                      "" if r.get("first_batch_s") is None else f"{r['first_batch_s']:.2f}", link, gil])
    table = common.table(["row", "img/s", "downloaded", "% of synthetic", "% of link", "first batch s",
                          "first began / downloading / last in; shards on demand",
                          "GIL wait p50 / p99; time in waits > 5 ms; host CPU busy; full collections"], lines)
    table += (f"\n\nlink {a.link}, latency {a.latency} one way, {a.servers} server(s); store {total / 1e6:,.1f} MB in {limit['shards']} "
              f"shards, {n} images; the small cache {limit['cache_limit'] / 1e6:,.1f} MB; batch {a.batch}, {a.model}")
    return common.write(a, __file__, runs, table, a.device, cache=limit, data=described(work))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1:2] == ["--other"]:
        other_rows(json.loads(sys.argv[2]))
    elif sys.argv[1:2] == ["--rank"]:
        one_rank(json.loads(sys.argv[2]))
    else:
        main()
