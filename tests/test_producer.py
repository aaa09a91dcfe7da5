"""The producer threads' hand-offs (`loader.producer`) and the slots they take turns on
(`transfer.ring.Turns`), with stand-in batches: no store, no decoder."""

from __future__ import annotations

import threading
import time

import torch

from gpufeed.loader.batch import Batch
from gpufeed.loader.producer import Made, NextEpoch, Production, threaded
from gpufeed.loader.stats import Stats
from gpufeed.transfer.ring import PinnedRing, Turns


def _batch(number: int) -> Made:
    return Made(Batch(torch.full((1,), number), torch.zeros(1, dtype=torch.int64), None), None)


def test_a_slot_taken_is_not_handed_out_again_before_it_is_released():
    """A producer that fell behind still fills its slot: another, gone round the ring, waits for it
    (it was handed the same slot at once, and both wrote into it)."""
    turns = Turns(2)
    assert [turns.acquire(), turns.acquire()] == [0, 1]
    got: list[int] = []
    waiting = threading.Thread(target=lambda: got.append(turns.acquire()))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and got == []  # slot 0 is still being filled
    turns.release(0, None)
    waiting.join(5)
    assert got == [0]
    turns.release(1, None)
    turns.release(0, None)


def test_a_slot_whose_filling_failed_is_given_back():
    """`PinnedRing.filling`: a batch that failed while it filled its slot (a gather or copy that raised)
    gives the slot back at once; the ring's next turn on it does not wait for a copy that never came."""
    ring = PinnedRing(1, (2, 2, 3), 4, pin=False)
    try:
        with ring.filling() as k:
            ring.images[k][:2] = 7
            raise ValueError("a gather failed")
    except ValueError:
        pass
    got: list[int] = []
    taking = threading.Thread(target=lambda: got.append(ring.acquire()), daemon=True)
    taking.start()
    taking.join(5)
    assert got == [0]
    ring.release(0, None)


def test_a_pass_left_early_stops_the_threads_making_its_carried_batches():
    """The threads that make the next epoch's first batches go on after the epoch ended; a pass that
    takes them and is left early stops them too, after the batch each is making (they made all of
    theirs, while the next pass's fresh producers would run beside them)."""
    production = Production(prefetch=2, counters=Stats("test"))
    gate = threading.Event()  # the next epoch's batches after its first wait for it
    made: list[tuple[int, int]] = []
    lock = threading.Lock()

    def make(epoch: int):
        def one(number: int, worker: int) -> Made:
            if epoch == 1 and number > 0:
                gate.wait(10)
            with lock:
                made.append((epoch, number))
            return _batch(number)

        return one

    first = threaded(production, make(0), range(4), 4, workers=2, carry=NextEpoch(1, make(1)))
    assert [int(b.images[0]) for b in first] == [0, 1, 2, 3]
    carried = production.take_carried(1, 0)
    # batches 0 and 2 on the first thread, 1 and 3 on the second
    assert carried is not None and carried.count == 4
    second = threaded(production, make(1), range(4), 4, workers=2, carried=carried)
    assert int(next(second).images[0]) == 0
    threading.Timer(0.2, gate.set).start()  # (after the pass is left: the threads finish the batch they make)
    second.close()
    for t in carried.threads:
        t.join(10)
    assert not any(t.is_alive() for t in carried.threads)
    with lock:
        ahead = sorted(n for e, n in made if e == 1)
    assert ahead == [0, 1, 2], ahead  # batch 3 not begun: its thread was stopped after batch 1


def test_a_consumer_waiting_when_its_producer_fails_after_being_stopped_is_told():
    """A loader closed (its producers stopped) while another thread waits for a batch whose making
    then fails: the waiting thread is told the loader was closed, instead of waiting forever (the
    failure was dropped, nobody being expected to take it)."""
    from gpufeed.loader.producer import Stopped

    production = Production(prefetch=1, counters=Stats("test"))
    making, fail = threading.Event(), threading.Event()

    def make(number: int, worker: int) -> Made:
        making.set()
        fail.wait(10)
        raise RuntimeError("the decoders were stopped under this batch")

    outcome: list[BaseException | None] = []

    def consume() -> None:
        try:
            next(threaded(production, make, range(2), 2))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert making.wait(10)
    production.producers.stop()  # (what close() does first)
    fail.set()
    consumer.join(10)
    assert not consumer.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Stopped)
