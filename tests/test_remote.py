"""Stores in a bucket, against a real S3 API server on 127.0.0.1 (moto's server mode, started here),
talked to over HTTP through fsspec and s3fs: pack into it, load through a bounded cache, every sample
once per epoch on any number of ranks, damaged shards and flaky servers, resume at another world size."""

from __future__ import annotations

import http.server
import logging
import shutil
import socketserver
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import gpufeed
from conftest import save, small_sharded_store, smooth
import gpufeed.store.fetch as fetch_module
import gpufeed.store.remote as remote_module
from gpufeed.loader.bytes import ShardBytes
from gpufeed.loader.inputs.remote import smallest_cache
from gpufeed.store.readahead import ReadAhead, Want
from gpufeed.augment import Normalize, RandomResizedCrop
from gpufeed.store import StoreError
from gpufeed.store.format import Manifest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

KEY, SECRET = "AKIAGPUFEEDTEST", "supersecret-do-not-log"
OPS = [RandomResizedCrop(24), Normalize()]


@pytest.fixture(scope="module")
def server():
    patch = pytest.MonkeyPatch()
    patch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # the server's region: a bucket is made without a location
    s = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s.start()
    host, port = s.get_host_and_port()
    yield f"http://{host}:{port}"
    s.stop()
    patch.undo()


def _options(endpoint: str) -> dict:
    return {"client_kwargs": {"endpoint_url": endpoint}, "key": KEY, "secret": SECRET}


@pytest.fixture(scope="module")
def bucket(server, tmp_path_factory):
    """A bucket holding a sharded jpeg store of 40 images (5 shards), and the same store packed locally."""
    import s3fs

    root = tmp_path_factory.mktemp("remote")
    for i in range(40):
        save(root / "src" / f"c{i % 3}" / f"{i:03d}.jpg", smooth(i, 30 + i % 7, 40), quality=90)
    fs = s3fs.S3FileSystem(**_options(server))
    if not fs.exists("bucket"):  # moto keeps one state per process: another test module may have made it
        fs.mkdir("bucket")
    gpufeed.pack(root / "src", "s3://bucket/train", mode="jpeg", workers=1, progress=False, shard_size="3KB",
                 storage_options=_options(server), overwrite=True)  # (another module may have packed it)
    gpufeed.pack(root / "src", root / "flat", mode="jpeg", workers=1, progress=False)
    return {"fs": fs, "options": _options(server), "flat": root / "flat", "src": root / "src", "root": root}


def _loader(bucket, tmp_path, **kw):
    kw = {"batch_size": 4, "device": "cpu", "augment": OPS, "seed": 1, "num_workers": 1,
          "cache_dir": tmp_path / "cache", "storage_options": bucket["options"], **kw}
    return gpufeed.Loader("s3://bucket/train", **kw)


def test_a_store_packed_into_a_bucket_loads_the_batches_of_the_same_store_on_disk(bucket, tmp_path):
    shards = bucket["fs"].ls("bucket/train/shards")
    assert len(shards) >= 4 and bucket["fs"].exists("bucket/train/manifest.json")
    remote = _loader(bucket, tmp_path, shuffle_window=len(shards))  # a full shuffle from the first epoch
    local = gpufeed.Loader(bucket["flat"], batch_size=4, device="cpu", augment=OPS, seed=1, num_workers=1)
    got = [(x, y) for x, y in remote]
    want = [(x, y) for x, y in local]
    assert len(got) == len(want) == 10
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want, strict=True))
    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "cache", storage_options=bucket["options"])
    assert len(store) == 40 and store.source(3) == gpufeed.open(bucket["flat"]).source(3)
    # a restarted job finds the verified shards in its cache: nothing is downloaded again
    again = _loader(bucket, tmp_path)
    assert len(list(again)) == 10 and again.store.cache.fetched == 0


def test_the_first_epoch_from_a_bucket_trains_while_its_shards_arrive(bucket, tmp_path):
    """Without a cache limit the first epoch is shard-aware (its first batches read a few of the shards,
    not nearly all as under a full shuffle, so training need not wait for the whole store), the later
    ones full shuffles from the cache; every sample once an epoch; on two ranks each takes its half of
    the one-rank order (each half ordered again to start on one shard, `Shards.ramp`)."""
    loader = _loader(bucket, tmp_path, batch_size=8)
    shards = loader.batch_sampler.shards
    count = len(shards.starts) - 1
    assert shards.window is None and shards.first_window == max(1, count // 4)

    def shards_of(epoch: int, batches: int) -> int:
        indices = torch.cat([loader.plan(epoch, b)[0] for b in range(batches)]).numpy()
        return len(set(loader.store.locate(indices)[0].tolist()))

    assert shards_of(0, 1) <= 3 < shards_of(1, 1)
    for epoch in range(2):
        seen = sorted(torch.cat([loader.plan(epoch, b)[0] for b in range(len(loader))]).tolist())
        assert seen == list(range(40)), epoch
    two = [_loader(bucket, tmp_path, batch_size=8, rank=r, world_size=2, drop_last=False) for r in range(2)]
    order = loader.batch_sampler.order(0)
    spans = [torch.cat([t.plan(0, b)[0] for b in range(len(t))]) for t in two]
    assert [sorted(s.tolist()) for s in spans] == [sorted(order[:20].tolist()), sorted(order[20:].tolist())]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_sample_once_an_epoch_through_a_small_cache_on_any_number_of_ranks(bucket, tmp_path, world):
    """Each rank's cache holds nine of the store's shards: the order spreads each shard's samples over
    two shards' places, shards are evicted and fetched again, the cache stays under its limit, and
    every sample comes once an epoch."""
    manifest = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "peek", storage_options=bucket["options"]).manifest
    shards, biggest = len(manifest.shards), max(s["bytes"] for s in manifest.shards)
    assert shards >= 10
    limit = 9 * biggest
    loaders = [_loader(bucket, tmp_path, rank=r, world_size=world, drop_last=False, pad=False, cache_limit=limit,
                       cache_dir=tmp_path / f"cache{r}") for r in range(world)]
    assert loaders[0].batch_sampler.shards.window == 1  # 9, less 2 fetched ahead and 6 the batches in flight read
    for epoch in range(2):
        seen = []
        for loader in loaders:
            for number, _ in enumerate(loader):
                seen += loader.plan(epoch, number)[0].tolist()
                assert loader.store.cache.used() <= limit
        assert sorted(seen) == list(range(40)), epoch
    if world == 1:
        assert loaders[0].store.cache.fetched > shards  # evicted in the first epoch, fetched again in the second


