"""Downloads ahead of a rank's reading, into its cache folder (`store.remote.ShardCache`): the list of
what the rank has yet to read, in the order it first reads each shard (`follow`, `follow_next`,
`read`), and one pool of `FETCH_THREADS` threads that fetch the next wanted shards that fit in the
rank's part of the cache beside the shards it holds. The cache evicts in the order this list gives
it (`places`, the cache's `order`): what the rank will not read first, then what it reads last.

Owned by the Loader's input of a store in a bucket (`loader.inputs.remote`); its lock is taken
before the cache's, never the other way round (the cache asks `places` holding only its file locks)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpufeed.logs import logger
from gpufeed.store.format import StoreError

if TYPE_CHECKING:
    from gpufeed.store.remote import ShardCache

log = logger(__name__)

# shards downloaded ahead of the plan at once, per process (each its files at once, `fetch.Fetcher.get`).
# 3 against 8: a cold epoch's first batch sooner at 10 Gbit/s (0.44-0.46 s against 0.51-0.53), its
# rate the same or higher, and the same at 1 Gbit/s; 2 at once used 82-84 % of a 1 Gbit/s link against 95
# (docs/benchmarks.md, "Training from a bucket")
FETCH_THREADS = 3


@dataclass
class Want:
    """Samples of one shard that a rank has yet to read in one epoch: an entry of `ReadAhead.follow`'s
    list, which is in the order the rank first reads each. `last`: where its last sample is in the
    rank's reading, counted in samples from the list's start."""

    shard: int
    epoch: int
    left: int
    last: int


class ReadAhead:
    """The downloads ahead of one rank's reading into `cache` (this module's docstring)."""

    def __init__(self, cache: ShardCache):
        self.cache = cache
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future] = {}
        self._wanted: list[Want] = []  # what the rank has yet to read, in order (`follow`, `read`)
        self._no_room: set[int] = set()  # fetched ahead but found no room: the nearest tried again after a read
        self._failed: set[int] = set()  # fetched ahead and failed: not again until the next `follow`
        self._finished: set[tuple[int, int]] = set()  # (epoch, shard) of later epochs read in full before their pass
        self._epoch = -1  # the epoch `follow` was last given first
        self._told = 0  # `follow` calls: `follow_next` extends only the last one's list
        self._closed = False
        self._read = 0  # samples the rank read since `follow`
        self._most = 0  # the most samples one `read` reported
        self._early: dict[int, int] = {}  # samples read of shards no entry wanted: the next pass's, read before it
        self._ranks = 1  # this machine's ranks sharing the cache: each plans ahead within its part
        self._asked: set[int] = set()  # shards whose files were asked for since `follow` (`_asked_for`)
        self.lead_lands_first = False  # the first shard alone until it lands, not until asked (`Tuning`)
        cache.order = self.places  # the cache evicts what this rank reads last, last
        cache.on_files = self._asked_for

    def follow(self, wants: Sequence[Want], ranks: int = 1) -> int:
        """Download what the rank will read (`wants`, in the order it first reads each shard) ahead, on the
        fetch pool, as far as this rank's part of the cache's limit (`ranks`: this machine's ranks
        sharing it) allows beside the shards it holds; anything asked before is no longer wanted. What
        was read already of the entries counts: the next epoch's first batches are read before its
        pass begins (where that epoch was followed already, its entries keep their counts; else the
        reads that no entry wanted are taken off). Returns this call's number, for `follow_next`."""
        with self._lock:
            self._told += 1
            told = self._told
            self._pool = self._pool or ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="gpufeed-fetch")
            later = bool(wants) and wants[0].epoch > self._epoch
            before = {(w.epoch, w.shard): w.left for w in self._wanted} if later else {}
            self._epoch = wants[0].epoch if wants else self._epoch
            early, self._early, self._read = self._early, {}, 0
            wanted = []
            for w in wants:
                left = min(w.left, before.get((w.epoch, w.shard), w.left))
                taken = min(left, early.get(w.shard, 0))
                if taken:
                    early[w.shard] -= taken
                    self._read += taken
                wanted.append(Want(w.shard, w.epoch, left - taken, w.last))
            self._wanted = [w for w in wanted if w.left > 0 and (w.epoch, w.shard) not in self._finished]
            self._ahead = {k: f for k, f in self._ahead.items() if not f.done()}
            self._no_room.clear()
            self._failed.clear()
            self._finished.clear()
            self._asked.clear()
            self._ranks = max(1, ranks)
        self._top_up()
        return told

    def follow_next(self, wants: Sequence[Want], told: int) -> None:
        """The next epoch's entries (`wants`, placed after the list `follow` was given), once its plan is
        made, appended to what `follow` call `told` was given without them; nothing where another
        `follow` came since, or that list had the next epoch's already. Reads of their shards that no
        entry wanted (the next epoch's first batches, read as the pass ends) are taken off. Epoch 1's
        plan is made after epoch 0's pass begins (both start then), and was never followed before
        its own pass: the pass's last batches, reading epoch 1's first ahead, downloaded their shards
        one after another (docs/benchmarks.md, "Training from a bucket")."""
        with self._lock:
            if told != self._told or any(w.epoch > self._epoch for w in self._wanted):
                return
            for w in wants:
                taken = min(w.left, self._early.get(w.shard, 0))
                if taken:
                    self._early[w.shard] -= taken
                if w.left > taken:
                    self._wanted.append(Want(w.shard, w.epoch, w.left - taken, w.last))
                else:  # read in full before its pass: not wanted then either
                    self._finished.add((w.epoch, w.shard))
        self._top_up()

    def read(self, shards: Sequence[int], counts: Sequence[int]) -> None:
        """The rank has read `counts[i]` samples of `shards[i]` (a batch's): what is read in full is no
        longer wanted, and no longer kept from eviction ahead of what is; nor is an entry whose last
        sample the reading passed by eight reads (a count that cannot reach zero: a sample read with
        the next epoch's entry, or replaced by another).
        Trimming the list at the batch's first shard instead kept shards read long ago wanted, and the
        batches waited for more downloads of their own (measured as 83ea60a says)."""
        with self._lock:
            for k, count in zip(shards, counts):
                entry = next((w for w in self._wanted if w.shard == k), None)
                if entry is not None:
                    entry.left -= count
                else:
                    self._early[k] = self._early.get(k, 0) + count
            self._read += sum(counts)
            self._most = max(self._most, sum(counts))
            passed = self._read - 8 * self._most
            self._finished |= {(w.epoch, w.shard) for w in self._wanted if w.left <= 0 and w.epoch > self._epoch}
            self._wanted = [w for w in self._wanted if w.left > 0 and w.last >= passed]
            # room is made as the batches in flight let go of their shards: the nearest that found none tries again
            self._no_room.discard(next((w.shard for w in self._wanted if w.shard in self._no_room), -1))
        self._top_up()

    def _top_up(self) -> None:
        """Start downloads of the next wanted shards that fit in this rank's part of the cache beside the
        shards it holds (the next one always: it is needed soon). Planning only half the cache ahead
        left a cache of a quarter of the store downloading at half the link's rate (measured as 5ec2234
        says)."""
        with self._lock:
            if self._closed:
                return
            sizes, held = self.cache.sizes, self.cache.holding()
            room = self.cache.limit / self._ranks if self.cache.limit is not None else float("inf")
            room -= sum(sizes[k] for k in held)
            planned = 0
            order = list(dict.fromkeys(w.shard for w in self._wanted))
            if order and self._read == 0 and self._leads_alone(order[0], held):
                order = order[:1]
            for k in order:
                if k in held:
                    continue
                if planned and planned + sizes[k] > room:
                    break
                planned += sizes[k]
                busy = k in self._ahead and not self._ahead[k].done()
                if not busy and self._to_fetch(k, held):
                    self._ahead[k] = self._pool.submit(self._fetch_ahead, k)  # type: ignore[union-attr]  # (follow made it)

    def _to_fetch(self, k: int, held) -> bool:
        """Whether shard `k` is one to download ahead: not `held` by the rank, not in the cache, and not
        one that failed or found no room (those are fetched when read). Under `_lock`."""
        return k not in held and k not in self._no_room and k not in self._failed and not self.cache.present(k)

    def _leads_alone(self, lead: int, held) -> bool:
        """Whether the shard the rank reads first (`lead`; nothing read yet of this list) downloads
        alone: where the rank has none of it, its first batch waits for it, and the shards fetched
        beside it would share the link with it (3 at once: its first batch after 3.1 shard-times,
        docs/benchmarks.md "Training from a bucket"). Alone until its files are asked for
        (`_asked_for`): the next shards' own manifests and requests then take the round trips its
        files take to come, and the link is not left idle between them; with `lead_lands_first`
        (`Tuning.lead_lands_first`) until it is in the cache: the link all its own, idle for a
        round trip after it. Not where it failed or found no room: those are fetched when read."""
        return (self.lead_lands_first or lead not in self._asked) and self._to_fetch(lead, held)

    def _asked_for(self, k: int) -> None:
        """The cache asked for shard `k`'s files (`ShardCache.on_files`): if it led alone, the next
        shards start."""
        with self._lock:
            self._asked.add(k)
            lead = next((w.shard for w in self._wanted), None)
        if k == lead:
            self._top_up()

    def _fetch_ahead(self, k: int) -> None:
        try:
            if self.cache.ensure_if_room(k) is None:
                with self._lock:
                    self._no_room.add(k)
        except (StoreError, OSError) as e:  # said when the shard is needed (ensure raises there)
            log.debug("gpufeed: fetching %s ahead failed: %s", self.cache.manifest.shards[k]["name"], e)
            with self._lock:
                self._failed.add(k)
        self._top_up()

    def places(self) -> dict[int, int]:
        """Each wanted shard's place in the order the rank reads them (its first)."""
        with self._lock:
            places: dict[int, int] = {}
            for w in self._wanted:
                places.setdefault(w.shard, len(places))
            return places

    def close(self) -> None:
        """Start no more downloads, and wait for those under way (the cache's folder stays)."""
        with self._lock:
            self._closed = True  # a fetch ahead, or a plan made late (`follow_next`), starts no more
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.cache.order == self.places:  # the cache evicts by use alone again
            self.cache.order = dict
        if self.cache.on_files == self._asked_for:
            self.cache.on_files = lambda k: None
