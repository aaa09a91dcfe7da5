"""Video stores: packing and the frame index against PyAV's own decode, bad files skipped with the
reason, clips (which frames, one augment draw per clip), seeded order, resume and exactly-once
evaluation clips over ranks. Videos are made here (libx264 through PyAV), each frame's brightness
encoding its index (`synth.natural_video(step=)`)."""

from __future__ import annotations

import csv
import io
import tarfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from gpufeed import Clip, Loader, Store, pack, synth  # noqa: E402
from gpufeed.augment import RandomHorizontalFlip, RandomResizedCrop  # noqa: E402
from gpufeed.decode.tuning import Tuning  # noqa: E402
from gpufeed.sources.videos import index_video  # noqa: E402

STEP = 6  # brightness added per frame index: frame t of a test video is its still image + STEP * t


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos") / "v"
    return synth.make_video_folder(root, per_class=3, classes=2, frames=(18, 30), height=48, width=64, gop=8, step=STEP)


@pytest.fixture(scope="module")
def store(videos: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("store") / "s"
    pack(videos, out, mode="video", progress=False, workers=1)
    return out


def _pyav_frames(path: Path) -> tuple[list[int], list[bool], Fraction]:
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        frames = [(f.pts, f.key_frame) for f in c.decode(stream)]
        tb = Fraction(stream.time_base)
    frames.sort()
    return [p for p, _ in frames], [bool(k) for _, k in frames], tb


def _index_of(frame: torch.Tensor, still: torch.Tensor) -> int:
    """A test frame's index from its brightness over its video's still image (frame 0)."""
    return int(round(float((frame.float() - still.float()).mean()) / STEP))


def test_the_index_is_pyavs_frames_and_timestamps(videos: Path, store: Path):
    s = Store(store)
    files = sorted(videos.rglob("*.mp4"))
    assert len(s) == len(files) == 6
    for i, path in enumerate(files):
        assert s.source(i) == str(path)
        pts, keys, tb = _pyav_frames(path)
        index = s.video(i)
        assert index.pts.tolist() == pts and index.keyframe.tolist() == keys and index.time_base == tb
        assert np.flatnonzero(index.keyframe).tolist() == list(range(0, len(pts), 8))  # gop 8
        assert (index.packet_bytes > 0).all()
        assert s.clip_range(i) == (0, len(pts))
        frames, label = s[i]
        assert frames.shape == (len(pts), 3, 48, 64) and label == i // 3
        assert [_index_of(f, frames[0]) for f in frames] == list(range(len(pts)))
    assert torch.equal(s.frame(-1), s.frame(len(s) - 1))  # (a negative index counts from the end)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _audio_only() -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="matroska") as c:
        stream = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            c.mux(packet)
        for packet in stream.encode(None):
            c.mux(packet)
    return out.getvalue()


def _no_frames() -> bytes:
    """An MP4 with a video stream's header and no frame in it."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as c:
        stream = c.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        c.start_encoding()
    return out.getvalue()


def test_bad_videos_are_skipped_with_the_reason(tmp_path: Path):
    folder = tmp_path / "v" / "a"
    folder.mkdir(parents=True)
    good = synth.encode_video(synth.natural_video(np.random.default_rng(0), 20, 48, 64), gop=8)
    _write(folder / "good.mp4", good)
    _write(folder / "truncated.mp4", good[: len(good) // 2])
    _write(folder / "garbage.mp4", b"\x00not a video" * 100)
    _write(folder / "sound.mkv", _audio_only())
    _write(folder / "empty.mp4", b"")
    _write(folder / "noframes.mp4", _no_frames())
    report = pack(tmp_path / "v", tmp_path / "s", mode="video", progress=False, workers=1)
    assert report.count == 1
    reasons = {Path(s["path"]).name: s["reason"] for s in report.skipped}
    assert set(reasons) == {"truncated.mp4", "garbage.mp4", "sound.mkv", "empty.mp4", "noframes.mp4"}
    assert "no video stream" in reasons["noframes.mp4"] or "no frames" in reasons["noframes.mp4"]
    assert "no video stream" in reasons["sound.mkv"]
    assert "empty file" in reasons["empty.mp4"]
    assert "can open" in reasons["garbage.mp4"] or "damaged" in reasons["garbage.mp4"]
    assert reasons["truncated.mp4"]


def test_a_truncated_stream_is_caught_where_its_container_opens(tmp_path: Path):
    """An MKV cut short still opens (its index is at the front): its lost frames are found by decoding."""
    clip = synth.natural_video(np.random.default_rng(1), 30, 48, 64)
    whole = synth.encode_video(clip, gop=8, container="matroska")
    assert len(index_video(whole)) == 30
    cut = whole[: int(len(whole) * 0.6)]
    try:
        index = index_video(cut)
    except ValueError as e:  # a VideoError: damaged, or packets without frames
        assert str(e)
    else:
        assert len(index) < 30  # what was kept is what decodes: never a frame that isn't there


def test_variable_frame_rate_timestamps_and_fps_clips(tmp_path: Path):
    rng = np.random.default_rng(2)
    still = synth.natural_video(rng, 12, 48, 64, step=STEP)
    ticks = [0, 1, 2, 4, 5, 9, 10, 11, 15, 16, 20, 21]  # in 1/30 s: gaps of 1 to 5 ticks
    folder = tmp_path / "v" / "a"
    folder.mkdir(parents=True)
    _write(folder / "vfr.mkv", synth.encode_video(still, fps=30, gop=4, container="matroska", pts=ticks, crf=12))
    pack(tmp_path / "v", tmp_path / "s", mode="video", progress=False, workers=1)
    s = Store(tmp_path / "s")
    seconds = s.video(0).seconds
    assert np.allclose(seconds, np.array(ticks) / 30, atol=1e-3)
    # 6 frames at 10 fps from the start (evaluation, one clip: centred; the range is 0.7 s, the clip 0.5 s)
    loader = Loader(
        tmp_path / "s",
        batch_size=1,
        device="cpu",
        shuffle=False,
        drop_last=False,
        clip=Clip(frames=6, fps=10, clips_per_video=1),
        fields=["frames"],
    )
    (batch,) = list(loader)
    t0 = 0.1  # (0.7 - 0.5) / 2
    expect = [int(np.searchsorted(seconds, t0 + j / 10 + 1e-9, side="right") - 1) for j in range(6)]
    assert batch["frames"][0].tolist() == expect
    got = [_index_of(f, s[0][0][0]) for f in batch["image"][0]]
    assert got == expect


def test_each_clip_holds_its_frames_at_the_stride(store: Path):
    s = Store(store)
    loader = Loader(
        store, batch_size=4, device="cpu", clip=Clip(frames=5, stride=3), fields=["video", "frames"], drop_last=False
    )
    seen = 0
    for batch in loader:
        clips, videos, frames = batch["image"], batch["video"], batch["frames"]
        assert clips.shape[1:] == (5, 3, 48, 64) and clips.dtype == torch.uint8
        for clip, v, f in zip(clips, videos.tolist(), frames.tolist()):
            assert np.diff(f).tolist() == [3] * 4
            assert f[0] >= 0 and f[-1] < len(s.video(v))
            still = s[v][0][0]
            assert [_index_of(x, still) for x in clip] == f
            seen += 1
    assert seen == len(s)


def test_a_short_video_repeats_its_last_frame(store: Path):
    s = Store(store)
    n = min(len(s.video(i)) for i in range(len(s)))
    loader = Loader(store, batch_size=6, device="cpu", shuffle=False, clip=Clip(frames=n + 4), fields=["frames"])
    frames = next(iter(loader))["frames"]
    shortest = [i for i in range(len(s)) if len(s.video(i)) == n][0]
    assert frames[shortest].tolist() == list(range(n)) + [n - 1] * 4


def test_one_augment_draw_per_clip_and_another_for_each_clip(store: Path):
    ops = [RandomResizedCrop(24, scale=(0.2, 0.6)), RandomHorizontalFlip()]
    loader = Loader(
        store,
        batch_size=6,
        device="cpu",
        clip=Clip(frames=4, stride=2),
        augment=ops,
        dtype=torch.float32,
        fields=["frames"],
        seed=3,
    )
    batch = next(iter(loader))
    clips, frames = batch["image"] * 255, batch["frames"]  # (float output without Normalize: 0..1)
    assert clips.shape == (6, 4, 3, 24, 24)
    firsts = []
    for clip, f in zip(clips, frames.tolist()):
        for t in range(1, 4):
            diff = clip[t] - clip[0]  # the same crop: a uniform brightness step (up to the codec's error)
            assert abs(float(diff.mean()) - STEP * (f[t] - f[0])) < 2.5
            assert float(diff.std()) < 3.0
        firsts.append(clip[0])
    # each clip its own draw: no two clips' first frames alike
    spread = [float((a - b).abs().mean()) for i, a in enumerate(firsts) for b in firsts[i + 1 :]]
    assert min(spread) > 1.0


def _clips(loader: Loader) -> list[tuple[int, int]]:
    return [(v, f[0]) for b in loader for v, f in zip(b["video"].tolist(), b["frames"].tolist())]


def test_clips_are_seeded_per_epoch_and_resume(store: Path):
    def make(seed):
        return Loader(
            store,
            batch_size=2,
            device="cpu",
            clip=Clip(frames=4),
            seed=seed,
            fields=["video", "frames"],
        )

    a, b = make(7), make(7)
    first = _clips(a)
    assert first == _clips(b)
    assert _clips(a) != first  # epoch 1: another order and other clips
    assert _clips(make(8)) != first
    c = make(7)
    it = iter(c)
    taken = next(it)
    state = c.state_dict()
    d = make(7)
    d.load_state_dict(state)
    rest = _clips(d)
    whole = [(v, f[0]) for v, f in zip(taken["video"].tolist(), taken["frames"].tolist())] + rest
    assert whole == first


@pytest.mark.parametrize("workers", [0, 1])
def test_the_next_epochs_first_clips_are_made_as_an_epoch_ends(store: Path, workers: int):
    """An epoch consumed to its end leaves the producers making the next epoch's first batches, on
    both producer threads; the next pass yields them first, the same clips, frames and augment
    draws as a loader that carries nothing."""

    def make(carry: bool) -> Loader:
        ops = [RandomResizedCrop(16), RandomHorizontalFlip()]
        return Loader(
            store,
            batch_size=2,
            device="cpu",
            clip=Clip(frames=4),
            augment=ops,
            seed=5,
            fields=["video", "frames"],
            num_workers=workers,
            prefetch=1,
            tuning=Tuning(carry=carry),
        )

    carrying, plain = make(True), make(False)
    for epoch in range(3):
        got, want = list(carrying), list(plain)
        assert len(got) == len(want) == len(plain)
        for x, y in zip(got, want):
            assert torch.equal(x["video"], y["video"]) and torch.equal(x["frames"], y["frames"])
            assert torch.equal(x["image"], y["image"])
        carried = carrying.carried
        assert carried is not None and carried.epoch == epoch + 1 and plain.carried is None
        carried.join()
        # prefetch 1 on each of the two producer threads: two batches, one made by each
        assert carried.count == 2 and [q.qsize() for q in carried.items] == [1, 1]
    carrying.close()
    plain.close()


def test_decode_processes_run_as_nice_as_asked(store: Path):
    """`Tuning(decode_nice=n)`: the decode processes run n nicer than the loader's process (they yield
    the CPU to the training loop's thread); 10 by default."""
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)
    for nice in (0, 3, 10):
        tuning = Tuning(decode_nice=nice) if nice != 10 else None
        loader = Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4), num_workers=2, tuning=tuning)
        next(iter(loader))
        pids = list(loader.video._processes._processes)  # (the pool's processes, started by the first batch)
        assert len(pids) == 2
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [min(19, base + nice)] * 2
        loader.close()


