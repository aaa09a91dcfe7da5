"""The README's loop on the GPU exits with its own code every time, with and without close(), its
producer busy with the next epoch at exit (tests/test_exit.py does the same on the CPU)."""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from test_exit import RUNS, _run, store  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

README_LOOP = """
import sys, torch, gpufeed
from gpufeed.augment import RandomResizedCrop, RandomHorizontalFlip, Normalize
loader = gpufeed.Loader(sys.argv[1], batch_size=8, device="cuda", dtype=torch.bfloat16, channels_last=True,
                        augment=[RandomResizedCrop(448), RandomHorizontalFlip(), Normalize()])
for images, labels in loader:
    pass
if sys.argv[2] == "close":
    loader.close()
sys.exit(int(sys.argv[3]))
"""


@pytest.mark.parametrize("close", ["close", "no-close"])
def test_the_readme_loop_on_the_gpu_exits_with_its_own_code_every_time(store, tmp_path, close):  # noqa: F811
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(README_LOOP))
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda k: _run(script, str(store), close, str(k % 3)), range(2 * RUNS)))
    bad = [(k, r.returncode, r.stderr[-300:]) for k, r in enumerate(runs) if r.returncode != k % 3]
    assert not bad, f"{len(bad)} of {2 * RUNS} runs exited with another code: {bad[:3]}"