def test_a_download_that_ends_while_room_is_counted_is_counted(bucket, tmp_path, monkeypatch):
    """Room for a shard is counted from the shards present and the downloads reserved; a download that
    ends between the two looks (its shard marked verified, then its reservation removed) is counted
    still: it was counted by neither, and the cache took one shard over its limit (seen in
    test_every_sample_once_an_epoch_through_a_small_cache's first epoch, 1 run in 8 on 2 cores)."""
    import fcntl
    import os

    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    sizes = [s["bytes"] for s in store.manifest.shards]
    cache = remote_module.ShardCache(store.cache.fs, store.cache.root, store.manifest, tmp_path / "c",
                                     sizes[0] + sizes[1] + sizes[2] - 1, store.cache.url)
    cache.ensure(0)
    cache.use(1)  # read by a batch: not evicted
    marker = cache.path(0) / remote_module.VERIFIED
    digest = marker.read_text()
    marker.unlink()  # shard 0's download under way: its files in place, not yet marked, its room reserved,
    fd = os.open(cache._lock_path(0), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # and its lock held by the downloader
    reservation = cache.folder / "reserved" / f"00000.{os.getpid()}.1"
    reservation.write_text(str(sizes[0]))
    counted = cache._reserved

    def download_ends():
        marker.write_text(digest)
        reservation.unlink()
        return counted()

    monkeypatch.setattr(cache, "_reserved", download_ends)
    assert cache._make_room(sizes[2], 2, wait=False) is None  # 0 and 1 fill it: no room for 2
    assert cache.used() == sizes[0] + sizes[1]
    os.close(fd)
    cache.release(1)


def test_a_hold_waits_for_a_download_without_stopping_it(bucket, tmp_path):
    """A batch's hold on a shard that a fetch thread is still finishing waits for it: the download keeps
    the shard's exclusive lock until it has counted its bytes under the cache's own lock, which the
    hold must not keep while it waits (it did: the loader stopped for good)."""
    import fcntl
    import os
    import time

    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    cache = store.cache
    fd = os.open(cache._lock_path(0), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a download of shard 0 under way
    holding = threading.Thread(target=cache.hold, args=(0,), daemon=True)
    holding.start()
    time.sleep(0.2)  # the hold waits for the shard's lock

    def finish_download() -> None:
        with cache._lock:  # the download counts its bytes, then lets go of the shard
            cache.fetched += 1
        os.close(fd)

    finishing = threading.Thread(target=finish_download, daemon=True)
    finishing.start()
    finishing.join(5.0)
    holding.join(5.0)
    assert not finishing.is_alive() and not holding.is_alive()
    assert 0 in cache._in_use
    cache.release(0)


def test_a_range_that_fails_is_asked_for_again_alone(bucket, tmp_path, monkeypatch):
    """One failed range of a group is asked for again by itself, within the same try: the others are
    kept (a server failing every third request made each try of a shard fail whole, 15 s a test)."""
    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    cache, real, asked = store.cache, store.cache.fs.cat_ranges, []

    def cat_ranges(paths, starts, ends, **kw):
        asked.append(list(zip(paths, starts, ends, strict=True)))
        out = real(paths, starts, ends, **kw)
        return [OSError("503"), *out[1:]] if len(asked) == 1 else out

    monkeypatch.setattr(cache.fs, "cat_ranges", cat_ranges)
    monkeypatch.setattr(fetch_module, "BACKOFF", 0.01)
    cache.ensure(0)
    assert cache.present(0) and len(asked[0]) > 1 and asked[1] == asked[0][:1]


def test_a_shard_that_fails_ahead_is_not_fetched_again_until_the_next_pass(bucket, tmp_path, monkeypatch):
    """A fetch ahead that fails (a shard missing or damaged in the bucket) is tried once a pass, and
    said when a batch needs the shard: trying it again whenever another fetch ended downloaded a
    damaged shard over and over."""
    import time

    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    cache, tries = store.cache, []

    def ensure(k: int, wait: bool):
        tries.append(k)
        time.sleep(0.001)
        raise StoreError(f"shard {k}: damaged")

    monkeypatch.setattr(cache, "_ensure", ensure)
    ahead = ReadAhead(cache)
    ahead.follow([Want(k, 0, 1, 1000) for k in (1, 2)])
    time.sleep(0.3)
    assert sorted(tries) == [1, 2]
    ahead.follow([Want(k, 1, 1, 1000) for k in (1, 2)])  # the next pass tries them again
    time.sleep(0.3)
    assert sorted(tries) == [1, 1, 2, 2]
    ahead.close()
    cache.close()


def test_room_is_made_from_what_the_rank_will_not_read_then_from_what_it_reads_last(bucket, tmp_path, monkeypatch):
    """What the rank has read in full is no longer wanted; room is made from shards it will not read
    (least recently used first), then, for a shard a batch needs now, from those it reads last; a
    fetch ahead evicts none the rank reads before the shard it fetches.
    Least recently used alone evicted shards fetched ahead and not yet read (their use was their
    download, before the reads of shards already done), and a batch then waited for them again."""
    import os
    import time

    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    cache, sizes = store.cache, [s["bytes"] for s in store.manifest.shards]
    ahead = ReadAhead(cache)
    monkeypatch.setattr(ahead, "_top_up", lambda: None)  # no fetching ahead: only what the test asks for
    for k in range(6):
        cache.ensure(k)
    now = time.time()
    for k in range(6):  # 2-5 fetched ahead long ago, 0 and 1 read just now
        os.utime(cache.path(k) / remote_module.VERIFIED, (now - 100 + k, now - 100 + k) if k >= 2 else (now, now))
    ahead.follow([Want(k, 0, 2, 1000) for k in (2, 3, 4, 5, 6, 7)])
    ahead.read([2], [1])
    assert [w.shard for w in ahead._wanted] == [2, 3, 4, 5, 6, 7]
    ahead.read([2, 3], [1, 2])  # 2 and 3 read in full
    assert [w.shard for w in ahead._wanted] == [4, 5, 6, 7]
    cache.limit = sum(sizes[:6])  # full
    cache.ensure(6)
    assert not cache.present(2) and all(cache.present(k) for k in (4, 5, 6))  # the oldest unwanted went
    cache.limit = sum(sizes[k] for k in (4, 5, 6)) + max(sizes)
    ahead._fetch_ahead(7)  # ahead: the shards read before 7 stay
    assert all(cache.present(k) for k in (4, 5, 6, 7)) and not any(cache.present(k) for k in (0, 1, 3))
    cache.limit = sum(sizes[k] for k in (4, 5, 6)) + max(sizes[7], sizes[8])
    cache.ensure(8)  # needed now (not wanted): the one read last goes
    assert all(cache.present(k) for k in (4, 5, 6, 8)) and not cache.present(7)


def test_a_fetch_ahead_makes_room_from_what_the_rank_reads_after_it(bucket, tmp_path, monkeypatch):
    """A fetch ahead may evict what the rank reads after the shard it fetches, the last read first, never
    what it reads before it. Evicting nothing the rank would read starved the fetch ahead from a bounded
    cache's second epoch on (the next epoch's order wants every shard present again): each batch then
    downloaded its own shards, one after another, at 55 % of the link."""
    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    cache, sizes = store.cache, [s["bytes"] for s in store.manifest.shards]
    ahead = ReadAhead(cache)
    monkeypatch.setattr(ahead, "_top_up", lambda: None)  # no fetching ahead: only what the test asks for
    for k in (3, 4, 5):
        cache.ensure(k)
    ahead.follow([Want(k, 1, 2, 1000) for k in (4, 6, 3, 5)])  # 4 before 6; 3 and 5 after it (5 last)
    cache.limit = sum(sizes[k] for k in (3, 4)) + max(sizes[5], sizes[6])  # room for 6 if 5 goes
    ahead._fetch_ahead(6)
    assert cache.present(6) and cache.present(4) and cache.present(3) and not cache.present(5)
    cache.limit = sum(sizes[k] for k in (3, 4, 6))  # full: 7 is not wanted, so nothing goes for it
    ahead._fetch_ahead(7)
    assert not cache.present(7) and all(cache.present(k) for k in (3, 4, 6))


def test_a_fetch_ahead_evicts_nothing_where_a_shard_another_rank_holds_leaves_no_room(bucket, tmp_path, monkeypatch):
    """Two ranks share a cache: a shard the other holds can't go, so a fetch ahead whose room needed it
    evicts nothing (it counted that shard as room, evicted the rank's own later shards and still
    fetched nothing)."""
    from gpufeed.store.remote import ShardCache

    options = bucket["options"]
    a = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=options).cache
    b = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=options).cache
    assert isinstance(b, ShardCache) and a.folder == b.folder
    sizes = [s["bytes"] for s in a.manifest.shards]
    ahead = ReadAhead(a)
    monkeypatch.setattr(ahead, "_top_up", lambda: None)
    for k in (0, 1, 2):
        a.ensure(k)
    b.hold(0)  # the other rank reads shard 0
    try:
        ahead.follow([Want(k, 0, 2, 1000) for k in (1, 3, 2)])  # 2 is read after 3
        a.limit = b.limit = sizes[0] + sizes[1] + sizes[3] - 1  # room for 3 only if 0 and 2 both went
        ahead._fetch_ahead(3)
        assert not a.present(3) and all(a.present(k) for k in (0, 1, 2))
    finally:
        b.release(0)
    ahead._fetch_ahead(3)  # let go: room is made from 0 (not wanted), then 2 (read after 3)
    assert a.present(3) and a.present(1)


