"""Every benchmark in benchmarks/ runs its `--smoke` on the CPU and leaves its record: a JSON of its
runs with the command and machine, and the markdown table beside it.

The scripts are loaded from their files and their `main(argv)` called in this process (one torch
import for all of them), with benchmarks/ on sys.path as it is when a script runs.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import gpufeed

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SHARED = ("common", "feeds", "others", "photos", "video_others", "waits")  # modules the scripts share, imported by their plain names
SMOKES = {  # script: extra arguments of its smoke (each benchmark once; ddp_bench's --train: a test below)
    "train_bench": [],
    "jpeg_bench": [],
    "loader_bench": [],
    "ddp_bench": [],
    "folder_bench": ["--model", "resnet18", "--tuning", "prealloc=False", "--fresh", "--pyspy"],
    "index_bench": [],
    "pack_bench": [],
    "start_bench": [],
    "augment_chain_bench": [],
    "store_open_bench": [],
    "shuffle_bench": [],
    "detection_bench": [],
    "segmentation_bench": [],
    "remote_bench": ["--compare", "litdata", "--ranks", "2", "--batch", "4", "--fetch-process", "--servers", "2",
                     "--tuning", "lead_lands_first=True"],
    "video_bench": [],  # (not installed: a row that fails, and the others still written)
    "worker_start_bench": [],
}


@pytest.fixture
def bench(monkeypatch):
    """`bench(name)`: benchmarks/NAME.py as a module, as if run as a script (its siblings importable)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster and leaves a core to the loaders' workers

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # as a script's __main__ is: dataclasses look it up
        spec.loader.exec_module(module)
        return module

    yield load
    torch.set_num_threads(threads)
    if torch.distributed.is_initialized():  # a ddp_bench smoke that failed half-way
        torch.distributed.destroy_process_group()
    for name in SHARED:
        sys.modules.pop(name, None)


def test_every_benchmark_has_a_smoke():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")} - set(SHARED)
    assert scripts == {name.split()[0] for name in SMOKES}


