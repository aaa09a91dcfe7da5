"""`pack(..., engine="ray")` on a local Ray cluster started here: same store as a local pack,
dead tasks retried, a part that keeps failing fails the pack with its files and leaves nothing."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gpufeed
from conftest import jpeg_bytes, save, smooth
from gpufeed.cli import main
from gpufeed.packing import worker

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def source(tmp_path):
    """Two classes of 40 images in all (so more than one task), PNGs and JPEGs, and one corrupt file."""
    root = tmp_path / "src"
    for k in range(40):
        cls = "a" if k % 2 else "b"
        if k % 3:
            save(root / cls / f"{k:03d}.png", smooth(k, 30 + k, 50))
        else:
            (root / cls).mkdir(parents=True, exist_ok=True)
            (root / cls / f"{k:03d}.jpg").write_bytes(jpeg_bytes(smooth(k, 40, 30 + k), quality=90))
    (root / "a" / "999.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return root


def _same_store(a, b) -> None:
    sa, sb = gpufeed.open(a), gpufeed.open(b)
    assert len(sa) == len(sb) == 40 and sa.classes == sb.classes
    assert sa.labels.tolist() == sb.labels.tolist()
    assert sa.manifest.skipped == sb.manifest.skipped and len(sa.manifest.skipped) == 1
    if sa.mode == "raw":
        assert np.array_equal(np.asarray(sa.images), np.asarray(sb.images))
    else:
        assert np.array_equal(np.asarray(sa.offsets), np.asarray(sb.offsets))
        assert np.array_equal(np.asarray(sa.data), np.asarray(sb.data))
        assert np.array_equal(np.asarray(sa.shapes), np.asarray(sb.shapes))
    assert gpufeed.verify(b).ok


@pytest.mark.parametrize("mode", ["raw", "jpeg"])
def test_ray_pack_equals_local_pack(cluster, source, tmp_path, mode):
    gpufeed.pack(source, tmp_path / "local", mode=mode, size=24, workers=2, progress=False)
    report = gpufeed.pack(source, tmp_path / "ray", mode=mode, size=24, engine="ray", progress=False)
    assert report.workers == 2 and report.count == 40
    assert gpufeed.open(tmp_path / "ray").manifest.settings["engine"] == "ray"
    _same_store(tmp_path / "local", tmp_path / "ray")


def test_cli_engine_ray(cluster, source, tmp_path, capsys):
    assert main(["pack", str(source), str(tmp_path / "s"), "--size", "16", "--engine", "ray"]) == 0
    assert "packed 40 images" in capsys.readouterr().out


def test_a_dead_worker_is_retried(cluster, source, tmp_path, monkeypatch):
    marker = str(tmp_path / "died-once")
    real = worker.process

    def dies_once(chunk, s):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return real(chunk, s)
        os._exit(1)  # the worker process dies in the middle of its first task

    monkeypatch.setattr(worker, "process", dies_once)
    gpufeed.pack(source, tmp_path / "ray", size=24, engine="ray", progress=False)
    monkeypatch.undo()
    assert os.path.exists(marker)
    gpufeed.pack(source, tmp_path / "local", size=24, workers=1, progress=False)
    _same_store(tmp_path / "local", tmp_path / "ray")


def test_a_part_that_keeps_failing_fails_the_pack_and_leaves_nothing(cluster, source, tmp_path, monkeypatch):
    def always_fails(chunk, s):
        raise RuntimeError("decoder exploded")

    monkeypatch.setattr(worker, "process", always_fails)
    with pytest.raises(gpufeed.PackError, match=r"packing failed on \d+ file\(s\): \S+/a/001\.png, .* and \d+ more: RuntimeError: decoder exploded"):
        gpufeed.pack(source, tmp_path / "ray", size=24, engine="ray", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_unknown_engine_is_refused(source, tmp_path):
    with pytest.raises(ValueError, match="engine must be one of"):
        gpufeed.pack(source, tmp_path / "s", engine="dask", progress=False)
    assert not (tmp_path / "s").exists()


def test_tar_shards_travel_to_ray_tasks(cluster, tmp_path):
    """Tar members are read here and their bytes sent with the task: the workers need no shards."""
    from test_sources import write_shard

    samples = [(f"k{i}", {"jpg": jpeg_bytes(smooth(i, 40, 50), quality=90), "cls": str(i % 3).encode()})
               for i in range(36)]
    write_shard(tmp_path / "s-000.tar", samples[:20])
    write_shard(tmp_path / "s-001.tar", samples[20:])
    for engine in ("local", "ray"):
        gpufeed.pack(str(tmp_path / "s-*.tar"), tmp_path / engine, mode="jpeg", workers=2, engine=engine,
                     progress=False)
    a, b = gpufeed.open(tmp_path / "local"), gpufeed.open(tmp_path / "ray")
    assert len(a) == len(b) == 36 and a.labels.tolist() == b.labels.tolist()
    assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
