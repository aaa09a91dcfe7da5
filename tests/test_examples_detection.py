"""examples/train_detection.py on CPU: Mask R-CNN and Keypoint R-CNN trained two steps on gpufeed
batches of a generated store (masks, boxes, categories, keypoints through the same crops and flips),
and Mask R-CNN on batches by aspect ratio."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_detection.py"


@pytest.mark.parametrize("model,more", [("maskrcnn", []), ("keypointrcnn", []), ("maskrcnn", ["--aspect"])])
def test_a_detection_model_trains_on_gpufeed_batches(tmp_path, model, more):
    spec = importlib.util.spec_from_file_location("train_detection", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main([str(tmp_path / "store"), "--demo", "--model", model, "--size", "64", "--batch-size", "2",
                          "--steps", "2", "--device", "cpu", *more])
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
