"""The steering rule (`decode/scheduling/steering.py`): the CPU's and GPU decoders' shares of a batch,
steered by what the training loop and the producer wait for and by the loop's own time per batch."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import gpufeed
from conftest import save, smooth
from gpufeed.augment import RandomResizedCrop
from gpufeed.decode import Scheduler
from gpufeed.decode.scheduling.steering import Pace, Steering
from gpufeed.decode.tuning import Tuning

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("steer")
    for i in range(8):
        save(root / "src" / f"c{i % 2}" / f"{i:03d}.png", smooth(i, 40, 60))
    gpufeed.pack(root / "src", root / "store", mode="jpeg", quality=95, workers=1, progress=False)
    return gpufeed.open(root / "store")


def test_cpu_share_follows_the_decoders_asked_for():
    scheduler = Scheduler(CPU, 1, ("nvjpeg",))
    assert not scheduler.gpu and scheduler.steering.cpu_share  # no GPU here: the CPU decodes everything anyway
    assert scheduler.shares(10) == [10]
    scheduler.close()
    steering = Steering(["nvjpeg"], cpu_share=False)  # as on a GPU
    steering.rates.update(nvjpeg=1000.0, cpu=1000.0)
    assert steering.shares(11, 1) == [11, 0]  # the CPU only decodes what the GPU decoder rejects
    steering.cpu_share = True
    steering.gpu_rate = 1000.0
    assert steering.shares(10, 1) == [5, 5]


def test_cpu_share_is_set_against_the_gpu_decoders_together():
    steering = Steering(["hw", "nvjpeg"], cpu_share=True)
    steering.rates.update(hw=3000.0, nvjpeg=1000.0, cpu=500.0)
    steering.gpu_rate = 2000.0  # together, slower than their own rates add up to
    assert steering.shares(100, 1) == [60, 20, 20]
    steering.gpu_rate = 4000.0
    assert steering.shares(9, 1) == [6, 2, 1]
    steering.cpu_share = False
    assert steering.shares(7, 1) == [5, 2, 0]


def test_a_next_pipeline_starts_from_the_rates_a_closed_one_measured():
    """A closed pipeline's measured rates (each decoder's, and its GPU decoders' together) are where the
    process's next pipeline starts: its first batch is split so the two sides finish together at those
    rates, not at the start rates. Nothing measured is nothing carried; `forget` starts afresh."""
    from gpufeed.decode.scheduling import steering as module

    fresh = Steering(["hw"], cpu_share=True)
    assert fresh.rates == {"hw": 15_000.0, "cpu": module.CPU_START_RATE} and fresh.gpu_rate == 15_000.0
    fresh.learn()  # nothing measured: nothing carried
    assert Steering(["hw"], cpu_share=True).rates == fresh.rates

    first = Steering(["hw"], cpu_share=True)
    first.measured("cpu", 64, 0.1)  # 640 images/s a worker
    first.measured("hw", 192, 0.016)  # 12,000
    first.gpu_done(192, 0.02)
    together = first.gpu_rate
    assert fresh.shares(256, 14) == [200, 56]  # the start rates: the engines 78 % of a batch
    first.learn()
    after = Steering([], cpu_share=True)  # a next pipeline: the CPU's rate first, the GPU decoders' as they open
    assert after.rates["cpu"] == pytest.approx(640.0)
    after.use_gpu(["hw"])
    assert after.rates["hw"] == pytest.approx(12_000.0) and after.gpu_rate == pytest.approx(together)
    gpu, cpu = after.shares(256, 14)
    assert gpu == round(256 * together / (640.0 * 14 + together)) and gpu + cpu == 256 and gpu < 200
    assert Steering(["hw", "nvjpeg"], cpu_share=True).gpu_rate == pytest.approx(12_000.0 + 10_000.0)  # another set
    after.measured("cpu", 64, 0.2)  # measuring goes on from the carried averages
    assert after.rates["cpu"] == pytest.approx((0.7 * 64 + 0.3 * 64) / (0.7 * 0.1 + 0.3 * 0.2))
    older = Steering(["hw"], cpu_share=True)  # carries the engines' 12,000 and measures only the CPU
    newer = Steering(["hw"], cpu_share=True)
    newer.measured("hw", 200, 0.01)
    newer.learn()
    older.measured("cpu", 64, 0.1)
    older.learn()  # closes last: what it only carried is not written back over the newer measurement
    assert Steering(["hw"], cpu_share=True).rates["hw"] == pytest.approx(
        (0.7 * 192 + 0.3 * 200) / (0.7 * 0.016 + 0.3 * 0.01)
    )
    module.forget()
    assert Steering(["hw"], cpu_share=True).rates == fresh.rates


def test_the_gpu_part_is_steered_by_what_the_loop_and_the_producer_wait_for():
    """The first batches are split so that the CPU and the GPU decoders finish together; after, the
    GPU's part goes up while the training loop starves and the producer waits on the CPU more than on
    the GPU, down otherwise; GPU shares under GPU_MIN_SHARE go to the CPU."""
    steering = Steering(["hw"], cpu_share=True)
    steering.rates.update(hw=3000.0, cpu=500.0)
    steering.gpu_rate = 3000.0
    assert steering.shares(100, 2) == [75, 25]  # nothing made yet: both finish together

    def steer(starved=0.0, cpu_wait=0.0, gpu_wait=0.0):
        steering.cpu_wait, steering.gpu_wait = cpu_wait, gpu_wait
        steering.steer(Pace(starved, 0.02), 2, 100)
        return steering.gpu_part

    steering.steer(None, 2, 100)  # the first batch: nothing known
    assert steering.gpu_part is None
    assert steer() == pytest.approx(0.75)  # then the part that finishes together
    assert steer(0.015, cpu_wait=0.004, gpu_wait=0.001) == pytest.approx(0.8)  # starved, waiting on the CPU
    assert steer(0.015, cpu_wait=0.001, gpu_wait=0.004) == pytest.approx(0.75)  # starved, waiting on the GPU
    assert steer(0.001, cpu_wait=0.004) == pytest.approx(0.7)  # the loop waited a little: less to the GPU
    for _ in range(9):  # the loop is fed: the CPU takes more and more
        steer()
    assert steering.gpu_part == pytest.approx(0.25) and steering.shares(100, 2) == [25, 75]
    steer()
    assert steering.shares(100, 2) == [0, 100]  # under GPU_MIN_SHARE: the CPU takes those too
    for _ in range(30):
        steer()
    assert steering.gpu_part == 0.0
    steering.gpu_part, steering.rates["cpu"] = 0.9, 1.0  # a slow CPU still gets an image per thread,
    assert steering.shares(100, 2) == [90, 10]
    steering.gpu_part = 1.0  # so its rate is measured again (a misestimate does not stick)
    assert steering.shares(100, 2) == [98, 2]
    steering.rates["cpu"] = 500.0
    steering.measured("cpu", 10, 0.001)  # rates average images and seconds apart: a short interval counts little
    steering.measured("cpu", 10, 0.1)
    assert steering.rates["cpu"] == pytest.approx(10 / (0.7 * 0.001 + 0.3 * 0.1))



def test_the_gpu_part_is_never_below_what_the_cpu_cannot_decode_in_the_loops_time():
    """Where the loop's time per batch is known (`Pace.step`), the GPU's part is at least what the CPU
    cannot decode in it at its measured rate (none under GPU_MIN_SHARE), however little the loop waited
    (its queue of batches ahead hides a CPU that falls behind), and no more than the part for which both
    finish together. The loop's time is the median of its last steps, so its warm-up does not count."""
    steering = Steering(["hw"], cpu_share=True)
    steering.rates.update(hw=3000.0, cpu=500.0)
    steering.gpu_rate = 3000.0

    def steer(step, starved=0.0):
        steering.steer(Pace(starved, 0.02, step), 2, 100)
        return steering.gpu_part

    assert steer(2.0) == pytest.approx(0.75)  # the first: both finish together (no more than that after)
    for _ in range(20):  # 2 threads at 500 images/s decode 50 images in 0.05 s: the GPU the other half
        steer(0.05)
    assert steering.step == pytest.approx(0.05) and steering.gpu_part == pytest.approx(0.5)
    assert steering.shares(100, 2) == [50, 50]
    steering.gpu_wait = 0.004
    assert steer(0.05, starved=0.015) == pytest.approx(0.5)  # starved, the producer waiting on the GPU
    steering.cpu_wait = 0.004
    assert steer(0.05, starved=0.015) == pytest.approx(0.55)  # ... on the CPU: more, as before
    assert steer(0.05) == pytest.approx(0.5)  # then down to the CPU's limit, not below
    for _ in range(8):  # a slower loop: 2 threads decode 80 of 100 images in 0.08 s, 20 % is under
        steer(0.08)  # GPU_MIN_SHARE, so the part falls by GPU_STEP a batch
    for _ in range(20):
        steer(0.08)
    assert steering.gpu_part == 0.0 and steering.shares(100, 2) == [0, 100]
    for _ in range(8):  # no model: the loop takes batches at once, and both finish together
        steer(0.0001)
    assert steering.gpu_part == pytest.approx(0.75)
    steering.cpu_share = False  # the CPU decodes only what the GPU decoders reject: nothing to steer
    steering.gpu_part = None
    steer(0.0001)
    assert steering.gpu_part is None


