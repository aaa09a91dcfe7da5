"""Decoding a crop's region alone on the CPU (nvImageCodec's libjpeg-turbo backend): the same pixels as
the whole decode, the region the resize reads, boxes moved into the region, the same batches."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torchvision.ops import roi_align

import gpufeed
from gpufeed.decode.tuning import Tuning
from conftest import decoded, jpeg_bytes, save, smooth
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.decode import choice, cpu, scheduler, shares
from gpufeed.decode.base import Decoded, Encoded, in_place, into_pixels
from gpufeed.decode.steering import Steering
from gpufeed.synth import natural_images

needs_roi = pytest.mark.skipif(not cpu.roi_available(), reason="nvImageCodec not installed (the [nvimgcodec] extra)")


def _jpeg(h: int = 90, w: int = 120) -> torch.Tensor:
    return torch.frombuffer(bytearray(jpeg_bytes(natural_images(1, h, w)[0], quality=90)), dtype=torch.uint8)


@needs_roi
@pytest.mark.parametrize("region", [(0, 0, 8, 8), (13, 27, 71, 101), (40, 3, 90, 120), (1, 1, 89, 119)])
def test_a_region_is_the_crop_of_the_whole_decode(region):
    data = _jpeg()
    whole = decoded(data).permute(1, 2, 0)
    pixels, got, _ = cpu.decode_one(data, None, region)
    assert got == region and pixels.is_contiguous()
    assert torch.equal(pixels, whole[region[0] : region[2], region[1] : region[3]])


def test_a_region_that_cannot_be_decoded_alone_is_decoded_whole(monkeypatch, tmp_path):
    def refuse(data, region):
        raise RuntimeError("refused")

    monkeypatch.setattr(cpu, "_region", refuse)
    data = _jpeg()
    pixels, region, _ = cpu.decode_one(data, None, (0, 0, 8, 8))
    assert region is None and torch.equal(pixels, decoded(data).permute(1, 2, 0))
    png = torch.frombuffer(bytearray(save(tmp_path / "x.png", smooth(0, 20, 30)).read_bytes()), dtype=torch.uint8)
    pixels, region, _ = cpu.decode_one(png, None, (0, 0, 8, 8))  # not a JPEG at all: Pillow, whole
    assert region is None and pixels.shape == (20, 30, 3)


def _refuse(data, region):
    raise RuntimeError("no CPU backend")


def test_regions_decoded_whole_are_counted_and_said_once(monkeypatch, caplog):
    monkeypatch.setattr(scheduler, "roi_available", lambda: True)
    monkeypatch.setattr(choice, "_warned", set())
    monkeypatch.setattr(cpu, "_region", _refuse)
    datas = [_jpeg() for _ in range(3)]
    offsets = np.cumsum([0] + [len(d) for d in datas])
    batch = Encoded.of(torch.cat(datas), offsets, np.arange(3))
    shapes = np.array([[90, 120]] * 3)
    boxes = np.array([[0, 0, 20, 16], [0, 0, 120, 90], [10, 5, 40, 30]], float)  # cheap, whole image, cheap
    sched = scheduler.Scheduler(torch.device("cpu"), 1)
    try:
        with caplog.at_level(logging.WARNING, logger="gpufeed"):
            for _ in range(2):
                parts, failed = sched.run(batch, shapes, boxes, (16, 16), pin=False)
                assert not failed and (parts[0][0].regions == -1).all()
        assert sched.counts["cpu_whole"] == 4 and sched.counts["cpu"] == 6  # two regions asked per batch
        assert caplog.text.count("refused them (`gpufeed doctor` says why)") == 1
    finally:
        sched.close()


def test_roi_problem_says_why(monkeypatch):
    if cpu.roi_available():
        assert cpu.roi_problem() is None
    monkeypatch.setattr(cpu, "_region", _refuse)
    assert cpu.roi_problem() == ("RuntimeError: no CPU backend" if cpu.roi_available() else
                                 "nvImageCodec is not installed (pip install 'gpufeed[nvimgcodec]')")
    monkeypatch.setattr(cpu, "roi_available", lambda: False)
    assert "not installed" in cpu.roi_problem()


def test_a_dct_reduction_takes_precedence_over_the_region():
    pixels, region, _ = cpu.decode_one(_jpeg(), (60, 45), (0, 0, 8, 8))
    assert region is None and pixels.shape == (45, 60, 3)


def test_regions_hold_every_pixel_the_resize_reads():
    """roi_align (the resize kernel's math) of boxes in the region equals that of the whole image."""
    rng = np.random.default_rng(0)
    h, w = 90, 120
    image = torch.from_numpy(natural_images(1, h, w)[0]).permute(2, 0, 1).float()[None]
    x0, y0 = rng.uniform(0, w - 2, 64), rng.uniform(0, h - 2, 64)
    boxes = np.stack([x0, y0, rng.uniform(x0 + 1, w), rng.uniform(y0 + 1, h)], 1)
    boxes[:8] = np.round(boxes[:8])  # integer boxes too, as RandomResizedCrop plans them
    boxes[8] = (0, 0, w, h)
    shapes = np.tile([h, w], (64, 1))
    regions = shares.crop_regions(shapes, boxes)
    assert (regions[:, :2] >= 0).all() and (regions[:, 2:] <= shapes).all()
    for box, region in zip(boxes, regions.tolist()):
        crop = image[:, :, region[0] : region[2], region[1] : region[3]]
        part = Decoded(crop, np.zeros(1, np.int64), np.array([crop.shape[2:]]), np.zeros((1, 3), np.int64),
                       regions=np.array([region]))
        moved = into_pixels(box[None], shapes[:1], part)
        for out in ((7, 9), (24, 24), (200, 150)):  # down- and upscaling: different sampling grids
            want = roi_align(image, [torch.tensor(box[None], dtype=torch.float32)], out, aligned=True)
            got = roi_align(crop, [torch.tensor(moved, dtype=torch.float32)], out, aligned=True)
            torch.testing.assert_close(got, want, atol=0.01, rtol=0)  # 0-255: float rounding only


def test_boxes_into_dct_reduced_pixels_and_regions():
    shapes = np.array([[100, 200], [100, 200]])
    boxes = np.array([[20.0, 10.0, 120.0, 60.0]] * 2)
    part = Decoded(torch.empty(0), np.zeros(2, np.int64), np.array([[50, 100], [60, 110]]), np.zeros((2, 3)),
                   regions=np.array([[-1, -1, -1, -1], [5, 15, 65, 125]]))
    assert into_pixels(boxes, shapes, part).tolist() == [[10, 5, 60, 30], [5, 5, 105, 55]]


def test_the_cpu_asks_for_a_region_only_where_it_is_cheaper(monkeypatch):
    monkeypatch.setattr(scheduler, "roi_available", lambda: True)
    sched = scheduler.Scheduler(torch.device("cpu"), 1)
    try:
        shapes = np.array([[375, 500]] * 3)
        boxes = np.array([[0, 0, 100, 80], [0, 0, 500, 375], [0, 0, 800, 600]], float)  # small, whole, ...
        regions = shares.crop_regions(shapes, boxes)
        cost = cpu.roi_cost(shapes, regions)
        asks = sched._asks(np.arange(3), shapes, boxes, (224, 224), regions, cost)
        assert asks.regions.tolist() == [[0, 0, 81, 101], [-1] * 4, [-1] * 4] and (asks.reduce_to[:2] == 0).all()
        assert asks.each()[:2] == [(None, (0, 0, 81, 101)), (None, None)]
        factor = 600 / 224  # the 800 x 600 crop is over 2x the output both ways: a DCT-reduced decode
        assert asks.each()[2] == ((int(np.ceil(500 / factor)), int(np.ceil(375 / factor))), None)
        assert cost[0] < 0.3 < 1 < cost[1]
    finally:
        sched.close()


@needs_roi
def test_batches_with_regions_match_whole_decodes(tmp_path, monkeypatch):
    for i, im in enumerate(natural_images(24, 90, 120, seed=3)):
        save(tmp_path / "src" / f"c{i % 2}" / f"{i:03d}.png", im)
    gpufeed.pack(tmp_path / "src", tmp_path / "s", mode="jpeg", quality=90, workers=1, progress=False)
    ops = [RandomResizedCrop(32), RandomHorizontalFlip(), Normalize()]

    def batches(processes: int) -> list:
        with gpufeed.Loader(tmp_path / "s", batch_size=8, device="cpu", augment=ops, dtype=torch.float32, seed=2,
                            num_workers=processes) as loader:
            return [(x.clone(), y.clone()) for x, y in loader]

    with_regions = batches(2)
    monkeypatch.setattr(scheduler, "roi_available", lambda: False)
    whole = batches(2)
    assert len(with_regions) == len(whole) == 3
    for (a, la), (b, lb) in zip(with_regions, whole):
        assert torch.equal(la, lb)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def _four_jpegs() -> tuple[Encoded, np.ndarray, np.ndarray]:
    """A batch of four 90x120 JPEGs, their shapes and whole-image crop boxes."""
    datas = [_jpeg() for _ in range(4)]
    batch = Encoded.of(torch.cat(datas), np.cumsum([0] + [len(d) for d in datas]), np.arange(4))
    return batch, np.array([[90, 120]] * 4), np.array([[0, 0, 120, 90]] * 4, float)


def _as_on_a_gpu(s: scheduler.Scheduler) -> scheduler.Scheduler:
    """`s` as on a GPU: one GPU decoder, `hw` (the test stands in for its calls by patching
    `Scheduler._timed`), and set rates."""
    s.gpu, s._streams, s.steering = [SimpleNamespace(name="hw")], {"hw": None}, Steering(["hw"], cpu_share=True)
    s.steering.rates.update(hw=1000.0, cpu=1000.0)
    s.steering.gpu_rate = 1000.0
    return s


def _on_the_cpu(s: scheduler.Scheduler, part_batch: Encoded):
    """What a stand-in GPU decoder returns: `part_batch` decoded by the scheduler's CPU decoder."""
    return s.cpu.collect(s.cpu.submit(part_batch, None), torch.device("cpu"), False)


def test_pipelines_sharing_a_turn_never_decode_on_the_gpu_at_once(monkeypatch):
    """Two pipelines' schedulers with a shared `gpu_turn`: their GPU decodes take turns (the CPU share
    and the rest overlap), and without it they do run at once; either way every image is decoded."""
    import threading
    import time

    batch, shapes, boxes = _four_jpegs()

    def overlap(turn) -> int:
        active, most = [0], [0]
        lock = threading.Lock()

        def fake_gpu(self, dec, part_batch, part_shapes, stream):  # stands in for a GPU decoder's call
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            time.sleep(0.05)
            with lock:
                active[0] -= 1
            return _on_the_cpu(self, part_batch), 0.05

        monkeypatch.setattr(scheduler.Scheduler, "_timed", fake_gpu)
        scheds = [_as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 1, gpu_turn=turn)) for _ in range(2)]
        results = []
        threads = [threading.Thread(target=lambda s=s: [results.append(s.run(batch, shapes, boxes, (16, 16), False))
                                                        for _ in range(3)]) for s in scheds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in scheds:
            s.close()
        assert len(results) == 6 and all(not failed and sum(len(p) for _, p in parts) == 4 for parts, failed in results)
        return most[0]

    assert overlap(threading.Lock()) == 1
    assert overlap(None) == 2


def test_a_started_batchs_gpu_share_decodes_on_a_helper_while_the_caller_goes_on(monkeypatch):
    """`start` returns while the GPU share decodes on the scheduler's helper thread; `finish` waits for
    it and counts the caller's wait apart from the decode; `drop` waits for a dropped batch's share."""
    import threading

    batch, shapes, boxes = _four_jpegs()
    release, threads = threading.Event(), []

    def fake_gpu(self, dec, part_batch, part_shapes, stream):  # stands in for a GPU decoder's call
        threads.append(threading.current_thread())
        assert release.wait(10)
        return _on_the_cpu(self, part_batch), 0.01

    monkeypatch.setattr(scheduler.Scheduler, "_timed", fake_gpu)
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 1))
    started = s.start(batch, shapes, boxes, (16, 16))  # the fake decoder holds: start returned anyway
    assert started.gpu_job is not None and not started.gpu_job.done()
    release.set()
    parts, failed = s.finish(started, pin=False)
    assert not failed and sorted(np.concatenate([p for _, p in parts]).tolist()) == [0, 1, 2, 3]
    assert threads and threads[0] is not threading.current_thread()
    assert s.counts["hw"] == 2 and s.counts["cpu"] == 2
    assert s.seconds["hw"] == pytest.approx(0.01) and s.seconds["gpu"] > 0 and "gpu_wait" in s.seconds
    dropped = s.start(batch, shapes, boxes, (16, 16))
    s.drop(dropped)
    assert dropped.gpu_job.done()
    calls, shares = len(threads), s.steering.shares
    s.steering.shares = lambda n, threads: [0, n]  # the CPU has the whole batch: no helper thread woken
    empty = s.start(batch, shapes, boxes, (16, 16))
    parts, failed = s.finish(empty, pin=False)
    assert empty.gpu_job is None and len(threads) == calls and s.counts["cpu"] == 6
    assert sorted(parts[-1][1].tolist()) == [0, 1, 2, 3] and not failed
    s.steering.shares = shares
    s.tuning = Tuning(gpu_early=False)  # the share decoded in `finish`, on the caller's thread
    s.steering.rates["cpu"], calls = 1.0, len(threads)  # a slow CPU: the GPU decoder gets all but one image
    parts, failed = s.finish(s.start(batch, shapes, boxes, (16, 16)), pin=False)
    assert not failed and len(threads) == calls + 1 and threads[-1] is threading.current_thread()
    s.close()


