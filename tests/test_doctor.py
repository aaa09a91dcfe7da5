"""`gpufeed doctor` names a planted bottleneck, covers every target kind, and writes a trace."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

import gpufeed
from gpufeed.cli import main
from gpufeed.decode.codecs import cpu
from gpufeed.doctor import diagnose
from gpufeed.doctor import stages
from gpufeed.synth import make_image_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("doctor") / "images", per_class=8, classes=2)


def bottleneck(report: dict) -> str:
    line = next(row for row in report["table"].splitlines() if "<- bottleneck" in row)
    return line.split("  ")[0].strip()


def test_planted_slow_decode_is_named(folder, monkeypatch):
    real = stages.decode

    def slow(data):  # far above any other stage's time per image, even on a loaded 2-core machine
        time.sleep(0.06)
        return real(data)

    monkeypatch.setattr(stages, "decode", slow)
    report = diagnose(str(folder), device="cpu", limit=16)
    assert bottleneck(report) == "decode"
    assert any(f.startswith("decode is") and "pack to a raw store" in f for f in report["findings"])
    assert report["images"] == 16 and report["seconds_per_1000"]["decode"] > 30


def test_slow_user_iterable_is_named():
    report = diagnose("slow_iterable:batches", device="cpu", limit=256)
    assert bottleneck(report) == "produce batch (your iterable)"
    assert any("your iterable takes" in f for f in report["findings"])
    assert report["facts"]["dtype"] == "float32"


def test_store_target_reports_loader_stages_and_tier(folder, tmp_path):
    gpufeed.pack(folder, tmp_path / "s", size=64, workers=1, progress=False)
    report = diagnose(str(tmp_path / "s"), device="cpu", limit=128)
    assert {"gather", "augment"} <= set(report["seconds_per_1000"])
    assert any(line.startswith("gpufeed tier: ") for line in report["gpufeed"])
    assert "CPU JPEG decode: in worker processes" in report["gpufeed"]  # Linux: forkserver and /dev/shm
    regions = next(line for line in report["gpufeed"] if line.startswith("CPU JPEG decode of crop regions alone: "))
    assert ("available" in regions) if cpu.roi_available() else ("unavailable" in regions)


def test_a_jpeg_store_target_says_how_fast_the_cpu_workers_decode(folder, tmp_path):
    gpufeed.pack(folder, tmp_path / "j", mode="jpeg", workers=1, progress=False)
    report = diagnose(str(tmp_path / "j"), device="cpu", limit=128)
    assert report["facts"]["cpu_workers"] >= 1 and report["facts"]["cpu_worker_rate"] > 0
    assert any(line.startswith("gpufeed CPU decode: ") and "img/s each" in line for line in report["gpufeed"])


def test_trace_has_the_stage_ranges(folder, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["doctor", str(folder), "--device", "cpu", "--limit", "8", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "<- bottleneck" in out and "trace written" in out
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"doctor.read bytes", "doctor.decode", "doctor.transform", "doctor.collate"} <= names


def test_bad_targets(tmp_path):
    assert main(["doctor", str(tmp_path / "missing")]) == 1
    assert main(["doctor", "no_such_module:fn"]) == 1


def test_model_step_and_its_finding():
    """The model step (run on a GPU by doctor) times the step and compares the data stages with it."""
    import torch

    from gpufeed.doctor.report import MODEL, findings, table

    t = stages.Timings("image folder", images=4, seconds={"decode": 1.0})
    stages.model_step(t, [torch.rand(2, 3, 32, 32), torch.rand(2, 3, 32, 32)], "cpu")
    assert t.seconds[MODEL] > 0
    t.seconds[MODEL] = 0.1  # data 10x slower than the model: the GPU would starve
    assert any("10.0x the model step" in f for f in findings(t, gpu=True))
    text = table(t)
    assert "for scale" in text and text.index("<- bottleneck") < text.index("for scale")


def test_a_folder_with_a_non_image_and_a_symlink_loop_is_diagnosed(tmp_path, capsys):
    """What `gpufeed pack` skips, doctor skips too, naming each file and why."""
    root = make_image_folder(tmp_path / "images", per_class=4, classes=2)
    bad = root / "class_000" / "notes.jpg"
    bad.write_text("not an image")
    loop = root / "class_001" / "loop.jpg"
    loop.symlink_to(loop)
    report = diagnose(str(root), device="cpu", limit=64)
    assert report["images"] == 8
    skipped = report["facts"].get("skipped", {})
    assert str(bad) in skipped and "UnidentifiedImageError" in skipped[str(bad)], skipped
    assert str(loop) in skipped and "Too many levels of symbolic links" in skipped[str(loop)], skipped
    assert any(line.startswith("skipped 2 file(s) that are not readable images") for line in report["gpufeed"])
    assert main(["doctor", str(root), "--device", "cpu"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_folder_of_no_images_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jpg").write_text("text")
    assert main(["doctor", str(tmp_path), "--device", "cpu"]) == 1
    assert "none of 1 files could be read as an image" in capsys.readouterr().err


def test_a_host_whose_hypervisor_takes_its_cpus_is_said_to(monkeypatch):
    """Steal (a virtual CPU ready to run while the hypervisor runs another guest) slows whatever is
    measured: the doctor says how much of the host's CPU time went so, from 2 % on."""
    readings = iter([(100, 10_000), (150, 11_000), (100, 10_000), (105, 11_000)])
    monkeypatch.setattr(stages, "host_steal", lambda: next(readings))
    report = diagnose(None, device="cpu")
    assert report["facts"]["host_steal_share"] == pytest.approx(0.05)
    assert any("5% of this host's CPU time to others" in f for f in report["findings"])
    report = diagnose(None, device="cpu")
    assert report["facts"]["host_steal_share"] == pytest.approx(0.005)
    assert not any("steal" in f for f in report["findings"])