def test_a_cache_too_small_for_the_batches_in_flight_is_refused_at_once(bucket, tmp_path):
    """A cache whose room the batches in flight fill is refused when the Loader is made, naming the
    size needed (it ran out of room mid-epoch: "holds only the shards in use"); that size trains."""
    manifest = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "peek", storage_options=bucket["options"]).manifest
    biggest = max(s["bytes"] for s in manifest.shards)
    with pytest.raises(ValueError, match="cache_limit") as error:
        _loader(bucket, tmp_path, batch_size=8, cache_limit=9 * biggest)
    needed = smallest_cache(gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "peek",
                                         storage_options=bucket["options"]), 8)
    assert needed > 9 * biggest and f"raise it to {needed} bytes" in str(error.value)
    loader = _loader(bucket, tmp_path, batch_size=8, cache_limit=needed, drop_last=False, pad=False)
    assert loader.batch_sampler.shards.window == 1
    for _ in range(2):
        seen = torch.cat([y for _, y in loader])
        assert len(seen) == 40 and loader.store.cache.used() <= needed


def test_the_cache_is_counted_as_it_is_at_one_moment(bucket, tmp_path):
    """`used()` is not fooled by a shard evicted while it counts and another fetched in its room: the
    eviction waits for the count (it failed a test now and then, counting both)."""
    from gpufeed.store.remote import ShardCache

    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"],
                         cache_limit=None)
    cache = store.cache
    sizes = [s["bytes"] for s in store.manifest.shards]
    cache.limit = max(sizes[0], sizes[-1])  # room for one of the two
    cache.ensure(0)
    swap = threading.Thread(target=cache.ensure, args=(len(sizes) - 1,))  # evicts shard 0 to fetch the last
    real = ShardCache.present

    def present(self, k):
        there = real(self, k)
        if k == 0 and there and swap.ident is None:  # shard 0 counted: now the swap, in the count's midst
            swap.start()
            swap.join(2.0)  # done by now, unless it waits for the count
        return there

    ShardCache.present = present
    try:
        counted = cache.used()
    finally:
        ShardCache.present = real
    swap.join()
    assert counted <= cache.limit and cache.present(len(sizes) - 1) and not cache.present(0)


def test_the_fetch_ahead_fills_the_rank_s_part_of_the_cache_beside_what_it_holds(bucket, tmp_path, monkeypatch):
    """Downloads ahead fill this rank's part of `cache_limit` less the shards it holds (half the cache
    ahead left a quarter-of-the-store cache downloading at half the link's rate)."""
    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    cache, sizes = store.cache, [s["bytes"] for s in store.manifest.shards]
    assert len(sizes) >= 10

    def planned(limit: int, ranks: int, held: list[int]) -> list[int]:
        started: list[int] = []
        ahead = ReadAhead(cache)
        monkeypatch.setattr(ahead, "_fetch_ahead", started.append)
        monkeypatch.setattr(ahead, "_leads_alone", lambda lead, held: False)  # (its own test: test_readahead)
        cache.limit = limit
        for k in held:
            cache.hold(k)
        ahead.follow([Want(k, 0, 1, 1000) for k in held + list(range(3, 10))], ranks)
        ahead._pool.shutdown(wait=True)  # every download started has run
        for k in held:
            cache.release(k)
        return sorted(started)

    def fits(room: int) -> list[int]:  # the longest run of shards 3, 4, ... within `room` (one at least)
        run = [3]
        while run[-1] < 9 and sum(sizes[k] for k in run) + sizes[run[-1] + 1] <= room:
            run.append(run[-1] + 1)
        return run

    six = 6 * max(sizes)
    assert planned(six, 1, []) == fits(six)
    assert len(fits(six)) >= 6
    assert planned(six, 1, [0, 1]) == fits(six - sizes[0] - sizes[1])
    assert planned(six, 2, []) == fits(six // 2)


def test_the_shards_of_the_next_epoch_are_fetched_before_it_begins(bucket, tmp_path):
    """A pass tells the cache the shards it will read and, where the next epoch is planned already,
    that epoch's after them: the cache fetches across the epoch's end."""
    biggest = max(s["bytes"] for s in gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "peek",
                                                   storage_options=bucket["options"]).manifest.shards)
    loader = _loader(bucket, tmp_path, rank=0, world_size=3, cache_limit=9 * biggest)
    for _ in loader:  # epoch 0; epochs 1 and 2 are planned meanwhile
        pass
    loader._planner.peek(2)  # (made by now)
    this, _ = loader.store.locate(torch.cat([loader.plan(1, b)[0] for b in range(len(loader))]).numpy())
    after, _ = loader.store.locate(torch.cat([loader.plan(2, b)[0] for b in range(len(loader))]).numpy())
    ahead, told = loader.input.ahead, []
    real = ahead.follow

    def follow(wants, ranks=1):  # what the cache wants right after the pass told it (batches read later,
        number = real(wants, ranks)  # on the producer threads, take entries off: looking after next() raced)
        with ahead._lock:
            told.append({w.shard for w in ahead._wanted})
        return number

    ahead.follow = follow
    next(iter(loader))  # epoch 1 begins (its first shards read are no longer wanted ahead)
    wanted, only_after = told[0], set(after.tolist()) - set(this.tolist())
    assert only_after and only_after <= wanted <= set(this.tolist()) | only_after


