"""`store.readahead.ReadAhead` against a fake cache (no bucket, no folder): what it fetches ahead within
the rank's part of the limit beside what it holds, the eviction order it gives the cache, and a
shard that found no room tried again after a read."""

from __future__ import annotations

import threading

from gpufeed.store.readahead import ReadAhead, Want


class FakeCache:
    """What a `ReadAhead` asks of a `ShardCache`: shards of `sizes` bytes, `limit`, those held, and
    `ensure_if_room` (recorded; `room` says which shards find room)."""

    def __init__(self, sizes, limit, held=(), room=None):
        self.sizes, self.limit, self.held = list(sizes), limit, set(held)
        self.manifest = type("M", (), {"shards": [{"name": f"{k:05d}"} for k in range(len(sizes))]})()
        self.order = dict
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