def _fake_engines(clip, device):
    """Stands in for the GPU's engines (`decode.codecs.nvdec.decode_on_gpu`): the whole video decoded
    with PyAV to RGB (FFmpeg's conversion), the clip's frames taken from it."""
    with av.open(io.BytesIO(bytes(clip.data))) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    return torch.from_numpy(np.stack([frames[int(i)] for i in clip.frames])), False


def _engines_loader(store: Path, monkeypatch, decode, **kw) -> Loader:
    """A CPU Loader whose "nvdec" side decodes with `decode` (the engines are a GPU's: on a CPU device
    the Loader would leave them out)."""
    import gpufeed.loader.video as video

    monkeypatch.setattr(video, "decode_on_gpu", decode)
    made = lambda decoders, device, threads: (video.NvdecSide(2, device, cpu_too=True), None)  # noqa: E731
    monkeypatch.setattr(video, "nvdec_side", made)  # (the Loader takes it from the video module when it is made)
    return Loader(store, batch_size=4, device="cpu", clip=Clip(frames=4, stride=2), fields=["video", "frames"],
                  seed=2, num_workers=1, decoders=("nvdec", "cpu"), **kw)


def test_the_engines_decode_part_of_each_batch_beside_the_processes(store: Path, monkeypatch):
    """With decoders=("nvdec", "cpu") a batch's last clips come from the engines' side, written over
    their places; the batches are those of the CPU alone (the same clips and frames, the pixels within
    the two colour conversions' difference), and both sides' clips and rates are counted."""
    plain = Loader(store, batch_size=4, device="cpu", clip=Clip(frames=4, stride=2), fields=["video", "frames"],
                   seed=2, num_workers=1)
    want = list(plain)
    both = _engines_loader(store, monkeypatch, _fake_engines)
    got = list(both)
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert torch.equal(x["video"], y["video"]) and torch.equal(x["frames"], y["frames"])
        assert (x["image"].float() - y["image"].float()).abs().mean() < 2.0
    side = both.stats()["video"]["nvdec"]
    assert side["threads"] == 2 and side["off"] is None
    assert side["clips"]["gpu"] >= len(got) and side["clips"]["cpu"] >= len(got)  # one a batch at least each
    assert side["clips_per_s"]["gpu"] > 0 and side["clips_per_s"]["cpu"] > 0
    plain.close()
    both.close()