def test_the_first_pass_downloads_from_its_order_while_its_plan_is_drawn(bucket, tmp_path, monkeypatch):
    """The first pass's order is drawn as the Loader is made, its augment parameters on the planner
    thread, and the pass starts its downloads from the order. They waited for the whole plan: in a
    fresh process on a 16-core GPU host it came 0.2-0.5 s after the pass began. Here the plan is held
    until the cache starts a download (10 s at most)."""
    from gpufeed.loader import planner

    gate, real, held = threading.Event(), planner.plan_epoch, []

    def late(*args, **kw):
        held.append(gate.wait(10))
        return real(*args, **kw)

    monkeypatch.setattr(planner, "plan_epoch", late)
    loader = _loader(bucket, tmp_path)
    ahead = loader.input.ahead
    top_up = ahead._top_up

    def started():
        top_up()
        with ahead._lock:
            if ahead._ahead:
                gate.set()

    ahead._top_up = started
    batches = iter(loader)
    next(batches)
    assert held[0], "no download began before the first pass's plan was made"
    assert len(list(batches)) == len(loader) - 1


def test_the_next_epoch_planned_after_its_pass_began_is_fetched_ahead_once_planned(bucket, tmp_path, monkeypatch):
    """Epoch 1's plan is made after epoch 0's pass began (it always is: both start then): once made,
    the cache is told its shards, after epoch 0's. It was not before, and a cache smaller than the
    store downloaded them one after another as epoch 0's last batches read epoch 1's first ahead."""
    from gpufeed.loader import planner

    gate, real = threading.Event(), planner.plan_epoch

    def late(sampler, augment, seed, epoch, *rest, **kw):
        if epoch == 1:
            assert gate.wait(60)
        return real(sampler, augment, seed, epoch, *rest, **kw)

    monkeypatch.setattr(planner, "plan_epoch", late)
    loader = _loader(bucket, tmp_path)
    ahead, seen = loader.input.ahead, []
    top_up = ahead._top_up

    def looked():  # what the cache wants whenever it starts downloads, and the epoch its pass is in
        with ahead._lock:
            seen.append((ahead._epoch, {(w.epoch, w.shard) for w in ahead._wanted}))
        top_up()

    ahead._top_up = looked
    batches = iter(loader)
    try:
        got = [next(batches)]
        assert seen and all(e == 0 and {at for at, _ in wanted} <= {0} for e, wanted in seen)
    finally:
        gate.set()
    shards, _ = loader.store.locate(loader._planner.peek(1).indices.numpy())
    deadline = time.monotonic() + 30
    while not any(e == 0 and 1 in {at for at, _ in wanted} for e, wanted in seen) and time.monotonic() < deadline:
        time.sleep(0.02)
    told = next((wanted for e, wanted in seen if e == 0 and 1 in {at for at, _ in wanted}), None)
    assert told is not None, "epoch 1's shards were never wanted during epoch 0"
    assert {k for at, k in told if at == 1} == set(shards.tolist())
    got += list(batches) + list(loader)  # and the epochs are whole
    labels = torch.cat([y for _, y in got])
    assert len(labels) == 2 * len(gpufeed.open(bucket["flat"]))


def test_a_next_epoch_s_shard_read_in_full_before_it_is_followed_is_not_wanted_in_its_pass(bucket, tmp_path,
                                                                                           monkeypatch):
    """Epoch 1's first batches, read as epoch 0 ends, may read a shard's every sample before its plan
    is made: `follow_next` then leaves it out, and epoch 1's own pass does not want it again (its
    reads were taken off once; its count could never reach zero, and it was kept from eviction)."""
    cache = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"]).cache
    ahead = ReadAhead(cache)
    monkeypatch.setattr(ahead, "_top_up", lambda: None)  # the lists only, no downloads
    told = ahead.follow([Want(0, 0, 5, 4)])
    ahead.read([0], [5])  # epoch 0 read in full
    ahead.read([1, 2], [3, 1])  # epoch 1's first batch, before its plan was made: no entry wants them
    ahead.follow_next([Want(1, 1, 3, 7), Want(2, 1, 2, 9)], told)
    assert [(w.shard, w.epoch, w.left) for w in ahead._wanted] == [(2, 1, 1)]
    ahead.follow([Want(1, 1, 3, 2), Want(2, 1, 2, 4)])  # epoch 1's pass
    assert [(w.shard, w.epoch, w.left) for w in ahead._wanted] == [(2, 1, 1)]
    ahead.follow_next([Want(3, 2, 4, 9)], told)  # a call from before that pass: too late, nothing
    assert [(w.shard, w.epoch, w.left) for w in ahead._wanted] == [(2, 1, 1)]


def test_a_failed_try_keeps_only_whole_files_and_the_next_fetches_the_rest(bucket, tmp_path, monkeypatch):
    """A download that fails part way moves into the shard's folder only the files it finished; the
    next try fetches the others, into a folder of its own (a late write of the failed try lands in
    its own folder, never over the shard's)."""
    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    cache, real, asked, late = store.cache, store.cache.fs.get, [], []

    def get(remotes, locals_):
        asked.append([r.rsplit("/", 1)[1] for r in remotes])
        if len(asked) == 2:  # the shard's files, first try: one whole, one cut short, then an error
            real(remotes[:1], locals_[:1])
            Path(locals_[1]).write_bytes(b"short")
            late.append(Path(locals_[1]))
            raise OSError("connection reset")
        real(remotes, locals_)
        for path in late:  # the failed try's download of that file, still running, ends now
            try:
                path.write_bytes(b"late")
            except OSError:
                pass

    monkeypatch.setattr(cache.fs, "get", get)
    monkeypatch.setattr(fetch_module, "BACKOFF", 0.01)
    monkeypatch.setattr(fetch_module, "RANGED", ())  # whole files (a filesystem without byte ranges)
    cache.ensure(0)
    assert cache.present(0) and len(asked) == 3 and len(asked[1]) > 2
    assert asked[2] == asked[1][1:]  # the whole one kept, the short one fetched again


