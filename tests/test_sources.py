"""Every source kind, and every pixel mode Pillow can hand us, becomes the right RGB sample."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from conftest import pixels, save


def pack_open(src, tmp_path, **kw):
    kw.setdefault("size", 32)
    kw.setdefault("workers", 1)
    gpufeed.pack(src, tmp_path / "store", progress=False, **kw)
    return gpufeed.open(tmp_path / "store")


def same(image: torch.Tensor, array: np.ndarray) -> bool:
    return torch.equal(image.permute(1, 2, 0), torch.from_numpy(array))


def test_flat_folder_is_unlabelled(tmp_path):
    for i in range(3):
        save(tmp_path / "flat" / f"{i}.png", pixels(i, 32, 32))
    store = pack_open(tmp_path / "flat", tmp_path)
    assert store.labels.tolist() == [-1, -1, -1] and store.classes == []
    assert all(same(store[i][0], pixels(i, 32, 32)) for i in range(3))


def test_image_folder_recurses_inside_classes(tmp_path):
    save(tmp_path / "f" / "b" / "deep" / "x.png", pixels(1, 32, 32))
    save(tmp_path / "f" / "a" / "y.png", pixels(0, 32, 32))
    store = pack_open(tmp_path / "f", tmp_path)
    assert store.classes == ["a", "b"] and store.labels.tolist() == [0, 1]


def test_csv_with_header_and_class_names(tmp_path):
    save(tmp_path / "img" / "0.png", pixels(0, 32, 32))
    save(tmp_path / "img" / "1.png", pixels(1, 32, 32))
    (tmp_path / "list.csv").write_text("path,label\nimg/1.png,zebra\nimg/0.png,ant\n")
    store = pack_open(tmp_path / "list.csv", tmp_path)
    assert store.classes == ["ant", "zebra"] and store.labels.tolist() == [1, 0]
    assert same(store[0][0], pixels(1, 32, 32))


def test_csv_int_labels_and_malformed_row(tmp_path):
    save(tmp_path / "0.png", pixels(0, 32, 32))
    (tmp_path / "list.csv").write_text(f"0.png,7\n,\n{tmp_path / '0.png'},3\n")
    store = pack_open(tmp_path / "list.csv", tmp_path)
    assert store.labels.tolist() == [7, 3] and store.classes == []
    assert [s["reason"] for s in store.manifest.skipped] == ["malformed row (need path,label)"]


def test_jsonl(tmp_path):
    save(tmp_path / "0.png", pixels(0, 32, 32))
    rows = [{"path": "0.png", "label": 4}, {"path": "0.png"}, "not an object"]
    (tmp_path / "list.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = pack_open(tmp_path / "list.jsonl", tmp_path)
    assert store.labels.tolist() == [4, -1] and len(store.manifest.skipped) == 1


def _png(index: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels(index, 32, 32)).save(buf, format="PNG")
    return buf.getvalue()


def write_shard(path, samples, gz=False):
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_tar_shards_by_glob(tmp_path):
    write_shard(tmp_path / "s-000.tar", [("a/k0", {"png": _png(0), "cls": b"3"}), ("a/k1", {"png": _png(1)})])
    write_shard(tmp_path / "s-001.tar.gz", [("k2", {"png": _png(2), "cls": b"5", "json": b"{}"}),
                                            ("k3", {"txt": b"no image"})], gz=True)
    store = pack_open(str(tmp_path / "s-*"), tmp_path)
    assert store.labels.tolist() == [3, -1, 5]
    assert all(same(store[i][0], pixels(i, 32, 32)) for i in range(3))
    assert store.manifest.skipped[0]["path"].endswith("s-001.tar.gz:k3")
    assert [store.source(i) for i in range(3)] == [f"{tmp_path}/s-000.tar:a/k0", f"{tmp_path}/s-000.tar:a/k1",
                                                   f"{tmp_path}/s-001.tar.gz:k2"]


def test_truncated_tar_keeps_what_came_before(tmp_path):
    write_shard(tmp_path / "s.tar", [(f"k{i}", {"png": _png(i), "cls": b"1"}) for i in range(3)])
    with tarfile.open(tmp_path / "s.tar") as tar:
        last = tar.getmember("k2.png")
    data = (tmp_path / "s.tar").read_bytes()
    (tmp_path / "s.tar").write_bytes(data[: last.offset_data + last.size // 2])
    store = pack_open(tmp_path / "s.tar", tmp_path)
    assert len(store) == 2
    assert "unreadable tar shard" in store.manifest.skipped[-1]["reason"]


@pytest.mark.parametrize("make, expected", [
    (lambda: Image.fromarray(np.full((32, 32), 77, np.uint8)), (77, 77, 77)),
    (lambda: Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).quantize(4), (90, 90, 90)),
    (lambda: Image.fromarray(np.zeros((32, 32, 4), np.uint8)), (255, 255, 255)),  # transparent -> white
    (lambda: Image.fromarray(np.full((32, 32), 51400, np.uint16)), (200, 200, 200)),  # 16-bit
])
def test_modes_become_rgb(tmp_path, make, expected):
    (tmp_path / "src").mkdir()
    make().save(tmp_path / "src" / "x.png")
    store = pack_open(tmp_path / "src", tmp_path)
    assert store[0][0][:, 5, 5].tolist() == list(expected)


def test_cmyk_jpeg(tmp_path):
    (tmp_path / "src").mkdir()
    Image.new("CMYK", (32, 32), (0, 255, 255, 0)).save(tmp_path / "src" / "x.jpg", quality=95)
    r, g, b = pack_open(tmp_path / "src", tmp_path)[0][0][:, 16, 16].tolist()
    assert r > 200 and g < 60 and b < 60


def test_exif_orientation_applied(tmp_path):
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = 255  # left half white
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 CW on display: white goes to the top
    (tmp_path / "src").mkdir()
    img.save(tmp_path / "src" / "x.jpg", exif=exif, quality=95)
    image = pack_open(tmp_path / "src", tmp_path, fit="stretch")[0][0]
    assert image[0, 2, 16] > 200 and image[0, 29, 16] < 50