def test_a_dropped_batchs_failed_gpu_share_is_not_raised(monkeypatch):
    def broken_gpu(self, dec, part_batch, part_shapes, stream):
        raise RuntimeError("the GPU decoder failed")

    batch, shapes, boxes = _four_jpegs()
    monkeypatch.setattr(scheduler.Scheduler, "_timed", broken_gpu)
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 1))
    s.drop(s.start(batch, shapes, boxes, (16, 16)))  # no error: nobody asked for these pixels
    with pytest.raises(RuntimeError, match="the GPU decoder failed"):  # a batch finished says it
        s.finish(s.start(batch, shapes, boxes, (16, 16)), pin=False)
    s.close()


def test_the_cpu_rate_is_its_images_over_its_decoding_seconds(monkeypatch):
    """The CPU's measured rate is per thread (or worker) while it decodes: workers that become ready
    while a share decodes do not dilute it, nor does the time the share waits to be collected."""
    batch, shapes, boxes = _four_jpegs()
    monkeypatch.setattr(scheduler.Scheduler, "_timed", lambda self, dec, part_batch, part_shapes, stream:
                        (_on_the_cpu(self, part_batch), 0.01))
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 2))
    s.steering.rates["cpu"] = 1e6  # the CPU takes the whole batch
    started = s.start(batch, shapes, boxes, (16, 16))
    assert len(started.cpu_pos) == 4
    s.cpu.threads = 12  # as if ten more workers became ready meanwhile
    parts, failed = s.finish(started, pin=False)
    images, seconds = s.steering._spent["cpu"]
    assert not failed and images == 4 and 0 < seconds == s.cpu.busy_seconds
    s.close()


