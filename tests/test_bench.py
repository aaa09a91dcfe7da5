"""`gpufeed bench --quick` on CPU: every experiment writes JSON and PNGs, or says why it skipped."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from gpufeed.bench import EXPERIMENTS, plot, run_bench
from gpufeed.cli import main


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run_bench(None, out, quick=True, device="cpu")
    return out


def test_every_experiment_recorded(bench_out):
    results = json.loads((bench_out / "results.json").read_text())
    assert set(results["experiments"]) == set(EXPERIMENTS)
    assert "CUDA" in results["experiments"]["transfer"]["skipped"]
    assert "CUDA" in results["experiments"]["dtype"]["skipped"]
    for name in ("decoders", "loaders", "training"):
        figures = results["experiments"][name]["figures"]
        assert figures, name
        for fig in figures:
            assert fig["xlabel"] and fig["ylabel"] and fig["series"]
            for s in fig["series"].values():
                assert len(s["x"]) == len(s["median"]) == len(s["min"]) == len(s["max"]) > 0
                assert all(lo <= m <= hi for lo, m, hi in zip(s["min"], s["median"], s["max"]) if m == m)
            png = bench_out / f"{fig['name']}.png"
            assert Image.open(png).size[0] > 100
    loaders = results["experiments"]["loaders"]["figures"][0]["series"]
    assert {"DataLoader(ImageFolder, PIL)", "gpufeed raw store", "gpufeed jpeg store"} <= set(loaders)
    training = results["experiments"]["training"]["figures"][0]["series"]
    waits = training["data wait"]["median"]
    steps = training["model step"]["median"]
    assert all(abs(w + s - 100) < 1e-6 for w, s in zip(waits, steps))


def test_summary_and_plot_only(bench_out, capsys):
    summary = (bench_out / "summary.md").read_text()
    assert "## loaders" in summary and "Skipped: needs a CUDA device" in summary and "| batch size |" in summary
    for png in bench_out.glob("*.png"):
        png.unlink()
    assert len(plot(bench_out)) >= 5
    assert main(["bench", "--plot-only", "--out", str(bench_out)]) == 0
    assert "plot(s) and summary.md" in capsys.readouterr().out


def test_one_experiment_and_bad_names(tmp_path):
    assert main(["bench", "transfer", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    experiments = json.loads((tmp_path / "results.json").read_text())["experiments"]
    assert list(experiments) == ["transfer"] and "CUDA" in experiments["transfer"]["skipped"]
    assert main(["bench", "nope", "--out", str(tmp_path)]) == 1
