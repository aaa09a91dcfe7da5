"""Decoding a crop's region alone on the CPU (nvImageCodec's libjpeg-turbo backend): the same pixels as
the whole decode, the region the resize reads, boxes moved into the region, the same batches."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torchvision.ops import roi_align

import gpufeed
from conftest import decoded, jpeg_bytes, save, smooth
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.decode.codecs import cpu
from gpufeed.decode.codecs import pixels as px
from gpufeed.decode import asks
from gpufeed.decode.scheduling import choice, scheduler
from gpufeed.decode.base import Decoded, Encoded, in_place, into_pixels, nvimgcodec_install
from gpufeed.synth import natural_images

needs_roi = pytest.mark.skipif(not cpu.roi_available(), reason="nvImageCodec not installed (the nvimgcodec-cu* extra)")


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

    monkeypatch.setattr(px, "region", refuse)
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
    monkeypatch.setattr(px, "region", _refuse)
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
    monkeypatch.setattr(px, "region", _refuse)
    assert cpu.roi_problem() == ("RuntimeError: no CPU backend" if cpu.roi_available() else
                                 f"nvImageCodec is not installed ({nvimgcodec_install()})")
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
    regions = asks.crop_regions(shapes, boxes)
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
        regions = asks.crop_regions(shapes, boxes)
        cost = cpu.roi_cost(shapes, regions)
        asked = sched._asks(np.arange(3), shapes, boxes, (224, 224), regions, cost)
        assert asked.regions.tolist() == [[0, 0, 81, 101], [-1] * 4, [-1] * 4] and (asked.reduce_to[:2] == 0).all()
        assert asked.each()[:2] == [(None, (0, 0, 81, 101)), (None, None)]
        factor = 600 / 224  # the 800 x 600 crop is over 2x the output both ways: a DCT-reduced decode
        assert asked.each()[2] == ((int(np.ceil(500 / factor)), int(np.ceil(375 / factor))), None)
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


def test_whole_jpegs_go_to_nvimgcodec_where_it_loads_and_to_pillow_otherwise(monkeypatch, tmp_path):
    """The decode workers and threads alike (`pixels.decode`): nvImageCodec's CPU backend decodes whole
    JPEGs about twice as fast as Pillow, so Pillow takes only what it refuses and what is not a JPEG."""
    by = []

    def whole(data):
        by.append("nvimgcodec")
        return decoded(torch.from_numpy(data)).permute(1, 2, 0).numpy()

    monkeypatch.setattr(px, "whole_by_nvimgcodec", lambda: True)
    monkeypatch.setattr(px, "whole", whole)
    data = _jpeg().numpy()
    image, region, _ = px.decode(data, None, None)
    assert by == ["nvimgcodec"] and region is None and image.shape == (90, 120, 3)
    png = np.frombuffer(save(tmp_path / "x.png", smooth(0, 20, 30)).read_bytes(), np.uint8)
    assert px.decode(png, None, None)[0].shape == (20, 30, 3) and by == ["nvimgcodec"]  # Pillow's
    monkeypatch.setattr(px, "whole", lambda data: _refuse(data, None))  # a JPEG it refuses: Pillow's, the same pixels
    assert np.array_equal(px.decode(data, None, None)[0], decoded(torch.from_numpy(data)).permute(1, 2, 0).numpy())
    monkeypatch.setattr(px, "whole", whole)
    monkeypatch.setattr(px, "whole_by_nvimgcodec", lambda: False)  # not installed: Pillow's, not tried
    px.decode(data, None, None)
    assert by == ["nvimgcodec"]
