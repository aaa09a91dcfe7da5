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


class SlowLead(FakeCache):
    """A cache whose shard 0, while not there, downloads in steps the test lets happen: `fetching` set
    as it starts, its files asked for (`on_files`) once `may_ask` is, `asked` set, in once `may_land` is."""

    def __init__(self, sizes, limit):
        super().__init__(sizes, limit)
        self.fetching, self.may_ask, self.asked, self.may_land = (threading.Event() for _ in range(4))

    def ensure_if_room(self, k):
        if k == 0 and not self.there:
            self.fetching.set()
            assert self.may_ask.wait(10)
            self.on_files(0)
            self.asked.set()
            assert self.may_land.wait(10)
        return super().ensure_if_room(k)


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
    def started(ahead, count):
        for _ in range(1000):
            if len(ahead._ahead) >= count:
                return sorted(ahead._ahead)
            time.sleep(0.01)
        return sorted(ahead._ahead)

    cache = SlowLead([10] * 5, limit=100)
    ahead = ReadAhead(cache)
    ahead.follow([Want(k, 0, 1, k) for k in range(5)])
    assert cache.fetching.wait(10)
    assert list(ahead._ahead) == [0]  # nothing else started beside it
    cache.may_ask.set()
    assert started(ahead, 5) == [0, 1, 2, 3, 4] and 0 not in cache.there  # before it landed
    cache.may_land.set()
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
    cache = SlowLead([10] * 5, limit=100)
    ahead = ReadAhead(cache)
    ahead.follow([Want(0, 0, 2, 1)] + [Want(k, 0, 1, k + 1) for k in range(1, 5)])
    assert cache.fetching.wait(10) and list(ahead._ahead) == [0]
    ahead.read([0], [1])
    assert sorted(ahead._ahead) == [0, 1, 2, 3, 4]
    cache.may_ask.set(), cache.may_land.set()
    _done(ahead)
    ahead.close()


def test_with_lead_lands_first_the_first_shard_downloads_alone_until_it_is_in_the_cache():
    """`Tuning.lead_lands_first`: its files asked for, the rank's first shard still downloads alone; the
    others start once it landed (its download's end tops the list up)."""
    cache = SlowLead([10] * 4, limit=100)
    ahead = ReadAhead(cache)
    ahead.lead_lands_first = True
    ahead.follow([Want(k, 0, 1, k) for k in range(4)])
    assert cache.fetching.wait(10)
    cache.may_ask.set()
    assert cache.asked.wait(10)  # (the ask tops the list up in its own thread: without the setting the others started)
    assert list(ahead._ahead) == [0]
    cache.may_land.set()
    _done(ahead)
    assert cache.fetched[0] == 0 and sorted(cache.fetched) == [0, 1, 2, 3]
    ahead.close()