@pytest.mark.parametrize("name", SMOKES)
def test_smoke(name, bench, tmp_path, capsys):
    if name == "remote_bench":  # its S3 server and client: the test extra's, optional elsewhere
        pytest.importorskip("moto.server")
        pytest.importorskip("s3fs")
    out = tmp_path / "result.json"
    record = bench(name.split()[0]).main(["--smoke", "--out", str(out), *SMOKES[name]])
    written = json.loads(out.read_text())
    assert written["benchmark"] == name.split()[0] and record["command"] == written["command"]
    assert written["command"].startswith(f"python benchmarks/{name.split()[0]}.py --smoke")
    assert written["config"]["smoke"] is True
    assert {"gpu", "cpus", "torch", "commit"} <= set(written["machine"])
    assert written["runs"], "no run recorded"
    table = out.with_suffix(".md").read_text()
    assert written["table"] in table and table.count("\n|") >= 2  # a header, its rule and rows
    assert written["table"] in capsys.readouterr().out
    if name == "video_bench":  # the training rows say where the loop waited: at epochs' starts or between
        fed = written["rows"]["r3d_18 fed by gpufeed, 2 decode processes, round 0"]
        assert len(fed["wait_ms_each"]) == 2 and fed["batches_an_epoch"] >= 1
        assert 0 <= fed["wait_share_at_epoch_starts"] <= 1 and fed["wait_ms_per_step"] >= 0
        runs = written["runs"]  # each clip from its packets alone and through its container, decoding alike
        assert {"gpufeed, 2 decode processes, through containers", "gpufeed, 2 decode processes",
                "r3d_18 fed by gpufeed, 2 decode processes, through containers"} <= set(runs)
        one = [written["rows"][f"gpufeed's decode to 4:2:0, one thread, {how}, round 0"] for how in
               ("from packets", "through containers")]
        assert one[0]["frames_decoded_per_clip"] == one[1]["frames_decoded_per_clip"] > 0
        assert "gpufeed, 2 decode processes, evaluation (2 clips a video, in order)" in runs
    if name == "folder_bench":  # first Loaders' passes with the model, the model alone, with other settings
        assert {"gpufeed, packed store, with resnet18", "gpufeed, folder in place, with resnet18",
                "resnet18 alone on one batch (the model's bound)", "gpufeed, packed store, prealloc=False",
                "gpufeed, folder in place, prealloc=False"} <= set(written["runs"])
        for name in ("gpufeed, packed store, a fresh process", "gpufeed, folder in place, a fresh process"):
            fresh = written["runs"][name][0]  # a pass in a new interpreter: every image, its imports timed apart
            assert fresh["images"] == written["runs"]["gpufeed, packed store"][0]["images"] > 0
            assert fresh["stats"]["imports_s"] > 0 and fresh["stats"]["start"]["first_batch_s"] <= fresh["total"]
        assert "Fresh processes, their reader's imports" in table
        for name in ("gpufeed, folder in place, steady state (second pass)", "gpufeed, packed store, steady state (third pass)"):
            watched = written["runs"][name][0]["stats"]["waits"]  # --pyspy: the steady pass watched (py-spy if on PATH)
            assert "MainThread" in watched["threads"] and isinstance(watched["gc"], dict)
    if name == "remote_bench":  # each epoch's timeline of the link: the cold one downloads every shard
        assert all(isinstance(written["runs"][row]["gc"], dict) for row in ("cold", "warm"))  # its collections
        cold, warm = written["runs"]["cold"]["downloads"], written["runs"]["warm"]["downloads"]
        assert cold["shards"] >= 2 and 0 < cold["busy_s"] <= written["runs"]["cold"]["seconds"]
        assert warm == {"shards": 0, "on_demand": 0, "busy_s": 0.0, "last_ended_s": 0.0, "first_began_s": 0.0,
                        "each": []}
        assert len(cold["each"]) == cold["shards"] and cold["first_began_s"] == cold["each"][0][1]
        start = written["runs"]["cold"]["loader_start"]  # the first pass's: where its start went
        assert start["constructor_s"] <= start["first_pass_s"] <= start["first_plan_s"] <= start["first_batch_s"]
        assert "loader_start" not in written["runs"]["warm"]
        assert written["runs"]["fetch"]["bytes"] == written["runs"]["cold"]["downloaded"] > 0  # every shard
        # two servers, each with the whole bucket: the files dealt to both in turn all came
        assert written["runs"]["server"]["bytes"] == written["runs"]["link"]["bytes"] > 0 and "2 server(s)" in table
        away = written["runs"]["cold, downloads in a process"]  # all of its shards, or some before it was ready
        assert away["downloaded"] == written["runs"]["cold, again (downloads here)"]["downloaded"] > 0
        assert written["runs"]["cold, again (downloads here)"]["shards_downloaded_in_the_process"] == 0
        tuned = written["runs"]["cold, lead_lands_first=True"]  # --tuning's cold epoch, then the defaults' again
        assert tuned["downloaded"] == written["runs"]["cold, again (the defaults)"]["downloaded"] > 0
        assert 0 <= away["shards_downloaded_in_the_process"] <= away["downloads"]["shards"]
        for row in ("cold", "warm"):  # how long a thread waited for the GIL meanwhile
            gil = written["runs"][row]["gil_lateness"]
            assert gil["wakeups"] >= 1 and 0 <= gil["p50_ms"] <= gil["p99_ms"] and 0 <= gil["late_share"] <= 1
            assert 0 <= written["runs"][row]["host_cpu_busy"] <= 1
        cold, warm = (written["runs"][f"2 ranks, one cache folder: {e}"] for e in ("cold", "warm"))
        assert cold["downloaded"] == cold["shard_bytes"] and warm["downloaded"] == 0  # each shard once a node
        assert cold["images"] == sum(r["images"] for r in cold["ranks"]) > 0 and len(cold["ranks"]) == 2
        for node in (cold, warm):  # the ranks timed as a node: from the first one's start to the last one's end
            began, ended = [r["began_at"] for r in node["ranks"]], [r["ended_at"] for r in node["ranks"]]
            assert node["seconds"] == max(ended) - min(began) >= max(r["seconds"] for r in node["ranks"])
            assert max(began) - min(began) < node["seconds"]  # begun together (a barrier at each epoch)
        if importlib.util.find_spec("litdata") is None:  # its process failed: its row says so, the benchmark goes on
            failed = written["runs"]["litdata: failed"]
            assert failed["exit"] != 0 and "litdata" in failed["error"] and "partial" not in written
        else:
            assert written["runs"]["litdata: cold"]["images"] > 0