def test_the_loop_s_own_time_per_batch_reaches_the_steering(store):
    """`Pace.step`: the seconds the consumer spends between taking a batch and asking for the next
    ("consumer" in `loader.stats()`), per batch, since the producer's last batch."""
    loader = gpufeed.Loader(store, batch_size=2, device="cpu", augment=[RandomResizedCrop(8)], num_workers=0,
                            prefetch=1)  # the producer makes batches while the consumer takes them
    steering = loader.jpeg.pipelines[0].scheduler.steering
    for _ in loader:
        time.sleep(0.03)
    stats = loader.stats()
    assert stats["seconds"]["consumer"] >= 0.03 * (len(loader) - 1)
    assert steering.step is not None and steering.step >= 0.02
    loader.close()


def _run(steering: Steering, batches: int, pace_for) -> list[bool]:
    """Make `batches` batches of 100 on 2 CPU threads: each started with `shares`, then the loop's pace
    while it decodes from `pace_for(gpu_share)` (the producer waiting on the CPU where the loop
    starved); whether each batch had a GPU share."""
    used = []
    for _ in range(batches):
        gpu = steering.shares(100, 2)[0] > 0
        used.append(gpu)
        pace = pace_for(gpu)
        steering.cpu_wait = pace.starved
        steering.steer(pace, 2, 100)
    return used