def test_a_failing_engine_is_said_once_and_its_clips_decode_on_the_cpu(store: Path, monkeypatch, caplog):
    def broken(clip, device):
        raise RuntimeError("no engine here")

    want = [b["frames"] for b in Loader(store, batch_size=4, device="cpu", clip=Clip(frames=4, stride=2),
                                          fields=["frames"], seed=2, num_workers=1)]
    loader = _engines_loader(store, monkeypatch, broken)
    with caplog.at_level("WARNING"):
        got = list(loader)
    assert [torch.equal(b["frames"], w) for b, w in zip(got, want)] == [True] * len(want)
    said = [r for r in caplog.records if "NVDEC decoding stopped" in r.getMessage()]
    assert len(said) == 1 and "no engine here" in said[0].getMessage()
    assert loader.stats()["video"]["nvdec"]["off"] == "RuntimeError: no engine here"
    loader.close()


def test_video_decoders_are_checked():
    import gpufeed.loader.video as video

    with pytest.raises(ValueError, match="among 'nvdec' and 'cpu'"):
        video.nvdec_side(("nvjpeg",), torch.device("cpu"), 2)
    side, why = video.nvdec_side(("nvdec", "cpu"), torch.device("cpu"), 2)
    assert side is None and "ignored on a CPU device" in why
    assert video.nvdec_side(None, torch.device("cpu"), 2) == (None, None)


def test_nvdec_alone_on_a_cpu_device_is_refused(store: Path):
    with pytest.raises(ValueError, match="ignored on a CPU device"):
        Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4), decoders=("nvdec",))
    loader = Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4), decoders=("nvdec", "cpu"))
    assert any("nvdec ignored" in n for n in loader.stats()["notes"])
    loader.close()


def test_doctor_times_a_video_store_in_clips_and_says_how_they_decode(store: Path, capsys):
    from gpufeed.cli import main

    assert main(["doctor", str(store), "--device", "cpu", "--limit", "128"]) == 0
    out = capsys.readouterr().out
    assert "gpufeed video store on cpu: " in out and " clips timed" in out and "clips/s)" in out
    assert "gpufeed video decode: " in out and "decode processes (niceness 10)" in out
    assert "frames decoded for each frame a clip holds" in out and "through their containers" not in out


def test_doctor_says_which_videos_decode_through_their_containers(store: Path, tmp_path: Path, capsys):
    from gpufeed.cli import main

    old = _without_packets(store, tmp_path / "old")
    assert main(["doctor", str(old), "--device", "cpu", "--limit", "128"]) == 0
    assert "6 video(s) decoded through their containers" in capsys.readouterr().out


def test_a_pyav_without_metadata_errors_still_opens_videos(videos: Path, monkeypatch):
    """PyAV 19 (Python 3.12 and later) has no `metadata_errors` argument: opening a video with it
    raised TypeError, and every video failed to pack and decode."""
    import gpufeed.sources.videos as sources

    real = av.open

    def open_19(file, mode="r", **kw):
        if "metadata_errors" in kw:
            raise TypeError("open() got an unexpected keyword argument 'metadata_errors'")
        return real(file, mode, **kw)

    monkeypatch.setattr(av, "open", open_19)
    monkeypatch.setattr(sources, "_METADATA_ERRORS", {"metadata_errors": "ignore"})
    first = sorted(videos.rglob("*.mp4"))[0]
    assert len(index_video(first.read_bytes())) > 0
    assert sources._METADATA_ERRORS == {}  # (asked once: later opens go without it)


def test_evaluation_clips_exactly_once_over_ranks(store: Path):
    s = Store(store)
    k = 3
    got = []
    for rank in range(2):
        loader = Loader(
            store,
            batch_size=4,
            device="cpu",
            shuffle=False,
            drop_last=False,
            pad=False,
            rank=rank,
            world_size=2,
            clip=Clip(frames=4, stride=2, clips_per_video=k),
            fields=["video", "frames"],
        )
        got += _clips(loader)
    assert len(got) == len(set(got)) == k * len(s)
    for v in range(len(s)):
        starts = sorted(f for video, f in got if video == v)
        n = len(s.video(v))
        room = n - 7
        assert starts == [0, round(room / 2), room]


@pytest.mark.parametrize("workers", [1, 2])  # (processes: threads would be as many as the machine's cores)
def test_an_evaluations_clips_of_a_video_decode_in_one_pass(store: Path, workers: int):
    """Clips of one video next to each other in a batch whose spans meet are decoded in one pass from
    the first one's keyframe: fewer frames decoded than each clip from its own keyframe, and every
    clip still holds its own frames."""
    from gpufeed.decode.codecs.video import keyframe_before

    s = Store(store)
    loader = Loader(store, batch_size=3, device="cpu", shuffle=False, drop_last=False, num_workers=workers,
                    clip=Clip(frames=4, stride=2, clips_per_video=3), fields=["video", "frames"],
                    tuning=Tuning(carry=False))
    alone = 0  # frames each clip decodes from its own keyframe to its last frame
    for batch in loader:
        for clip, v, f in zip(batch["image"], batch["video"].tolist(), batch["frames"].tolist()):
            assert [_index_of(x, s[v][0][0]) for x in clip] == f
            alone += f[-1] + 1 - keyframe_before(s.video(v).keyframe, f[0])
    video = loader.stats()["video"]
    assert video["frames_delivered"] == 3 * 4 * len(s) and video["frames_decoded"] < alone, (video, alone)
    loader.close()