def test_a_shard_comes_as_byte_ranges_and_a_failed_try_keeps_the_files_it_had_whole(bucket, tmp_path, monkeypatch):
    """From an object store a shard's files come as byte ranges, several at once (one stream through a
    link of 20 ms carried 48 MB/s of 125); a try that fails part way keeps the files all of whose
    ranges came, and the next fetches the others; a range that comes short is an error, not a file."""
    store = gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "c", storage_options=bucket["options"])
    cache, real, asked = store.cache, store.cache.fs.cat_ranges, []
    data = store.manifest.shards[0]["bytes"]

    def cat_ranges(paths, starts, ends, **kw):
        asked.append(list(zip([p.rsplit("/", 1)[1] for p in paths], starts, ends, strict=True)))
        if len(asked) == 2:  # the second group of the first try: the connection drops
            raise OSError("connection reset")
        out = real(paths, starts, ends, **kw)
        return [blob[:-1] for blob in out] if len(asked) == 3 else out  # the second try's first group: short

    monkeypatch.setattr(cache.fs, "cat_ranges", cat_ranges)
    monkeypatch.setattr(fetch_module, "BACKOFF", 0.01)
    monkeypatch.setattr(fetch_module, "PART", 256)
    monkeypatch.setattr(fetch_module, "RANGES_AT_ONCE", 3)
    cache.ensure(0)
    assert cache.present(0) and data > 3 * 256 and len(asked) >= 4
    first = asked[0]
    assert len(first) == 3 and all(b - a <= 256 for _, a, b in first)
    whole = {n for n, _, _ in first} - {n for n, _, _ in asked[1]}  # every range of these came in try 1
    later = {n for group in asked[2:] for n, _, _ in group}
    assert whole and not whole & later  # kept, not fetched again
    assert {n for group in asked for n, _, _ in group} == set(Manifest.read(cache.path(0)).files)


def test_a_state_saved_before_the_streamed_first_epoch_resumes_from_epoch_1(bucket, tmp_path):
    """A state_dict saved before a bucket's store had a shard-aware first epoch (no "first_window" in
    its order key, nor "ramp") resumes at epoch 1 or later, whose order is unchanged, and is refused
    in epoch 0."""
    loader = _loader(bucket, tmp_path)
    old = loader.state_dict()
    old["order"] = [k for k in old["order"] if not (isinstance(k, dict) and {"first_window", "ramp"} & set(k))]
    assert old["order"] != loader.state_dict()["order"]
    with pytest.raises(ValueError, match="order"):
        loader.load_state_dict(old)
    loader.load_state_dict(old | {"epoch": 1, "batch": 2})
    assert loader.epoch == 1 and len(list(loader)) == len(loader) - 2


def test_a_state_saved_before_spans_started_on_one_shard_resumes_only_at_an_epochs_start(bucket, tmp_path):
    """Through a window every epoch (here asked for), each epoch's spans are ordered to start on one
    shard ("ramp" in the order key): a state_dict saved before that resumes such an epoch at its start,
    and is refused part way through it, whose rest would be other samples."""
    loader = _loader(bucket, tmp_path, shuffle_window=2)
    assert loader.batch_sampler.shards.ramped(1)
    old = loader.state_dict()
    old["order"] = [k for k in old["order"] if not (isinstance(k, dict) and "ramp" in k)]
    with pytest.raises(ValueError, match="resumes only at an epoch's start or end, not at batch 2 of epoch 1"):
        loader.load_state_dict(old | {"epoch": 1, "batch": 2})
    loader.load_state_dict(old | {"epoch": 1, "batch": 0})
    assert loader.epoch == 1 and len(list(loader)) == len(loader)


def test_a_state_saved_while_spans_ended_otherwise_resumes_only_where_the_order_is_the_same(bucket, tmp_path):
    """A span's last shard now takes its last place alone (a new "ramp" in the order key): a state_dict
    saved by a gpufeed that spread it further resumes a ramped epoch at its start, and a full-shuffle
    epoch anywhere, and is refused part way through a ramped one, whose rest would be other samples."""
    from gpufeed.loader.sampler import RAMPS_BEFORE

    loader = _loader(bucket, tmp_path, shuffle_window=2)
    old = loader.state_dict()
    old["order"] = [{"ramp": RAMPS_BEFORE[-1]} if isinstance(k, dict) and "ramp" in k else k for k in old["order"]]
    assert old["order"] != loader.state_dict()["order"]
    with pytest.raises(ValueError, match="resumes only at an epoch's start or end, not at batch 2 of epoch 1"):
        loader.load_state_dict(old | {"epoch": 1, "batch": 2})
    loader.load_state_dict(old | {"epoch": 1, "batch": 0})
    assert loader.epoch == 1 and len(list(loader)) == len(loader)
    loader.load_state_dict(old | {"epoch": 1, "batch": len(loader)})  # saved after its last batch: nothing left
    assert loader.epoch == 1 and len(list(loader)) == len(loader) and loader.epoch == 3  # epoch 2's pass, whole
    streamed = _loader(bucket, tmp_path)  # ramped in epoch 0 only: epoch 1 is a full shuffle
    old = streamed.state_dict()
    old["order"] = [{"ramp": RAMPS_BEFORE[-1]} if isinstance(k, dict) and "ramp" in k else k for k in old["order"]]
    streamed.load_state_dict(old | {"epoch": 1, "batch": 2})
    assert streamed.epoch == 1 and len(list(streamed)) == len(streamed) - 2