def _loop(gpu_step, gpu_cycle, cpu_step, cpu_cycle):
    """A loop whose own time and the producer's cycle per batch (seconds) depend on whether the GPU
    decoders worked beside it; the loop waits where the producer is slower, the producer where the loop is."""

    def pace(gpu: bool) -> Pace:
        step, cycle = (gpu_step, gpu_cycle) if gpu else (cpu_step, cpu_cycle)
        interval = max(step, cycle)
        return Pace(starved=interval - step, interval=interval, step=step, full=interval - cycle)

    return pace


def _engines(**tuning) -> Steering:
    steering = Steering(["hw"], cpu_share=True, tuning=Tuning(**tuning))
    steering.rates.update(hw=20000.0, cpu=2000.0)
    steering.gpu_rate = 20000.0
    return steering


def test_gpu_decoders_that_cost_the_loop_more_than_they_save_are_left_idle():
    """Beside a launch-bound model the engines' work slows each step (21 ms to 27 ms) more than the CPU
    alone falls behind (25 ms a batch). The loop starves on the CPU alone, so the part steered by its
    waits brings the engines in again and again; after a window of the CPU alone, it decodes
    everything, and it is tried against the engines less and less often while that stays the answer."""
    steering = _engines()
    used = _run(steering, 600, _loop(gpu_step=0.027, gpu_cycle=0.015, cpu_step=0.021, cpu_cycle=0.025))
    assert any(used[:32])  # the engines at work at first (the loop starved while the workers started)
    assert steering.cost.decided[0][1]  # the first window of the CPU alone won
    assert sum(used[-300:]) < 0.1 * 300  # then the CPU alone, but for short windows with the engines
    gaps = np.diff([made for made, _ in steering.cost.decided])
    assert all(later >= earlier for earlier, later in zip(gaps, gaps[1:])) and gaps[-1] > 4 * gaps[0]


def test_gpu_decoders_that_save_more_than_they_cost_keep_their_part():
    """Few cores: the CPU alone takes 30 ms a batch, the engines slow the loop from 20.5 to 21 ms: they
    stay, taking the batches the part steered by the loop's waits gives them, as without the check
    (`cost_check=False`), but for the windows of the CPU alone."""
    pace = _loop(gpu_step=0.021, gpu_cycle=0.015, cpu_step=0.0205, cpu_cycle=0.030)
    steering = _engines()
    used = _run(steering, 400, pace)
    assert steering.cost.decided and not any(benched for _, benched in steering.cost.decided)
    unchecked = _engines(cost_check=False)
    alone = _run(unchecked, 400, pace)
    assert unchecked.cost is None and sum(used[-200:]) >= sum(alone[-200:]) - 12 > 50


def test_with_no_model_the_gpu_decoders_are_never_left_idle():
    """The loader alone (an evaluation pass, a benchmark of the loader): the loop takes each batch at
    once, so the engines' cost to it never decides the pace: no window of the CPU alone is tried."""
    steering = _engines()
    used = _run(steering, 300, _loop(gpu_step=0.0002, gpu_cycle=0.010, cpu_step=0.0001, cpu_cycle=0.025))
    assert not steering.cost.decided and all(used[5:])


def test_the_cpu_alone_gives_way_once_the_loop_needs_the_gpu_decoders():
    """A model that gets faster (or a CPU that gets slower) mid-run: after the engines were left idle,
    a window with them is tried once the loader is the slower side, and they come back where they win."""
    steering = _engines()
    _run(steering, 200, _loop(gpu_step=0.027, gpu_cycle=0.015, cpu_step=0.021, cpu_cycle=0.025))
    assert steering.cost.benched
    used = _run(steering, 600, _loop(gpu_step=0.012, gpu_cycle=0.013, cpu_step=0.011, cpu_cycle=0.022))
    assert not steering.cost.benched and sum(used[-100:]) > 80