def test_a_lists_start_and_end_bound_the_clips(videos: Path, tmp_path: Path):
    files = sorted(videos.rglob("*.mp4"))
    with open(tmp_path / "list.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "start", "end"])
        w.writerow([files[0], "a", 0.1, 0.4])  # 30 fps: frames 3..11
        w.writerow([files[1], "b", "", ""])
        w.writerow([files[2], "b", 5.0, 6.0])  # past its end: skipped
    report = pack(tmp_path / "list.csv", tmp_path / "s", mode="video", progress=False, workers=1)
    assert report.count == 2 and "no frame within" in report.skipped[0]["reason"]
    s = Store(tmp_path / "s")
    assert s.clip_range(0) == (3, 12)
    assert s.clip_range(1) == (0, len(s.video(1)))
    loader = Loader(
        tmp_path / "s", batch_size=2, device="cpu", clip=Clip(frames=3, stride=2), fields=["video", "frames"]
    )
    for _ in range(3):
        for b in loader:
            for v, f in zip(b["video"].tolist(), b["frames"].tolist()):
                if v == 0:
                    assert f[0] >= 3 and f[-1] < 12


def test_reencoded_store_short_side_and_gop(videos: Path, tmp_path: Path):
    pack(videos, tmp_path / "s", mode="video", progress=False, workers=1, short_side=32, gop=4, fps=15)
    s = Store(tmp_path / "s")
    assert s.shapes.tolist() == [[32, 42]] * len(s)
    for i in range(len(s)):
        index = s.video(i)
        assert np.flatnonzero(index.keyframe).tolist() == list(range(0, len(index), 4))
        assert np.allclose(np.diff(index.seconds), 1 / 15, atol=2e-3)
    with pytest.raises(ValueError, match="gop"):
        pack(videos, tmp_path / "t", mode="video", gop=0, progress=False)
    with pytest.raises(ValueError, match="re-encode videos"):
        pack(videos, tmp_path / "t", mode="jpeg", short_side=32, progress=False)


def test_tar_shards_of_videos(videos: Path, tmp_path: Path):
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for k, path in enumerate(sorted(videos.rglob("*.mp4"))):
            tar.add(path, arcname=f"{k:04d}.mp4")
            cls = str(k % 2).encode()
            info = tarfile.TarInfo(f"{k:04d}.cls")
            info.size = len(cls)
            tar.addfile(info, io.BytesIO(cls))
        info = tarfile.TarInfo("9999.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    report = pack(tmp_path / "shard.tar", tmp_path / "s", mode="video", progress=False, workers=1)
    assert report.count == 6 and "no video member" in report.skipped[0]["reason"]
    assert Store(tmp_path / "s").labels.tolist() == [0, 1, 0, 1, 0, 1]


def test_clip_arguments_are_checked(store: Path, image_folder: Path, tmp_path: Path):
    for bad in (dict(frames=0), dict(stride=0), dict(fps=-1), dict(clips_per_video=0), dict(layout="TNCHW")):
        with pytest.raises(ValueError):
            Clip(**bad)
    with pytest.raises(ValueError, match="fields"):
        Loader(store, device="cpu", clip=Clip(), fields=["boxes"])
    pack(image_folder, tmp_path / "jpeg", mode="jpeg", progress=False, workers=1)
    with pytest.raises(ValueError, match="video store"):
        Loader(tmp_path / "jpeg", device="cpu", clip=Clip())


def test_the_command_line_packs_and_inspects_videos(videos: Path, tmp_path: Path, capsys):
    from gpufeed.cli import main

    assert main(["pack", str(videos), str(tmp_path / "s"), "--mode", "video", "--gop", "4", "--workers", "1"]) == 0
    assert "packed 6 videos" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "video frames, 48-48 x 64-64 px" in out and "from packets alone: 6 h264" in out
    assert "videos whose unreferenced frames a clip skips: 6 of 6" in out
    assert main(["inspect", str(_without_packets(tmp_path / "s", tmp_path / "old"))]) == 0
    out = capsys.readouterr().out
    assert "every video through its container" in out and "unreferenced frames a clip skips: 6 of 6" in out
    with pytest.raises(SystemExit) as stop:
        main(["pack", str(videos), str(tmp_path / "t"), "--mode", "jpeg", "--gop", "4"])
    assert stop.value.code == 2


def test_the_docs_page_runs(tmp_path: Path, monkeypatch):
    """docs/video.md's Python blocks, in order, on videos made here (batches made smaller)."""
    import re

    page = Path(__file__).parent.parent / "docs" / "video.md"
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    assert len(blocks) == 2
    for split in ("train", "val"):
        synth.make_video_folder(
            tmp_path / "kinetics" / split, per_class=2, classes=2, frames=(20, 24), height=48, width=64, gop=8
        )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, on any machine
    namespace: dict = {}
    for k, block in enumerate(blocks):
        code = block.replace("batch_size=32", "batch_size=2").replace("112", "32").replace("128", "36")
        exec(compile(code, f"docs/video.md python block {k + 1}", "exec"), namespace)
    assert namespace["clips"].shape == (2, 3, 16, 32, 32)
    val = namespace["val"]
    batches = list(val)
    assert sum(len(b["video"]) for b in batches) == 10 * 4 and batches[0]["image"].shape[1:] == (16, 3, 32, 32)


def test_one_decode_pool_per_loader_and_none_left(store: Path):
    """Two producer threads take their first slots at once: one pool of `num_workers` processes is
    started (a race started two), and none is left after close()."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    loader = Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4), num_workers=2)
    next(iter(loader))
    assert len(set(multiprocessing.active_children()) - before) == 2
    loader.close()
    assert not set(multiprocessing.active_children()) - before


def test_a_store_packed_again_is_read_anew(videos: Path, tmp_path: Path):
    """Threads (`num_workers=0`) and processes decode the store their Loader opened: a store packed over
    it is read by the next Loader (threads kept the old file's map by its name), and the Loader it was
    packed under reads its own file to its end, as its memory maps do."""
    out = tmp_path / "s"
    for workers in (0, 1):
        pack(videos, out, mode="video", progress=False, workers=1, overwrite=True)
        first = Loader(out, batch_size=2, device="cpu", clip=Clip(frames=4), num_workers=workers, drop_last=False)
        batches = iter(first)
        assert next(batches)[0].shape[-2:] == (48, 64)
        pack(videos, out, mode="video", progress=False, workers=1, overwrite=True, short_side=32)
        again = Loader(out, batch_size=2, device="cpu", clip=Clip(frames=4), num_workers=workers)
        assert next(iter(again))[0].shape[-2:] == (32, 42)
        assert [tuple(x.shape[-2:]) for x, _ in batches] == [(48, 64)] * 2
        first.close()
        again.close()


def test_a_state_of_other_clips_is_refused(store: Path):
    a = Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4, clips_per_video=3), drop_last=False)
    it = iter(a)
    next(it)
    state = a.state_dict()
    b = Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4), drop_last=False)
    with pytest.raises(ValueError, match="order"):
        b.load_state_dict(state)


def test_odd_frame_sizes_keep_their_size(tmp_path: Path):
    folder = tmp_path / "v" / "a"
    folder.mkdir(parents=True)
    clip = synth.natural_video(np.random.default_rng(3), 12, 48, 64)[:, :47, :63]
    _write(folder / "odd.webm", synth.encode_video(clip, codec="libvpx-vp9", container="webm", gop=4))
    pack(tmp_path / "v", tmp_path / "s", mode="video", progress=False, workers=1)
    assert Store(tmp_path / "s").shapes.tolist() == [[47, 63]]
    loader = Loader(tmp_path / "s", batch_size=1, device="cpu", clip=Clip(frames=3), num_workers=0, fields=["frames"])
    batch = next(iter(loader))
    x, frames = batch["image"], batch["frames"][0]
    assert x.shape == (1, 3, 3, 47, 63)
    ref = Store(tmp_path / "s")[0][0][frames]
    # the loader's conversion (chroma taken per 2x2 block) against FFmpeg's interpolated chroma: 4.5 levels
    # on this small noisy clip, 1.2 on larger ones; a plane put a row or column off would be tens
    assert (x[0].float() - ref.float()).abs().mean() < 6


def test_inspect_grid_shows_a_frame_of_each_video(store: Path, tmp_path: Path):
    from PIL import Image

    from gpufeed.cli import main

    assert main(["inspect", str(store), "--grid", str(tmp_path / "grid.png")]) == 0
    assert Image.open(tmp_path / "grid.png").size[0] > 0


def test_a_hostile_frame_index_is_refused(store: Path, tmp_path: Path):
    import shutil

    from gpufeed import StoreError

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    frames = np.fromfile(copy / "frames.i64", "<i8").reshape(-1, 3)
    frames[0, 1] = 0  # video 0's first frame no keyframe: a seek before it would find none
    frames.tofile(copy / "frames.i64")
    with pytest.raises(StoreError, match="no keyframe"):
        Store(copy)
    frames[0, 1] = 1
    frames[1, 0] = frames[0, 0]  # two frames at one time
    frames.tofile(copy / "frames.i64")
    with pytest.raises(StoreError, match="not later"):
        Store(copy)


def test_reencoding_keeps_a_variable_frame_rate_without_fps(tmp_path: Path):
    from gpufeed.sources.videos import reencode_video

    still = synth.natural_video(np.random.default_rng(4), 12, 48, 64)
    ticks = [0, 1, 2, 4, 5, 9, 10, 11, 15, 16, 20, 21]  # in 1/30 s
    source = synth.encode_video(still, fps=30, gop=4, container="matroska", pts=ticks)
    again = index_video(reencode_video(source, short_side=32, gop=4))
    assert np.allclose(again.seconds * 30, ticks, atol=0.05) and (again.height, again.width) == (32, 42)


def test_what_a_video_loader_does_not_take(store: Path):
    with pytest.raises(ValueError, match="frames"):
        Clip(frames=True)
    with pytest.raises(ValueError, match="decoders"):
        Loader(store, device="cpu", clip=Clip(), decoders=("hw",))
    with pytest.raises(ValueError, match="cache"):
        Loader(store, device="cpu", clip=Clip(), cache="gpu")


def test_stats_say_how_clips_are_decoded_and_what_that_holds(store: Path):
    loader = Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4), num_workers=1)
    assert loader.stats()["video"]["slots"] == 0  # made at the first pass
    next(iter(loader))
    video = loader.stats()["video"]
    assert video["processes"] == 1 and video["threads"] == 0 and video["max_hw"] == (48, 64)
    assert video["slots"] == loader.prefetch + 3 and video["slot_bytes"] == 2 * 4 * 72 * 64  # 4:2:0 planes
    loader.close()


def test_a_clip_decodes_from_the_keyframe_before_it(tmp_path: Path):
    """Each clip seeks to the keyframe at or before its first frame: a clip at a video's end decodes
    one GOP's worth of frames before it at most, not the video from its start."""
    synth.make_video_folder(tmp_path / "v", per_class=1, classes=1, frames=(60, 60), height=48, width=64, gop=8)
    pack(tmp_path / "v", tmp_path / "s", mode="video", progress=False, workers=1)
    for workers in (0, 1):
        loader = Loader(
            tmp_path / "s",
            batch_size=1,
            device="cpu",
            shuffle=False,
            drop_last=False,
            clip=Clip(frames=4, clips_per_video=3),
            fields=["frames"],
            num_workers=workers,
            tuning=Tuning(carry=False),  # (the next epoch's first clips would be decoded and counted too)
        )
        starts = [b["frames"][0, 0].item() for b in loader]
        assert starts == [0, 28, 56]
        video = loader.stats()["video"]
        assert video["frames_delivered"] == 12
        # clips at 0..3, 28..31 (keyframe 24) and 56..59 (keyframe 56): 4 + 8 + 4 frames decoded at
        # most (those of 24..27 that no frame refers to are skipped), the clips' 12 at least
        assert 12 <= video["frames_decoded"] <= 16
        loader.close()


def test_frames_a_clip_does_not_hold_and_none_refers_to_are_not_decoded(tmp_path: Path):
    """`skip_nonref`: a frame outside the clip that no other frame refers to (x264's B-frames) is
    skipped, not decoded: a stride-2 clip decodes fewer frames than lie from its keyframe to its
    last frame, and its frames are those a full decode gives. A Loader passes `Tuning.skip_nonref`
    to its decode processes."""
    from gpufeed.decode.codecs.video import ClipRequest, decode_clip, keyframe_before

    synth.make_video_folder(tmp_path / "v", per_class=1, classes=1, frames=(64, 64), height=64, width=96, gop=32)
    pack(tmp_path / "v", tmp_path / "s", mode="video", progress=False, workers=1)
    s = Store(tmp_path / "s")
    index = s.video(0)
    data = bytes(s.data[int(s.offsets[0]) : int(s.offsets[1])])
    with av.open(io.BytesIO(data)) as c:
        every = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    from gpufeed.decode.codecs import video as codecs

    decoded = spans = 0
    for first in (3, 20, 33):
        wanted = np.arange(first, first + 24, 2)
        counted: list[int] = []
        request = ClipRequest(data, index.pts, index.keyframe, index.stream, wanted, skip_nonref=True)
        got = decode_clip(request)
        assert all(np.array_equal(got[t], every[i]) for t, i in enumerate(wanted))
        decoded += codecs._decode(request, lambda frame, positions: counted.append(frame.pts))
        spans += wanted[-1] + 1 - keyframe_before(index.keyframe, first)
        assert len(counted) == len(wanted)
    # (which frames x264 makes B-frames no frame refers to depends on the content: over three clips)
    assert decoded < spans, (decoded, spans)
    counts = []
    for skip in (False, True):
        loader = Loader(tmp_path / "s", batch_size=1, device="cpu", shuffle=False, drop_last=False, num_workers=1,
                        clip=Clip(frames=12, stride=2, clips_per_video=3),
                        tuning=Tuning(skip_nonref=skip, carry=False))  # (no next epoch's clips counted)
        assert len(list(loader)) == 3
        counts.append(loader.stats()["video"]["frames_decoded"])
        loader.close()
    assert counts[1] < counts[0], counts


def test_a_loader_skips_unreferenced_frames_only_in_the_videos_pack_checked(tmp_path: Path):
    """Pack decodes each H.264 video a second time with the frames it marks unreferenced skipped, and
    keeps whether every other frame came out as the whole decode gave it (nonref.i64,
    `VideoIndex.nonref_exact`). A Loader's default (`Tuning.skip_nonref` None) skips them in those
    videos alone: in a store packed so, as many frames decoded as with `skip_nonref=True`; where the
    store says no video was checked (a store packed before, or checks that failed), every frame, as
    `skip_nonref=False`. The clips are the same pixels each way."""
    import json
    import shutil

    from gpufeed import StoreError
    from gpufeed.sources import videos as sources

    synth.make_video_folder(tmp_path / "v", per_class=2, classes=1, frames=(64, 64), height=64, width=96, gop=32)
    pack(tmp_path / "v", tmp_path / "s", mode="video", progress=False, workers=1)
    s = Store(tmp_path / "s")
    assert [s.video(i).nonref_exact for i in range(len(s))] == [True, True]
    unchecked = tmp_path / "unchecked"  # as if each video's check had failed
    shutil.copytree(tmp_path / "s", unchecked)
    np.zeros(2, "<i8").tofile(unchecked / "nonref.i64")
    before = tmp_path / "before"  # as a gpufeed before the check packed it
    shutil.copytree(tmp_path / "s", before)
    manifest = json.loads((before / "manifest.json").read_text())
    del manifest["files"]["nonref.i64"]
    (before / "nonref.i64").unlink()
    (before / "manifest.json").write_text(json.dumps(manifest))

    def run(path: Path, skip: bool | None) -> tuple[list[torch.Tensor], int]:
        loader = Loader(path, batch_size=2, device="cpu", shuffle=False, drop_last=False, num_workers=1,
                        clip=Clip(frames=12, stride=2, clips_per_video=3),
                        tuning=Tuning(skip_nonref=skip, carry=False))
        clips = [images.clone() for images, _ in loader]
        decoded = loader.stats()["video"]["frames_decoded"]
        loader.close()
        return clips, decoded

    every, whole = run(tmp_path / "s", False)
    trusted, fewer = run(tmp_path / "s", True)
    assert fewer < whole, (fewer, whole)
    for path, expected in ((tmp_path / "s", fewer), (unchecked, whole), (before, whole)):
        clips, decoded = run(path, None)
        assert decoded == expected, (path.name, decoded, expected)
        assert all(torch.equal(a, b) for a, b in zip(clips, every)) and len(clips) == len(every) == 3
    assert all(torch.equal(a, b) for a, b in zip(trusted, every))

    data = bytes(s.data[int(s.offsets[0]) : int(s.offsets[1])])
    digests: dict[int, int] = {}
    with av.open(io.BytesIO(data)) as c:
        for frame in c.decode(video=0):
            digests[frame.pts] = sources._digest(sources._picture(frame))
    assert sources._skips_exactly(av, data, digests)
    changed = dict(digests)
    changed[min(digests)] ^= 1  # a referenced frame (the first, a keyframe) that would come out otherwise
    assert not sources._skips_exactly(av, data, changed)

    np.array([1, 2], "<i8").tofile(unchecked / "nonref.i64")
    with pytest.raises(StoreError, match="nonref.i64: entry 1 is not 0 or 1"):
        Store(unchecked)


def test_more_batches_of_clips_at_once_give_the_same_clips(store: Path):
    """`Tuning.clip_batches`: that many batches decoded at once, a producer thread each and a slot more
    each; the clips and their order are the same. Anything but an int of 1 or more is refused."""

    def clips(batches: int) -> tuple[list[torch.Tensor], int]:
        loader = Loader(store, batch_size=2, device="cpu", num_workers=2, clip=Clip(frames=4, stride=2), seed=3,
                        tuning=Tuning(clip_batches=batches, carry=False))
        out = [images.clone() for _ in range(2) for images, _ in loader]
        slots = loader.stats()["video"]["slots"]
        loader.close()
        return out, slots

    two, two_slots = clips(2)
    three, three_slots = clips(3)
    assert len(two) == len(three) == 6 and all(torch.equal(a, b) for a, b in zip(two, three))
    assert three_slots == two_slots + 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="clip_batches"):
            Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4), tuning=Tuning(clip_batches=bad))