def test_host_steal_reads_this_hosts_clock_ticks():
    steal, total = stages.host_steal()
    assert 0 <= steal <= total and (total > 0 or not Path("/proc/stat").exists())


@pytest.mark.parametrize("target, says", [
    ("json:dumps", "json:dumps: it needs arguments"),
    ("math:pi", "math:pi: pi is a float, not a function"),
    ("time:time", "time:time: it returned a float, not an iterable"),
    ("os:getcwd", "os:getcwd: it yielded a str, not an (images, labels) batch"),
])
def test_a_target_that_makes_no_batches_is_a_clear_error(target, says, capsys):
    assert main(["doctor", target, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gpufeed doctor: error: {says}") and err.count("\n") == 1, err
    assert "module:function" in err


def test_a_module_in_the_current_folder_is_found_as_python_m_finds_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "doctor_here.py").write_text("import torch\n\ndef batches():\n    for _ in range(2):\n"
                                             "        yield torch.zeros(2, 3, 4, 4), torch.zeros(2)\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    # as the console script runs: its own folder on sys.path, not the current one
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "doctor_here", raising=False)
    assert main(["doctor", "doctor_here:batches", "--device", "cpu"]) == 0
    assert "your iterable doctor_here:batches on cpu: 4 images timed" in capsys.readouterr().out
    assert str(tmp_path) not in sys.path  # put there for the import only
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.delitem(sys.modules, "doctor_here", raising=False)
    assert main(["doctor", "doctor_here:batches", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "No module named 'doctor_here'" in err and f"not in the current folder ({tmp_path / 'elsewhere'})" in err
    assert "PYTHONPATH" in err


def test_limit_and_per_class_must_be_positive(capsys):
    for argv in (["doctor", "--limit", "0"], ["doctor", "--limit", "-3"], ["demo", "--per-class", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "must be a positive whole number" in capsys.readouterr().err, argv


def issue_store_run(**seconds) -> stages.Timings:
    return stages.Timings("gpufeed jpeg store", images=1000, seconds=seconds, facts={"tier": "host", "mode": "jpeg"})


def test_store_advice_follows_the_bottleneck_it_names():
    """The Loader's stages run on threads beside the loop: they overlap, so shares are of the wall time,
    the consumer's wait is no stage to fix, and prefetch is advised only when no loader stage is slowest."""
    from gpufeed.doctor.report import findings, table

    # a CPU run of a jpeg store: the loop waits while the loader's producer resizes
    t = issue_store_run(**{"waiting for data": 92.7, "resize": 78.9, "decode": 2.6, "read": 0.003, "augment": 0.002,
                           "total (wall)": 93.8})
    report = {"table": table(t)}
    assert bottleneck(report) == "resize"
    assert "% of wall" in report["table"] and "overlap" in report["table"]
    row = next(r for r in report["table"].splitlines() if r.startswith("resize"))
    assert "84%" in row  # 78.9 of 93.8 s
    found = findings(t, gpu=False, cuda=False)
    assert any(f.startswith("resize is 84% of the wall time") and "--mode raw" in f for f in found), found
    assert not any("prefetch" in f for f in found), found
    # the loop's own stage is the slowest and it still waits: the batches come unevenly, prefetch helps
    t = issue_store_run(**{"augment": 60.0, "waiting for data": 35.0, "resize": 30.0, "total (wall)": 100.0})
    assert bottleneck({"table": table(t)}) == "augment"
    found = findings(t, gpu=False, cuda=False)
    assert any("prefetch" in f for f in found) and not any("GPU" in f or "CUDA" in f for f in found), found
    assert any("GPU kernel" in f for f in findings(t, gpu=False, cuda=True))  # --device cpu on a GPU host


def test_a_machine_without_a_driver_is_not_told_to_install_gpu_decoders(folder, tmp_path, monkeypatch):
    import torch

    from gpufeed.doctor import versions

    gpufeed.pack(folder, tmp_path / "j", mode="jpeg", workers=1, progress=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu, "roi_available", lambda: False)  # nvImageCodec not installed
    stack = versions.Stack("0.1.0", "3.11.7", "2.11.0+cu130", "13.0", "0.26.0", None, None,
                           {"nvidia-nvimgcodec-cu12": "0.5.0"}, "3.6.0")  # a wheel for the other CUDA, no driver
    monkeypatch.setattr(versions, "collect", lambda: stack)
    report = diagnose(str(tmp_path / "j"), device="cpu", limit=128)
    said = report["findings"] + report["gpufeed"][1:]  # [0] lists the versions found
    assert not any("pip install" in line or "nvImageCodec" in line or "hardware" in line for line in said), said
    assert any(line.startswith("CPU JPEG decode of crop regions alone: unavailable") for line in said)
    assert "% of wall" in report["table"] and bottleneck(report) not in ("waiting for data", "queue full")
    if any("prefetch" in f for f in report["findings"]):
        assert bottleneck(report) in ("augment", "hand-over", "between batches (the consumer's own time)")


def test_doctor_under_torchrun_says_each_ranks_cores_and_workers(monkeypatch):
    from gpufeed.doctor import diagnose
    from gpufeed.loader import cores

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(cores, "launcher", lambda: 4242)
    monkeypatch.setattr(cores, "affinity", lambda pid=0: set(range(32 if pid == 4242 else 16)))
    monkeypatch.setattr(cores, "cgroup", lambda pid=0: None)
    lines = diagnose(None, device="cuda" if torch.cuda.is_available() else "cpu")["gpufeed"]
    line = next(x for x in lines if x.startswith("rank 1 of 2"))
    assert "16 cores for this rank" in line and "CPU decode workers" in line