def test_ranks_sharing_a_cache_folder_download_each_shard_once(bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loaders = [_loader(bucket, tmp_path, rank=r, world_size=2, drop_last=False, pad=False) for r in range(2)]
    iterators = [iter(x) for x in loaders]
    for batches in zip(*iterators):  # the ranks take turns, as ranks running at once would
        pass
    shards = len(loaders[0].store.manifest.shards)
    assert sum(x.store.cache.fetched for x in loaders) == shards


def test_a_job_resumed_at_another_world_size_reads_exactly_the_rest_from_the_bucket(bucket, tmp_path):
    first = [_loader(bucket, tmp_path, rank=r, world_size=2, drop_last=False, pad=False) for r in range(2)]
    seen = []
    for loader in first:
        it = iter(loader)
        for number in range(2):
            next(it)
            seen += loader.plan(0, number)[0].tolist()
    state = first[0].state_dict()
    assert state == first[1].state_dict()
    rest = []
    for r in range(3):
        loader = _loader(bucket, tmp_path, rank=r, world_size=3, drop_last=False, pad=False)
        loader.load_state_dict(state)
        for number, _ in enumerate(loader):
            rest += loader.plan(0, number)[0].tolist()
    assert sorted(seen + rest) == list(range(40))


def test_a_shard_damaged_in_the_bucket_is_named_and_never_used(bucket, tmp_path):
    fs = bucket["fs"]
    fs.copy("bucket/train", "bucket/damaged", recursive=True)
    name = "bucket/damaged/shards/00002/data.bin"
    data = bytearray(fs.cat_file(name))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(name, bytes(data))
    loader = gpufeed.Loader("s3://bucket/damaged", batch_size=4, device="cpu", augment=OPS, shuffle=False,
                            num_workers=1, cache_dir=tmp_path / "cache", storage_options=bucket["options"])
    with pytest.raises(StoreError, match=r"s3://bucket/damaged/shards/00002.*digest differs"):
        list(loader)
    assert not (tmp_path / "cache" / "shards" / "00002").exists()  # nothing unverified is kept


def test_a_store_file_damaged_in_the_bucket_is_named_and_not_kept(bucket, tmp_path):
    """The store's own files (labels, shapes) come the way a shard's files do, and are checked the same."""
    fs = bucket["fs"]
    fs.copy("bucket/train", "bucket/badlabels", recursive=True)
    name = "bucket/badlabels/labels.i64"
    data = bytearray(fs.cat_file(name))
    data[0] ^= 0x01
    fs.pipe_file(name, bytes(data))
    with pytest.raises(StoreError, match=r"s3://bucket/badlabels/labels\.i64: .*digest differs"):
        gpufeed.open("s3://bucket/badlabels", cache_dir=tmp_path / "cache", storage_options=bucket["options"])
    assert not (tmp_path / "cache" / "top" / "labels.i64").exists()
    assert sorted(p.name for p in (tmp_path / "cache" / "top").iterdir()) == ["manifest.json"]  # no temp left
    fs.pipe_file(name, bytes(data[:0]) + bytes([data[0] ^ 0x01]) + bytes(data[1:]))  # mended
    store = gpufeed.open("s3://bucket/badlabels", cache_dir=tmp_path / "cache", storage_options=bucket["options"])
    assert store.labels.tolist() == gpufeed.open(bucket["flat"]).labels.tolist()


def relay(handler: http.server.BaseHTTPRequestHandler) -> None:
    """Forward `handler`'s request to its class's `upstream` server and send back what it answered (a
    test proxy's pass-through)."""
    body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0)) or None
    request = urllib.request.Request(type(handler).upstream + handler.path, data=body, method=handler.command,
                                     headers={k: v for k, v in handler.headers.items() if k.lower() != "host"})
    try:
        with urllib.request.urlopen(request) as answer:
            status, headers, payload = answer.status, answer.getheaders(), answer.read()
    except urllib.error.HTTPError as e:
        status, headers, payload = e.code, e.headers.items(), e.read()
    handler.send_response(status)
    for k, v in headers:
        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
            handler.send_header(k, v)
    length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
    handler.send_header("Content-Length", length if handler.command == "HEAD" else str(len(payload)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(payload)


class _Flaky(http.server.BaseHTTPRequestHandler):
    """A proxy in front of the S3 server that answers every third request for a shard's file with a 503."""

    upstream = ""
    count = 0
    failed = 0

    def _forward(self):
        type(self).count += 1
        if "/shards/" in self.path and type(self).count % 3 == 0:
            type(self).failed += 1
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        relay(self)


    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    def log_message(self, *args):
        pass


def test_a_server_that_fails_requests_now_and_then_is_survived(bucket, server, tmp_path):
    _Flaky.upstream, _Flaky.count, _Flaky.failed = server, 0, 0
    proxy = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        options = _options(f"http://127.0.0.1:{proxy.server_address[1]}")
        options["config_kwargs"] = {"retries": {"max_attempts": 1}}  # the client gives up: gpufeed's retries decide
        loader = gpufeed.Loader("s3://bucket/train", batch_size=4, device="cpu", augment=OPS, seed=1, num_workers=1,
                                cache_dir=tmp_path / "cache", storage_options=options)
        assert len(list(loader)) == 10 and _Flaky.failed > 0
    finally:
        proxy.shutdown()


def test_credentials_never_appear_in_errors_or_logs(bucket, tmp_path, caplog):
    with pytest.raises(ValueError) as error:  # in a URL they are refused, and not repeated
        gpufeed.Loader(f"s3://{KEY}:{SECRET}@bucket/train", batch_size=4, device="cpu", augment=OPS,
                       cache_dir=tmp_path / "c")
    assert SECRET not in str(error.value) and "s3://bucket/train" in str(error.value)
    with caplog.at_level(logging.DEBUG, logger="gpufeed"), pytest.raises(ValueError, match="query") as error:
        gpufeed.Loader("s3://bucket/missing?X-Amz-Signature=abc", batch_size=4, device="cpu", augment=OPS,
                       cache_dir=tmp_path / "c", storage_options=bucket["options"])
    assert "bucket/missing" in str(error.value) and "abc" not in str(error.value)
    assert SECRET not in str(error.value) and KEY not in str(error.value) and SECRET not in caplog.text


def test_packing_over_a_store_in_a_bucket_needs_overwrite_and_leaves_no_stale_shard(bucket, tmp_path):
    options = bucket["options"]
    gpufeed.pack(bucket["src"], "s3://bucket/again", mode="jpeg", workers=1, progress=False, shard_size="3KB",
                 storage_options=options)
    many = len(bucket["fs"].ls("bucket/again/shards"))
    with pytest.raises(StoreError, match="destination exists"):
        gpufeed.pack(bucket["src"], "s3://bucket/again", mode="jpeg", workers=1, progress=False,
                     storage_options=options)
    gpufeed.pack(bucket["src"], "s3://bucket/again", mode="jpeg", workers=1, progress=False, shard_size="40KB",
                 storage_options=options, overwrite=True)
    assert len(bucket["fs"].ls("bucket/again/shards", refresh=True)) < many  # (gpufeed's own client wrote it)
    store = gpufeed.open("s3://bucket/again", cache_dir=tmp_path / "c", storage_options=options)
    assert len(store) == 40 and np.array_equal(store.labels.numpy(), gpufeed.open(bucket["flat"]).labels.numpy())


def test_a_sharded_store_on_disk_loads_the_batches_of_the_unsharded_one(bucket, tmp_path):
    for mode in ("jpeg", "raw"):
        flat = gpufeed.pack(bucket["src"], tmp_path / f"{mode}-flat", mode=mode, size=32, workers=1, progress=False)
        gpufeed.pack(bucket["src"], tmp_path / f"{mode}-sharded", mode=mode, size=32, workers=1, progress=False,
                     shard_size="10KB")
        sharded = gpufeed.open(tmp_path / f"{mode}-sharded")
        assert len(sharded.manifest.shards) > 2 and len(sharded) == flat.count
        assert gpufeed.verify(tmp_path / f"{mode}-sharded").ok
        a = [x for x, _ in gpufeed.Loader(tmp_path / f"{mode}-flat", batch_size=8, device="cpu", augment=OPS,
                                          num_workers=1)]
        b = [x for x, _ in gpufeed.Loader(sharded, batch_size=8, device="cpu", augment=OPS, num_workers=1)]
        assert len(a) == len(b) == 5 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), mode
    shutil.rmtree(tmp_path / "jpeg-sharded" / "shards" / "00001")
    result = gpufeed.verify(tmp_path / "jpeg-sharded")
    assert not result.ok and "shards/00001/manifest.json" in result.damaged


def test_pack_sources_in_a_bucket_tar_shards_and_lists(bucket, tmp_path):
    """Tar shards (a glob) and a CSV list whose paths are relative to it, read from the bucket, pack
    the same store as the same files on this disk."""
    import tarfile

    fs, options, src = bucket["fs"], bucket["options"], bucket["src"]
    files = sorted(src.rglob("*.jpg"))[:12]
    rows = ["path,label,score"] + [f"images/{f.parent.name}/{f.name},{f.parent.name},{k / 10}" for k, f in enumerate(files)]
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    fs.put_file(str(tmp_path / "list.csv"), "bucket/lists/list.csv")
    for f in files:
        fs.put_file(str(f), f"bucket/lists/images/{f.parent.name}/{f.name}")
    for shard in range(2):
        with tarfile.open(tmp_path / f"s{shard}.tar", "w") as tar:
            for k, f in enumerate(files[shard * 6 : shard * 6 + 6]):
                tar.add(f, arcname=f"{k:03d}.jpg")
                info = tarfile.TarInfo(f"{k:03d}.cls")
                info.size = 1
                tar.addfile(info, __import__("io").BytesIO(str(shard).encode()))
        fs.put_file(str(tmp_path / f"s{shard}.tar"), f"bucket/tars/s{shard}.tar")
    listed = gpufeed.pack("s3://bucket/lists/list.csv", tmp_path / "from-list", mode="jpeg", workers=1, progress=False,
                          storage_options=options)
    assert listed.count == 12 and not listed.skipped
    local_rows = ["path,label,score"] + [f"{f},{f.parent.name},{k / 10}" for k, f in enumerate(files)]
    (tmp_path / "local.csv").write_text("\n".join(local_rows) + "\n")
    gpufeed.pack(tmp_path / "local.csv", tmp_path / "local", mode="jpeg", workers=1, progress=False)
    a, b = gpufeed.open(tmp_path / "from-list"), gpufeed.open(tmp_path / "local")
    assert a.classes == b.classes and torch.equal(a.labels, b.labels)
    assert all(torch.equal(a[i][0], b[i][0]) and a.field("score", i) == b.field("score", i) for i in range(12))
    assert a.source(0) == "s3://bucket/lists/" + rows[1].split(",")[0]
    shards = gpufeed.pack("s3://bucket/tars/s*.tar", tmp_path / "from-tars", mode="jpeg", workers=1, progress=False,
                          storage_options=options)
    assert shards.count == 12 and gpufeed.open(tmp_path / "from-tars").labels.tolist() == [0] * 6 + [1] * 6


def test_a_program_reading_a_bucket_exits_without_close(bucket, tmp_path):
    """Its fetch-ahead threads never wait on a shard a rank holds (they did, and the interpreter's exit
    waited for them for ever)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent(f"""
        import gpufeed
        from gpufeed.augment import RandomResizedCrop
        loader = gpufeed.Loader("s3://bucket/train", batch_size=4, device="cpu", augment=[RandomResizedCrop(24)],
                                num_workers=1, cache_dir={str(tmp_path / "cache")!r}, cache_limit=60000,
                                storage_options={bucket["options"]!r})
        for k, _ in enumerate(loader):
            if k == 3:
                break
        it = iter(loader)
        next(it)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(gpufeed.__file__).parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_masks_from_a_bucket_are_those_of_the_store_on_disk(bucket, tmp_path):
    """Instance masks packed into a bucket come back, through the cache, as the local store gives them."""
    import numpy as np

    from gpufeed.synth import natural_image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:30, :40]
    data = [{"image": natural_image(rng, 30, 40, k), "label": 0,
             "masks": np.stack([(xx - 5 * j - k) ** 2 + (yy - 15) ** 2 < 40 for j in range(k % 3 + 1)]).astype(np.uint8)}
            for k in range(12)]
    gpufeed.pack(data, "s3://bucket/masks", mode="jpeg", workers=1, progress=False, shard_size="4KB",
                 storage_options=bucket["options"])
    gpufeed.pack(data, tmp_path / "flat", mode="jpeg", workers=1, progress=False)
    kw = dict(batch_size=4, device="cpu", augment=OPS, seed=2, num_workers=1, fields=("masks",))
    remote = gpufeed.Loader("s3://bucket/masks", cache_dir=tmp_path / "cache", storage_options=bucket["options"],
                            shuffle_window=1000, **kw)  # a full shuffle from the first epoch, as on disk
    local = gpufeed.Loader(tmp_path / "flat", **kw)
    pairs = list(zip(remote, local, strict=True))
    assert len(pairs) == 3 and pairs[0][1]["masks"].any()
    assert all(torch.equal(a["masks"], b["masks"]) and torch.equal(a["masks_count"], b["masks_count"]) for a, b in pairs)