def test_a_lists_columns_are_each_clips_fields(videos: Path, tmp_path: Path):
    files = sorted(videos.rglob("*.mp4"))[:3]
    with open(tmp_path / "list.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "caption", "score"])
        for k, path in enumerate(files):
            w.writerow([path, k % 2, f"video number {k}", k / 4])
    pack(tmp_path / "list.csv", tmp_path / "s", mode="video", progress=False, workers=1)
    assert set(Store(tmp_path / "s").fields) == {"caption", "score"}
    loader = Loader(
        tmp_path / "s",
        batch_size=3,
        device="cpu",
        clip=Clip(frames=2),
        num_workers=0,
        fields=["video", "caption", "score", "source", "label"],
    )
    batch = next(iter(loader))
    videos_ = batch["video"].tolist()
    assert batch["caption"] == [f"video number {v}" for v in videos_]
    assert batch["score"].tolist() == [v / 4 for v in videos_]
    assert batch["source"] == [str(files[v]) for v in videos_] and batch["label"].tolist() == [v % 2 for v in videos_]
    with pytest.raises(ValueError, match="fields"):
        Loader(tmp_path / "s", device="cpu", clip=Clip(), fields=["caption", "boxes"])


def test_a_script_exits_with_its_own_code_and_leaves_no_decode_process(store: Path, tmp_path: Path):
    """An unguarded script that leaves its loop mid-epoch and exits without close(): its exit code, at
    once, and its decode processes end with it."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "train.py"
    script.write_text(
        "import multiprocessing, sys\n"
        "from gpufeed import Clip, Loader\n"
        f"loader = Loader({str(store)!r}, batch_size=2, device='cpu', clip=Clip(frames=4), num_workers=2)\n"
        "for k, (clips, labels) in enumerate(loader):\n"
        "    if k == 1:\n"
        f"        open({str(tmp_path / 'pids')!r}, 'w').write(' '.join(str(p.pid) for p in multiprocessing.active_children()))\n"
        "        sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            break
        time.sleep(0.1)
    assert not alive


def test_slots_sized_for_a_large_frame_are_said_when_the_loader_is_made(store: Path, monkeypatch, caplog):
    from gpufeed.loader import video

    monkeypatch.setattr(video, "SLOTS_WARN", 1000)
    with caplog.at_level("WARNING"):
        loader = Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4), num_workers=0)
    assert "page-locked memory" in caplog.text and "short_side" in caplog.text and "48x64" in caplog.text
    loader.close()


def _demuxed(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """(pts, bytes) of each packet of `data`'s video stream as PyAV demuxes it, and the codec's extradata."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        packets = [(p.pts, bytes(p)) for p in c.demux(stream) if p.size]
        return packets, stream.codec_context.extradata or b""


@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_the_index_says_where_each_packet_and_the_codecs_parameters_lie(container: str):
    still = synth.natural_video(np.random.default_rng(2), 20, 48, 64, step=STEP)
    data = synth.encode_video(still, gop=8, container=container)
    index = index_video(data)
    assert index.codec == "h264" and index.packet_at is not None
    packets, extradata = _demuxed(data)
    at = dict(zip(index.pts.tolist(), index.packet_at.tolist()))
    assert len(packets) == len(index) and extradata
    for pts, payload in packets:  # (Matroska's lie a few bytes past the demuxer's position, its block's header)
        assert data[at[pts] : at[pts] + len(payload)] == payload
    start, length = index.extradata
    assert data[start : start + length] == extradata
    assert sorted(at.values()) == [at[pts] for pts, _ in packets]  # file order is decode order


def test_a_codec_not_decoded_from_its_packets_alone_is_indexed_without_them():
    still = synth.natural_video(np.random.default_rng(2), 12, 48, 64)
    try:
        data = synth.encode_video(still, codec="mpeg4", gop=4)
    except av.FFmpegError:
        pytest.skip("this FFmpeg has no MPEG-4 part 2 encoder")
    index = index_video(data)  # (MPEG-4 part 2 decoded alone did not give its container's frames)
    assert index.codec == "mpeg4" and index.packet_at is None


def test_a_range_only_the_container_declares_keeps_the_video_decoding_through_it():
    """A full range the Matroska container declares (its Colour element) and the H.264 stream does not
    never reaches a decoder fed the packets alone: its pixels came out limited-range where the
    container's decode gave full-range ones. Such a video is indexed without its packets' offsets."""
    from gpufeed.decode.codecs.video import ClipRequest, decode_clip

    frames = synth.natural_video(np.random.default_rng(2), 8, 48, 64)
    out = io.BytesIO()
    with av.open(out, mode="w", format="matroska") as sink:
        stream = sink.add_stream("libx264", rate=30)
        stream.height, stream.width, stream.pix_fmt = 48, 64, "yuv420p"
        stream.codec_context.color_range = 2  # declared full range: the container says so
        stream.options = {"g": "4", "x264-params": "fullrange=off"}  # the bitstream does not
        for t, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = t
            for packet in stream.encode(frame):
                sink.mux(packet)
        for packet in stream.encode(None):
            sink.mux(packet)
    data = out.getvalue()
    index = index_video(data)
    assert index.codec == "h264" and index.packet_at is None
    plain = decode_clip(ClipRequest(data, index.pts, index.keyframe, index.stream, np.arange(4)))
    assert plain.shape == (4, 48, 64, 3)


def test_a_clip_decodes_from_its_packets_without_opening_its_container(store: Path):
    """The clip's packets are read where the index says and decoded alone: with the file's first bytes
    (MP4's ftyp box, the mdat's header) zeroed, no container opens, yet the clip's frames are those
    its container gives."""
    from gpufeed.decode.codecs.video import ClipRequest, VideoError, decode_clip
    from gpufeed.loader.video import clip_packets

    s = Store(store)
    index = s.video(0)
    data = bytes(s.data[int(s.offsets[0]) : int(s.offsets[1])])
    assert index.packet_at is not None and index.packet_at.min() >= 40
    wanted = np.arange(9, 17, 2)
    plain = ClipRequest(data, index.pts, index.keyframe, index.stream, wanted)
    expected = decode_clip(plain)
    broken = b"\0" * 40 + data[40:]
    with pytest.raises(VideoError):
        decode_clip(ClipRequest(broken, index.pts, index.keyframe, index.stream, wanted))
    alone = ClipRequest(broken, index.pts, index.keyframe, index.stream, wanted, packets=clip_packets(index, 8, 15))
    assert np.array_equal(decode_clip(alone), expected)


def _without_packets(store: Path, copy: Path) -> Path:
    """A copy of `store` as a gpufeed before the packet index packed it: no packets.i64, no decoding.i64."""
    import json
    import shutil

    shutil.copytree(store, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for name in ("packets.i64", "decoding.i64"):
        del manifest["files"][name]
        (copy / name).unlink()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _all_clips(path: Path, workers: int) -> tuple[list[torch.Tensor], dict]:
    loader = Loader(path, batch_size=2, device="cpu", shuffle=False, drop_last=False, num_workers=workers,
                    clip=Clip(frames=5, stride=2, clips_per_video=2), tuning=Tuning(carry=False))
    clips = [images.clone() for images, _ in loader]
    stats = loader.stats()["video"]
    loader.close()
    return clips, stats


def test_a_store_packed_before_the_packet_index_decodes_through_containers_and_says_so(
    store: Path, tmp_path: Path, caplog
):
    old = _without_packets(store, tmp_path / "old")
    for workers in (0, 1):
        new_clips, new_stats = _all_clips(store, workers)
        with caplog.at_level("WARNING"):
            old_clips, old_stats = _all_clips(old, workers)
        assert new_stats["through_container"] == 0 and old_stats["through_container"] == 6
        assert "6 of 6 videos decode through their containers" in caplog.text and "pack it again" in caplog.text
        assert len(new_clips) == len(old_clips) == 6
        assert all(torch.equal(a, b) for a, b in zip(new_clips, old_clips))
        caplog.clear()


def test_a_hostile_packet_index_is_refused(store: Path, tmp_path: Path):
    import shutil

    from gpufeed import StoreError

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    packets = np.fromfile(copy / "packets.i64", "<i8")
    packets[3] = int(np.fromfile(copy / "offsets.i64", "<i8")[1])  # past video 0's bytes
    packets.tofile(copy / "packets.i64")
    with pytest.raises(StoreError, match="packets.i64.*not within its video"):
        Store(copy)
    packets[3] = (1 << 63) - 8  # an offset whose end would wrap around
    packets.tofile(copy / "packets.i64")
    with pytest.raises(StoreError, match="packets.i64.*not within its video"):
        Store(copy)
    shutil.copy(store / "packets.i64", copy / "packets.i64")
    decoding = np.fromfile(copy / "decoding.i64", "<i8").reshape(-1, 3)
    decoding[1, 0] = 99  # no such decoder
    decoding.tofile(copy / "decoding.i64")
    with pytest.raises(StoreError, match="decoding.i64.*not a decoder"):
        Store(copy)
    decoding[1] = [-1, 0, 0]  # through its container, yet its packets' offsets are given
    decoding.tofile(copy / "decoding.i64")
    with pytest.raises(StoreError, match="packets.i64"):
        Store(copy)


@pytest.mark.parametrize("why", ["extradata", "no decoder"])
def test_packets_that_do_not_decode_alone_are_decoded_through_the_container_and_said_once(
    store: Path, tmp_path: Path, caplog, monkeypatch, why: str
):
    import shutil

    from gpufeed.decode.codecs import video as codecs

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    if why == "extradata":
        decoding = np.fromfile(copy / "decoding.i64", "<i8").reshape(-1, 3)
        decoding[:, 1:] = [0, 16]  # the codec's parameters said to be the file's first bytes: not H.264's
        decoding.tofile(copy / "decoding.i64")
    else:  # a store packed where PyAV had the decoder, read where it has not (dav1d, say)
        from av.codec.codec import UnknownCodecError

        def missing(av_module, request):
            raise UnknownCodecError(request.packets.decoder)
            yield  # (a generator, as the real one)

        monkeypatch.setattr(codecs, "_own_packets", missing)
    codecs._said.clear()
    expected, _ = _all_clips(store, 0)
    with caplog.at_level("WARNING"):
        got, stats = _all_clips(copy, 0)  # (threads of this process: their message is caplog's)
    assert stats["through_container"] == 0 and len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert caplog.text.count("did not decode without their container") == 1


def test_frame_rows_past_the_last_video_are_no_video_s(store: Path, tmp_path: Path):
    """frames.i64 rows after the last video's (no video's frames) are not checked as a video's packets:
    they broke the packets' check with a numpy error instead of opening."""
    import json
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for name, row in (("frames.i64", [10**6, 0, 5]), ("packets.i64", [-1])):
        with open(copy / name, "ab") as f:
            f.write(np.asarray(row, "<i8").tobytes())
        manifest["files"][name]["bytes"] += 8 * len(row)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    s = Store(copy)
    assert len(s) == len(Store(store)) and s.video(0).packet_at is not None


def test_a_video_s_clips_going_back_are_not_decoded_in_one_pass(store: Path):
    """Clips of one video next to each other share a pass only forward: a clip before the pass's first
    keyframe would make it decode everything from there."""
    from gpufeed.loader.video import ClipBatch

    loader = Loader(store, batch_size=2, device="cpu", clip=Clip(frames=4, stride=2, clips_per_video=2), num_workers=1)
    v = max(range(len(loader.store)), key=lambda i: len(loader.store.video(i)))  # (a 28- or 29-frame video)
    index = loader.store.video(v)
    assert len(index) >= 26

    def jobs(*clips):
        batch = ClipBatch(np.array([v] * len(clips)), np.array(clips), (index,) * len(clips))
        return loader.video._jobs(batch, list(range(len(clips))))

    assert len(jobs([0, 2, 4, 6], [6, 8, 10, 12])) == 1  # forward, spans meeting: one pass
    assert len(jobs([18, 20, 22, 24], [0, 2, 4, 6])) == 2  # back to frame 0: a pass each
    assert len(jobs([0, 2, 4, 6], [18, 20, 22, 24])) == 2  # keyframe 16 past the pass's last frame, 6
    loader.close()


def test_a_torchcodec_built_without_cuda_is_named_before_any_clip(monkeypatch):
    """PyPI's TorchCodec wheels are CPU builds ("+cpu"): NVDEC is said to be unavailable, with the build
    and where a CUDA one comes from, when the Loader is made (it failed at the first clip with
    "Unsupported device: cuda", and the CUDA tests failed instead of skipping)."""
    import sys
    import types

    from gpufeed.decode.codecs.nvdec import NvdecUnavailable, open_torchcodec

    package, decoders = types.ModuleType("torchcodec"), types.ModuleType("torchcodec.decoders")
    decoders.VideoDecoder, decoders.set_cuda_backend = object, object
    package.decoders = decoders
    for version, fine in (("0.11.1+cpu", False), ("0.11.1+cu130", True), ("0.11.1", True)):
        package.__version__ = version
        monkeypatch.setitem(sys.modules, "torchcodec", package)
        monkeypatch.setitem(sys.modules, "torchcodec.decoders", decoders)
        if fine:
            assert open_torchcodec() == (object, object)
        else:
            with pytest.raises(NvdecUnavailable, match=r"TorchCodec 0\.11\.1\+cpu is built without CUDA: install"):
                open_torchcodec()
