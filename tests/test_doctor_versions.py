"""`gpufeed doctor` names the versions that must agree and the command that fixes a mismatch."""

from __future__ import annotations

from dataclasses import replace

from gpufeed.cli import main
from gpufeed.doctor.versions import Stack, collect, problems, report

GOOD = Stack("0.1.0", "3.11.7", "2.11.0+cu130", "13.0", "0.26.0", "580.65.06", "13.0",
             {"nvidia-nvimgcodec-cu13": "0.9.0.20", "nvidia-nvjpeg": "13.3.2.43"}, "3.6.0")


def test_a_matching_stack_has_no_problem():
    assert problems(GOOD) == []
    assert problems(replace(GOOD, torch_cuda="13.2")) == []  # minor-version compatibility within CUDA 13
    line = report(GOOD)[0]
    for part in ("gpufeed 0.1.0", "torch 2.11.0+cu130 (CUDA 13.0)", "torchvision 0.26.0",
                 "NVIDIA driver 580.65.06 (CUDA up to 13.0)", "nvidia-nvimgcodec-cu13 0.9.0.20", "Triton 3.6.0"):
        assert part in line


def test_nvimgcodec_for_the_other_cuda_is_named_with_the_fix():
    cu12 = replace(GOOD, torch="2.11.0+cu126", torch_cuda="12.6", driver_cuda="12.9")
    [p] = problems(cu12)
    assert "nvidia-nvimgcodec-cu13, nvidia-nvjpeg installed but torch is built for CUDA 12.6" in p
    assert "pip uninstall -y nvidia-nvimgcodec-cu13 nvidia-nvjpeg && pip install 'gpufeed[nvimgcodec-cu12]'" in p


def test_missing_pieces_are_named_with_the_fix():
    [p] = problems(replace(GOOD, wheels={}))
    assert "not installed" in p and "pip install 'gpufeed[nvimgcodec-cu13]'" in p
    [p] = problems(replace(GOOD, wheels={"nvidia-nvimgcodec-cu13": "0.9"}))
    assert "without nvidia-nvjpeg" in p
    [p] = problems(replace(GOOD, torch_cuda=None, torch="2.11.0+cpu"))
    assert "CPU-only build on a machine with an NVIDIA driver" in p
    [p] = problems(replace(GOOD, triton=None))
    assert "Triton is not installed" in p and "pip install triton" in p


def test_a_driver_older_than_torchs_cuda():
    [p] = problems(replace(GOOD, driver="535.1", driver_cuda="12.2"))
    assert "supports CUDA up to 12.2" in p and "upgrade the driver" in p and "whl/cu12" in p


def test_no_driver_no_complaint_about_gpu_wheels():
    assert problems(replace(GOOD, driver=None, driver_cuda=None, wheels={})) == []


def test_this_machine_and_the_cli(capsys):
    s = collect()
    assert s.python and s.gpufeed and s.torch
    assert main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("versions: gpufeed ") and "CPU JPEG decode" in out
