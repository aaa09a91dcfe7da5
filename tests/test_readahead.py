"""`store.readahead.ReadAhead` against a fake cache (no bucket, no folder): what it fetches ahead within
the rank's part of the limit beside what it holds, the eviction order it gives the cache, and a
shard that found no room tried again after a read."""

from __future__ import annotations

import threading
import time

from gpufeed.store.readahead import ReadAhead, Want


class FakeCache:
    """What a `ReadAhead` asks of a `ShardCache`: shards of `sizes` bytes, `limit`, those held, and
    `ensure_if_room` (recorded; `room` says which shards find room)."""

    def __init__(self, sizes, limit, held=(), room=None):
        self.sizes, self.limit, self.held = list(sizes), limit, set(held)
        self.manifest = type("M", (), {"shards": [{"name": f"{k:05d}"} for k in range(len(sizes))]})()
        self.order = dict
        self.on_files = lambda k: None
        self.room = room
        self.fetched: list[int] = []
        self.there: set[int] = set()
        self._lock = threading.Lock()

    def present(self, k):
        return k in self.there

    def holding(self):
        return set(self.held)

    def ensure_if_room(self, k):
        with self._lock:
            self.fetched.append(k)
            if self.room is not None and k not in self.room:
                return None
            self.there.add(k)
            return k


def _done(ahead: ReadAhead) -> None:
    """Wait for the downloads started, and those they start as they land."""
    while not all(future.done() for future in list(ahead._ahead.values())):
        for future in list(ahead._ahead.values()):
            future.result(10)


def test_what_is_fetched_ahead_fits_the_rank_s_part_beside_what_it_holds():
    cache = FakeCache([10] * 8, limit=60, held=[0])
    ahead = ReadAhead(cache)
    ahead.follow([Want(k, 0, 1, k) for k in (0, 1, 2, 3, 4, 5, 6, 7)], ranks=2)  # 30 a rank, 10 held
    _done(ahead)
    assert sorted(cache.fetched) == [1, 2]
    assert cache.order() == {k: k for k in range(8)}  # the cache evicts what the rank reads last, last
    ahead.close()
    assert cache.order is dict  # closed: the cache evicts by use alone


def test_a_shard_read_in_full_is_no_longer_wanted_and_one_without_room_is_tried_again_after_a_read():
    cache = FakeCache([10] * 4, limit=100, room={0, 1, 3})
    ahead = ReadAhead(cache)
    ahead.follow([Want(0, 0, 2, 1), Want(1, 0, 2, 3), Want(2, 0, 2, 5), Want(3, 0, 2, 7)])
    _done(ahead)
    assert sorted(cache.fetched) == [0, 1, 2, 3] and 2 not in cache.there  # 2 found no room
    cache.room.add(2)
    ahead.read([0], [2])  # 0 read in full: not wanted, and the nearest without room is tried again
    _done(ahead)
    assert cache.order() == {1: 0, 2: 1, 3: 2} and 2 in cache.there and cache.fetched.count(2) == 2
    ahead.close()


def test_the_shard_a_rank_reads_first_downloads_alone_until_its_files_are_asked_for():
    """Nothing read yet and the first shard not in the cache (a cold pass): the rank's first batch waits
    for that shard, so it downloads alone until its files are asked for (its manifest in); the others
    start then, before it lands. Where the rank has it (a warm cache), or once the rank has read, the
    next shards download at once."""
    fetching, may_ask, may_land = threading.Event(), threading.Event(), threading.Event()

    class Slow(FakeCache):
        def ensure_if_room(self, k):
            if k == 0 and not self.there:
                fetching.set()
                assert may_ask.wait(10)
                self.on_files(0)
                assert may_land.wait(10)
            return super().ensure_if_room(k)

    def started(ahead, count):
        for _ in range(1000):
            if len(ahead._ahead) >= count:
                return sorted(ahead._ahead)
            time.sleep(0.01)
        return sorted(ahead._ahead)

    cache = Slow([10] * 5, limit=100)
    ahead = ReadAhead(cache)
    ahead.follow([Want(k, 0, 1, k) for k in range(5)])
    assert fetching.wait(10)
    assert list(ahead._ahead) == [0]  # nothing else started beside it
    may_ask.set()
    assert started(ahead, 5) == [0, 1, 2, 3, 4] and 0 not in cache.there  # before it landed
    may_land.set()
    _done(ahead)
    assert cache.fetched[-1] == 0 and sorted(cache.fetched) == [0, 1, 2, 3, 4]
    ahead.close()
    assert cache.on_files(0) is None and cache.on_files != ahead._asked_for  # closed: told no more

    warm = FakeCache([10] * 5, limit=100)
    warm.there = {0}
    ahead = ReadAhead(warm)
    ahead.follow([Want(k, 0, 1, k) for k in range(5)])
    assert sorted(ahead._ahead) == [1, 2, 3, 4]  # started at once, in one top-up
    _done(ahead)
    ahead.close()

    # the rank read its first batch (its own download of the shard landed first): the rest go at once
    fetching.clear(), may_ask.clear(), may_land.clear()
    cache = Slow([10] * 5, limit=100)
    ahead = ReadAhead(cache)
    ahead.follow([Want(0, 0, 2, 1)] + [Want(k, 0, 1, k + 1) for k in range(1, 5)])
    assert fetching.wait(10) and list(ahead._ahead) == [0]
    ahead.read([0], [1])
    assert sorted(ahead._ahead) == [0, 1, 2, 3, 4]
    may_ask.set(), may_land.set()
    _done(ahead)
    ahead.close()