def test_detection_bench_gives_segmentation_bench_its_own_settings(bench):
    """`detection_bench --segmentation MODEL` runs segmentation_bench with the same settings: the
    arguments it builds are segmentation_bench's and mean the same there (its smoke leaves it out)."""
    detection, segmentation = bench("detection_bench"), bench("segmentation_bench")
    argv = ["--n", "12", "--batch", "4", "--size", "64", "--steps", "5", "--workers", "3", "--workdir", "/tmp/w",
            "--segmentation", "fcn_resnet50", "--data", "smooth"]
    a = detection.common.parse(detection.parser(), argv, detection.SMOKE)
    b = segmentation.parser().parse_args(detection.segmentation_argv(a))
    for key in ("n", "batch", "size", "steps", "workers", "workdir", "data", "image", "device", "warmup",
                "train_repeats"):
        assert getattr(b, key) == getattr(a, key), key
    assert b.model == "fcn_resnet50"


def test_a_compared_library_that_hangs_is_killed_with_its_workers_and_its_rows_kept(bench):
    """remote_bench's --compare-timeout: a library's process that runs past it is killed with its whole
    session (a worker it started, holding its output, with it), its rows so far kept, and the call
    returns in seconds, not when the hung worker would end."""
    import time

    remote = bench("remote_bench")
    script = (
        "import json, subprocess, sys, time\n"
        f"print({remote.OTHER_ROW!r} + json.dumps(['cold', {{'images': 8}}]), flush=True)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])  # a worker: our pipes too\n"
        "time.sleep(120)\n"
    )
    rows: dict = {}
    t0 = time.perf_counter()
    code, said, timed_out = remote.rows_of([sys.executable, "-c", script], 3.0, rows.__setitem__)
    assert time.perf_counter() - t0 < 60
    assert timed_out and code != 0 and rows == {"cold": {"images": 8}}
    code, said, timed_out = remote.rows_of([sys.executable, "-c", "import sys; sys.exit('no such library')"], 60,
                                           rows.__setitem__)
    assert (code, timed_out) == (1, False) and "no such library" in said


def test_litdata_gets_the_workers_whose_chunks_fit_its_cache(bench):
    """remote_bench's LitData rows through a small cache: as many workers as keep their chunks within
    it, by LitData's own rule (each keeps 4 at least); the other libraries and an unbounded cache: all."""
    others = bench("others")
    mb = 1 << 20
    assert others.workers_for("litdata", 16, 145 * mb, 16 * mb) == 2
    assert others.workers_for("litdata", 16, 10 * mb, 16 * mb) == 1
    assert others.workers_for("litdata", 16, None, 16 * mb) == 16
    assert others.workers_for("streaming", 16, 145 * mb, 16 * mb) == 16


def test_a_rows_tuning_takes_every_field_of_tuning(bench):
    """A row's settings (`jpeg:pipelines=2,skip_nonref=False`) become a Tuning, each cast to its default's
    type; a field whose default is None (`skip_nonref`) takes the value as given."""
    from gpufeed.decode.tuning import Tuning

    feeds = bench("feeds")
    tuned = feeds.tuning(feeds.settings("jpeg:pipelines=2,skip_nonref=False,gpu_min=0.3"))
    assert tuned == Tuning(pipelines=2, skip_nonref=False, gpu_min=0.3)
    assert feeds.tuning({"skip_nonref": True}).skip_nonref is True and feeds.tuning({}) is None