def test_a_batch_does_not_wait_for_the_downloads_of_the_batches_after_it(bucket, tmp_path, monkeypatch):
    """A batch whose shards are in the cache is made while the next batches' shards still download:
    those are started when they are made, not ahead of it (the cold epoch's first batch waited for
    the next two batches' shards, 0.83 s on a 1 Gbit/s link)."""
    loader = _loader(bucket, tmp_path, num_workers=0)
    first = set(loader.store.locate(loader.plan(0, 0)[0].numpy())[0].tolist())
    later = set(loader.store.locate(torch.cat([loader.plan(0, b)[0] for b in (1, 2)]).numpy())[0].tolist())
    assert later - first  # (the next batches read shards the first does not)
    go = threading.Event()
    download = remote_module.ShardCache._download

    def held_back(self, k, *a, **kw):
        if k not in first:
            assert go.wait(60)
        return download(self, k, *a, **kw)

    monkeypatch.setattr(remote_module.ShardCache, "_download", held_back)
    got: list = []
    it = iter(loader)
    reader = threading.Thread(target=lambda: got.append(next(it)), daemon=True)
    reader.start()
    reader.join(30)
    made = bool(got)
    go.set()  # the rest download now
    reader.join(60)
    assert made, "the first batch waited for the downloads of the batches after it"
    assert len(list(it)) == len(loader) - 1


def test_a_first_shard_that_lands_before_the_others_start_gives_the_same_batches(bucket, tmp_path):
    """`Tuning(lead_lands_first=True)` reaches the pass's downloads ahead, and a cold epoch through it
    gives the batches of one without it, each shard downloaded once."""
    from gpufeed.decode.tuning import Tuning

    here = [(x, y) for x, y in _loader(bucket, tmp_path / "here")]
    loader = _loader(bucket, tmp_path / "lead", tuning=Tuning(lead_lands_first=True))
    assert loader.input.ahead.lead_lands_first
    got = [(x, y) for x, y in loader]
    assert len(got) == len(here) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, here))
    assert loader.store.cache.fetched == len(loader.store.manifest.shards)


def test_downloads_in_a_process_of_their_own_give_the_same_batches(bucket, tmp_path):
    """`Tuning(fetch_process=True)`: once its process is ready, each shard's files download there (one
    `Ask` a shard), and the epoch's batches are those downloaded in this process; the process ends with
    the store's cache."""
    from gpufeed.decode.tuning import Tuning

    here = [(x, y) for x, y in _loader(bucket, tmp_path / "here")]
    loader = _loader(bucket, tmp_path / "away", tuning=Tuning(fetch_process=True))
    away = loader.store.cache.elsewhere
    deadline = time.monotonic() + 60
    while not away.ready():
        assert time.monotonic() < deadline, away._ended
        time.sleep(0.05)
    import os
    import signal

    os.kill(away._proc.pid, signal.SIGINT)  # a Ctrl-C reaches the whole foreground group: it is the parent's
    time.sleep(0.3)
    assert away._proc.poll() is None and away.ready()
    got = [(x, y) for x, y in loader]
    assert len(got) == len(here) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, here))
    assert away._number == len(loader.store.manifest.shards) == loader.store.cache.fetched
    child = away._proc
    loader.store.close()
    assert child.poll() is not None and not away.ready()


