"""The CLI verbs end to end: exit codes and what they print."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import gpufeed
from gpufeed.cli import main
from gpufeed.synth import make_image_folder


def test_pack_inspect_verify(image_folder, tmp_path, capsys):
    (image_folder / "cat" / "broken.jpg").write_bytes(b"\xff\xd8 nope")
    assert main(["pack", str(image_folder), str(tmp_path / "s"), "--size", "16", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "packed 12 images" in out and "skipped 1" in out and "broken.jpg" in out

    assert main(["inspect", str(tmp_path / "s"), "--grid", str(tmp_path / "grid.png")]) == 0
    out = capsys.readouterr().out
    assert "count         12" in out and "cat (4)" in out and "skipped       1" in out
    assert "skipped files:" in out and "broken.jpg:" in out  # which file, and why
    grid = Image.open(tmp_path / "grid.png").convert("RGB")
    assert grid.size == (8 * 128, 2 * (128 + 14))  # 12 samples, 8 a row, captioned tiles
    first = gpufeed.open(tmp_path / "s")[0][0]  # 16x16, centred in the first 128x128 tile
    assert list(grid.getpixel((56 + 8, 56 + 8))) == first[:, 8, 8].tolist()
    assert main(["inspect", str(tmp_path / "s"), "--grid", str(tmp_path / "missing" / "grid.png")]) == 1

    assert main(["verify", str(tmp_path / "s")]) == 0
    with open(tmp_path / "s" / "images.u8", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["verify", str(tmp_path / "s")]) == 1
    assert "DAMAGED: images.u8" in capsys.readouterr().err


def test_errors_exit_nonzero_with_a_message(image_folder, tmp_path, capsys):
    assert main(["pack", str(tmp_path / "missing"), str(tmp_path / "s")]) == 1
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.jpg").write_bytes(b"junk")
    assert main(["pack", str(tmp_path / "junk"), str(tmp_path / "s"), "--workers", "1"]) == 1
    assert "nothing could be packed" in capsys.readouterr().err
    assert main(["pack", str(image_folder), str(tmp_path / "s"), "--size", "8"]) == 0
    assert main(["pack", str(image_folder), str(tmp_path / "s"), "--size", "8"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 1
    with pytest.raises(SystemExit):
        main(["pack", "--mode", "gif", "a", "b"])


def test_demo_runs(tmp_path, capsys):
    rows = main(["demo", "--dir", str(tmp_path / "demo"), "--per-class", "4"])
    assert rows == 0
    out = capsys.readouterr().out
    assert "raw" in out and "jpeg" in out and "intact" in out
    assert "gpufeed.Loader on " in out and "(16, 3, 224, 224) float16" in out
    steps = re.findall(r"^(\d+)/(\d+) ", out, re.MULTILINE)  # each step numbered once, in order
    assert [int(k) for k, _ in steps] == list(range(1, len(steps) + 1)) and {n for _, n in steps} == {str(len(steps))}


def test_console_script(tmp_path):
    try:
        importlib.metadata.distribution("gpufeed")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gpufeed runs from the source tree (PYTHONPATH), not installed: no console script")
    script = shutil.which("gpufeed", path=str(Path(sys.executable).parent)) or shutil.which("gpufeed")
    assert script, "the gpufeed console script is not installed next to this Python"
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    for verb in ("pack", "inspect", "verify", "demo"):
        assert verb in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "gpufeed.cli", "verify", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 1 and "not a gpufeed store" in proc.stderr


def test_help_and_version_do_not_import_torch(tmp_path):
    """`--help` and `--version` answer at once: the verbs import torch only when they run."""
    probe = ("import sys\nfrom gpufeed.cli import main\n"
             "for argv in (['--help'], ['--version'], ['pack', '--help'], ['doctor', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, argv\n"
             "print('torch' in sys.modules, 'numpy' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "False False", proc.stdout
    assert f"gpufeed {gpufeed.__version__}" in proc.stdout
    assert "(default: 256)" in proc.stdout  # options show their defaults


def test_inspect_lists_every_skipped_file_on_request(tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (8, 8), "red").save(folder / "ok.png")
    for i in range(25):
        (folder / f"bad{i:02d}.jpg").write_bytes(b"not an image")
    assert main(["pack", str(folder), str(tmp_path / "s"), "--size", "8", "--workers", "1"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "bad00.jpg:" in out and "bad19.jpg:" in out and "bad20.jpg" not in out
    assert "and 5 more (--all-skipped" in out
    assert main(["inspect", str(tmp_path / "s"), "--all-skipped"]) == 0
    out = capsys.readouterr().out
    assert "bad24.jpg:" in out and "more (" not in out


def test_inspect_grid_of_an_undecodable_sample_draws_it_blank_and_names_it(image_folder, tmp_path, capsys):
    store = tmp_path / "j"
    assert main(["pack", str(image_folder), str(store), "--mode", "jpeg", "--workers", "1"]) == 0
    begin = int(gpufeed.open(store).offsets[3])
    with open(store / "data.bin", "r+b") as f:  # sample 3's bytes overwritten: no longer a JPEG
        f.seek(begin)
        f.write(bytes(64))
    capsys.readouterr()
    assert main(["inspect", str(store), "--grid", str(tmp_path / "grid.png")]) == 0
    out = capsys.readouterr().out
    assert "grid of samples written to" in out
    assert "1 sample could not be decoded, drawn blank: 3 (" in out
    grid = Image.open(tmp_path / "grid.png").convert("RGB")
    assert grid.getpixel((3 * 128 + 64, 64)) == (224, 224, 224)  # tile 3: blank
    assert grid.getpixel((2 * 128 + 64, 64)) != (224, 224, 224)  # its neighbour: an image


def test_file_names_that_are_not_utf8_print_under_a_strict_stdout(tmp_path):
    folder = tmp_path / "imgs"
    (folder / "c").mkdir(parents=True)
    Image.new("RGB", (8, 8), "red").save(folder / "c" / "ok.png")
    Path(os.fsdecode(os.fsencode(folder / "c") + b"/bad\xff.jpg")).write_bytes(b"not an image")
    gpufeed.pack(folder, tmp_path / "s", size=8, workers=1, progress=False)
    proc = subprocess.run([sys.executable, "-c", "import sys; from gpufeed.cli import main; sys.exit(main())",
                           "inspect", str(tmp_path / "s")], capture_output=True,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})  # utf-8, errors strict
    assert proc.returncode == 0, proc.stderr
    assert b"bad\\udcff.jpg: " in proc.stdout


def test_usage_errors_exit_2_as_the_readme_says(capsys):
    with pytest.raises(SystemExit) as e:
        main(["pack", "--mode", "gif", "a", "b"])
    assert e.value.code == 2 and "invalid choice: 'gif'" in capsys.readouterr().err
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = " ".join(readme.split("\n## Command line", 1)[1].split("\n## ", 1)[0].split())
    assert "2 on a usage error" in section


def test_log_lines_name_gpufeed_once(tmp_path):
    gpufeed.pack(make_image_folder(tmp_path / "imgs", per_class=2, classes=2), tmp_path / "s", size=16,
                 workers=1, progress=False)
    probe = ("import logging, sys\nfrom gpufeed.cli import main\nrc = main()\n"
             "logging.getLogger('gpufeed.x').info('a plain message')\nsys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", probe, "doctor", str(tmp_path / "s"), "--device", "cpu",
                           "--limit", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "gpufeed.Loader: tier host" in proc.stderr and "gpufeed: gpufeed." not in proc.stderr
    assert "gpufeed: a plain message" in proc.stderr


def test_pack_draws_no_progress_bar_into_a_redirected_stderr(image_folder, tmp_path, capsys):
    assert main(["pack", str(image_folder), str(tmp_path / "s"), "--size", "8", "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "pack:" not in err and "img/s]" not in err, err


def test_doctor_on_a_store_none_of_whose_samples_decodes_says_so_in_one_line(image_folder, tmp_path, capsys):
    """It printed a RecursionError's 33,000-line traceback."""
    gpufeed.pack(image_folder, tmp_path / "s", mode="jpeg", workers=1, progress=False)
    store = gpufeed.open(tmp_path / "s")
    with open(store.path / "data.bin", "r+b") as f:
        f.write(b"\0" * os.path.getsize(store.path / "data.bin"))
    assert main(["doctor", str(tmp_path / "s"), "--device", "cpu", "--limit", "8"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and "cannot be decoded" in err[-1] and "Traceback" not in "".join(err)