def test_the_cpu_rate_leaves_out_the_images_a_gpu_decoder_rejected(monkeypatch):
    """Images a GPU decoder rejects are decoded on the CPU too, in the same batch: their seconds are
    not the CPU share's, so the CPU's rate is measured on its share's images and seconds alone."""
    batch, shapes, boxes = _four_jpegs()

    def rejecting(self, dec, part_batch, part_shapes, stream):  # a GPU decoder refusing its first image
        images = [decoded(d) for d in part_batch.tensors()]
        return in_place(images[1:], {0: "CMYK"}), 0.01

    monkeypatch.setattr(scheduler.Scheduler, "_timed", rejecting)
    s = _as_on_a_gpu(scheduler.Scheduler(torch.device("cpu"), 2))
    started = s.start(batch, shapes, boxes, (16, 16))
    cpu_share = len(started.cpu_pos)
    assert 0 < cpu_share < 4  # the GPU decoder has a share of the first batch
    parts, failed = s.finish(started, pin=False)
    images, seconds = s.steering._spent["cpu"]
    assert not failed and s.counts["cpu_fallback"] == 1 and images == cpu_share
    assert 0 < seconds == s.cpu.last_busy < s.cpu.busy_seconds  # the retry's seconds are left out
    s.close()


def test_images_in_place_are_addressed_from_the_shapes_the_store_records():
    """A GPU decoder's contiguous CHW images are laid out from the stored shapes (no per-image sizes
    read); an image of another size than recorded, or a view, is read from the tensor itself."""
    shapes = np.array([[4, 6], [5, 3], [2, 2]])
    images = [torch.arange(3 * h * w, dtype=torch.uint8).reshape(3, h, w) for h, w in shapes.tolist()]
    for failed in ({}, {1: "refused"}):
        kept = [images[k] for k in range(3) if k not in failed]
        part = in_place(kept, failed, shapes)
        want = in_place(kept, failed)  # every size and stride read from the tensors
        assert np.array_equal(part.sizes, want.sizes) and np.array_equal(part.strides, want.strides)
        assert np.array_equal(part.offsets, want.offsets) and part.failed == failed
    lying = in_place(images, {}, np.array([[4, 6], [3, 5], [1, 4]]))  # same element counts, one is wrong
    assert lying.sizes.tolist() == [[4, 6], [3, 5], [1, 4]]  # trusted: the element counts match
    other = in_place(images, {}, np.array([[4, 6], [5, 3], [3, 3]]))  # not what the decoder made
    assert other.sizes.tolist() == shapes.tolist()
    view = [images[0], images[1][:, :, :2], images[2]]
    got = in_place(view, {}, np.array([[4, 6], [5, 2], [2, 2]]))  # right sizes, but a strided view
    assert got.strides[1].tolist() == [15, 3, 1] and got.sizes.tolist() == [[4, 6], [5, 2], [2, 2]]