def test_train_bench_runs_each_gpufeed_row_again_with_a_baseline_tree(bench, tmp_path):
    """`--baseline SRC`: each gpufeed row runs again as `ROW @baseline` with that tree's gpufeed, on
    stores that tree packed (a folder row: on the same images, `feeds._images`); the other rows once (a
    change's before and after in one call)."""
    base = tmp_path / "old" / "src"
    shutil.copytree(Path(gpufeed.__file__).parent, base / "gpufeed", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "train.json"
    bench("train_bench").main(["--smoke", "--rows", "synthetic;jpeg:pipelines=1", "--baseline", str(base),
                               "--workdir", str(tmp_path / "work"), "--out", str(out)])
    runs = {r["row"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"synthetic", "jpeg:pipelines=1", "jpeg:pipelines=1 @baseline"}
    assert runs["jpeg:pipelines=1 @baseline"]["gpufeed"] == str(base / "gpufeed")
    assert runs["jpeg:pipelines=1"]["gpufeed"] == str(Path(gpufeed.__file__).parent)
    assert (tmp_path / "work" / "baseline" / "jpeg" / "manifest.json").exists()  # packed by the baseline
    feeds = bench("feeds")
    assert feeds._images(tmp_path / "work") == feeds._images(tmp_path / "work" / "baseline") == tmp_path / "work" / "images"
    with pytest.raises(SystemExit, match="not a tree's src folder"):  # a wrong path said before any row runs
        bench("train_bench").main(["--smoke", "--baseline", str(tmp_path), "--workdir", str(tmp_path / "work")])


def test_ddp_bench_reports_each_ranks_stages_under_torchrun(bench, tmp_path):
    """`ddp_bench --train` with 2 ranks (torchrun, gloo on the CPU): each rank's stage report, the
    fields that name a node's limit (issue 62): the loop's wait and launch, the GPU decoders' share,
    the workers' cores, busy share and images per core-second, the threads' times, steal, host bytes."""
    out = tmp_path / "ddp.json"
    bench("ddp_bench").main(["--smoke", "--no-inline", "--worlds", "2", "--train", "resnet18", "--configs", "jpeg",
                             "--data", "smooth", "--epochs-scale", "0.1", "--out", str(out)])
    written = json.loads(out.read_text())
    (run,) = written["runs"]["jpeg"]
    assert run["world"] == 2 and len(run["stages"]) == 2
    for stages in run["stages"]:
        assert stages["wait_ms_per_step"] >= 0 and stages["launch_ms_per_step"] > 0
        assert stages["gpu_share"] == 0 and stages["images_decoded"]["cpu"] > 0  # no GPU decoders on a CPU
        assert stages["workers"] >= 1 and stages["workers_cores"] > 0 and 0 < stages["workers_busy"] <= 1.5
        assert stages["cpu_img_per_core_s"] > 0 and stages["host_gb_s_jpeg_read"] > 0
        assert stages["threads"]["MainThread"]["run_ms"] > 0 and stages["steal_ms_per_step"] is not None
    table = out.with_suffix(".md").read_text()
    assert "img/s per worker core" in table and "| jpeg | 2 | no | 1 |" in table


def test_gil_lateness_sees_a_thread_that_holds_the_gil(bench):
    """waits.Lateness (remote_bench's "GIL wait" column): beside a thread running Python without pause,
    a thread that wants the GIL waits about a switch interval (5 ms) each time."""
    import threading
    import time

    waits = bench("waits")
    stop = threading.Event()

    def hold() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        watch = waits.Lateness()
        time.sleep(0.3)
        held = watch.stop()
    finally:
        stop.set()
        holder.join()
    assert held["wakeups"] >= 5 and held["p50_ms"] >= 2 and held["late_share"] > 0.1, held