def test_a_download_process_that_dies_hands_its_downloads_back_and_says_so(bucket, tmp_path, caplog):
    """Its process killed before the pass: the downloads run in this process, and the log says so once."""
    from gpufeed.decode.tuning import Tuning

    loader = _loader(bucket, tmp_path, tuning=Tuning(fetch_process=True))
    away = loader.store.cache.elsewhere
    deadline = time.monotonic() + 60
    while not away.ready():
        assert time.monotonic() < deadline, away._ended
        time.sleep(0.05)
    away._proc.kill()
    away._proc.wait()
    deadline = time.monotonic() + 10
    while away._ended is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        got = sum(len(y) for _, y in loader)
    assert got == 40 and loader.store.cache.fetched == len(loader.store.manifest.shards)
    said = [r for r in caplog.records if "download process ended" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_a_download_in_flight_when_its_process_dies_is_handed_back(tmp_path):
    """A download the process ran when it died raises `Ended` (not a failed shard): the cache does it
    again here, its leftovers removed (below). The download here waits on a server that never answers."""
    import socket

    import fsspec

    from gpufeed.store.fetch import Fetcher
    from gpufeed.store.fetch_process import Ended, FetchProcess

    pytest.importorskip("aiohttp")
    silent = socket.create_server(("127.0.0.1", 0))  # connections wait in its backlog, never answered
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    fetcher = Fetcher(fsspec.filesystem("http"), url, url, tmp_path)
    away = FetchProcess(fetcher)
    deadline = time.monotonic() + 60
    while not away.ready():
        assert time.monotonic() < deadline, away._ended
        time.sleep(0.05)
    (tmp_path / "into").mkdir()
    failed = []

    def download() -> None:
        try:
            away.checked(f"{url}/shard", {"data.bin": {"bytes": 4, "digest": "0" * 64}}, tmp_path / "into")
        except BaseException as e:  # noqa: BLE001
            failed.append(e)

    thread = threading.Thread(target=download)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive(), failed  # (waiting for the server's answer in the process)
    away._proc.kill()
    thread.join(timeout=10)
    silent.close()
    assert not thread.is_alive() and len(failed) == 1 and isinstance(failed[0], Ended), failed
    assert not away.ready()
    away.close()


def test_a_shard_whose_download_process_ended_downloads_here_without_its_leftovers(bucket, tmp_path):
    """`ShardCache._checked`: a download the process left (`Ended`, a `.fetch-` folder half written in the
    shard's folder) is done again in this process, and the shard holds only its own files."""
    from gpufeed.store.fetch_process import Ended

    class Ending:  # a download process that dies in each download, leaving its folder
        asked = 0
        closed = False

        def ready(self) -> bool:
            return True

        def checked(self, remote, files, into) -> None:
            Ending.asked += 1
            (into / ".fetch-left").mkdir()
            (into / ".fetch-left" / "data.bin").write_bytes(b"half")
            raise Ended("the download process ended (killed)")

        def close(self) -> None:
            pass

    loader = _loader(bucket, tmp_path)
    cache = loader.store.cache
    cache.elsewhere = Ending()
    assert sum(len(y) for _, y in loader) == 40
    shards = len(loader.store.manifest.shards)
    assert Ending.asked == cache.fetched == shards
    assert not any(p.name.startswith(".fetch-") for k in range(shards) for p in cache.path(k).iterdir())
    Ending.closed = True  # closed on purpose (the cache's close): the download stops, not done again here
    with pytest.raises(Ended):
        cache._checked(f"{cache.root}/shards/00000", {}, tmp_path)


def test_a_download_that_fails_in_its_process_raises_its_error_here(bucket, tmp_path):
    """An error of a download in the process (a file the bucket lacks) is raised in this process as
    the same StoreError naming the file, and the process goes on downloading."""
    from gpufeed.decode.tuning import Tuning

    loader = _loader(bucket, tmp_path, tuning=Tuning(fetch_process=True))
    cache = loader.store.cache
    away = cache.elsewhere
    deadline = time.monotonic() + 60
    while not away.ready():
        assert time.monotonic() < deadline, away._ended
        time.sleep(0.05)
    (tmp_path / "into").mkdir()
    with pytest.raises(StoreError, match="s3://bucket/train/shards/99999: not found"):
        away.checked(f"{cache.root}/shards/99999", {"data.bin": {"bytes": 4, "digest": "0" * 64}}, tmp_path / "into")
    assert away.ready() and sum(len(y) for _, y in loader) == 40 and away.asked == 1 + cache.fetched


class _HoldRecorder:
    """What `ShardBytes` asks of a bucket's `ShardCache`: `use` and `release` of each shard, recorded."""

    def __init__(self):
        self.held: dict[int, int] = {}

    def use(self, k):
        self.held[k] = self.held.get(k, 0) + 1

    def release(self, k):
        self.held[k] -= 1
        if not self.held[k]:
            del self.held[k]

    def present(self, k):
        return True


def test_a_shard_is_let_go_once_no_batch_being_made_reads_it(tmp_path):
    """A bucket's shards are held in the cache while a batch read from them is being made, and let go
    as soon as none is (`Encoded.let_go`), not `HELD_FOR` reads later: held so long, a cache of 9
    shards for batches of about a shard each held 6, and fetched ahead 2 at once for stretches of an
    epoch. A shard two batches read waits for both. One a batch being made reads is not let go by
    age (`HELD_FOR` reads of other batches: another pipeline's, a failed batch's replacements), which
    evicted it under its decode workers; after an error in a batch's making its shards go `HELD_FOR`
    reads later, and a batch never said to be made holds them `FORGOTTEN` reads; closing lets go."""
    store = small_sharded_store(tmp_path, 64)
    cache = store.cache = _HoldRecorder()
    source = ShardBytes(store)
    shard = lambda k: np.arange(store.starts[k], store.starts[k + 1])  # noqa: E731
    assert len(store.starts) - 1 >= 6

    def others(reads: int) -> None:
        for r in range(reads):
            source.read_later(shard(4 + r % 2))().let_go()

    a = source.read_later(shard(0))()
    b = source.read_later(np.concatenate([shard(0)[:1], shard(1)]))()
    assert set(cache.held) == {0, 1}
    a.let_go()
    assert set(cache.held) == {0, 1}  # b reads shard 0 too
    b.let_go()
    assert cache.held == {}
    b.let_go()  # (once only)
    assert cache.held == {}

    making = source.read_later(shard(2))()
    others(ShardBytes.HELD_FOR + 3)
    assert 2 in cache.held  # being made still
    making.let_go(now=False)  # (an error while it was made)
    others(ShardBytes.HELD_FOR)
    assert 2 in cache.held
    others(1)
    assert 2 not in cache.held

    forgotten = source.read_later(shard(3))()
    others(ShardBytes.FORGOTTEN)
    assert 3 in cache.held
    others(1)
    assert 3 not in cache.held
    forgotten.let_go()
    assert 3 not in cache.held
    source.close()
    assert cache.held == {}
