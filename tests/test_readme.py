"""The Python blocks of the README and of the docs pages it links to run, in order, in one namespace
(the pages continue the README's training example), on tiny generated data on the CPU: the README and
the docs cannot drift from the code.

Sizes are scaled down by exact text substitutions, each of which must still match one of the pages
(so a changed example fails here rather than silently running something else).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import save, smooth

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the pages whose Python blocks run, in this order, after the README's (train, resume, evaluate)
PAGES = [README] + [ROOT / "docs" / f"{name}.md" for name in ("packing", "buckets", "loader", "augment")]
SMALLER = {  # page text -> what runs here (each must occur in one of the pages)
    "batch_size=256": "batch_size=4",
    "RandomResizedCrop(224)": "RandomResizedCrop(32)",
    "Resize(256)": "Resize(36)",
    "CenterCrop(224)": "CenterCrop(32)",
    "range(90)": "range(2)",
    'mode="raw", size=256': 'mode="raw", size=32',
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


BUCKET = {  # the bucket example, against a local S3 API server (moto's, started here)
    'creds = {"key": "...", "secret": "..."}': 'creds = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": ENDPOINT}}',
    'shard_size="256MB"': 'shard_size="4KB"',
    'cache_dir="/local/nvme/gpufeed"': 'cache_dir="cache"',
    'cache_limit="200GB"': 'cache_limit="1GB"',
}


@pytest.fixture
def s3(monkeypatch):
    """An S3 API server on 127.0.0.1 with an empty bucket "bucket"; its endpoint."""
    server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s = server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s.start()
    host, port = s.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    fs = s3fs.S3FileSystem(key="k", secret="s", client_kwargs={"endpoint_url": endpoint})
    if fs.exists("bucket/stores/train/manifest.json"):  # moto keeps one state per process
        fs.rm("bucket/stores/train", recursive=True)
    elif not fs.exists("bucket"):
        fs.mkdir("bucket")
    yield endpoint
    s.stop()


def page_blocks(endpoint: str) -> list[tuple[str, str]]:
    """(name, code) of every Python block of the pages, in order, sizes scaled down."""
    texts = {page: page.read_text() for page in PAGES}
    for old in {**SMALLER, **BUCKET}:
        assert any(old in t for t in texts.values()), f"no page contains {old!r} any more: update SMALLER or BUCKET"
    blocks = []
    for page, text in texts.items():
        for old, new in {**SMALLER, **BUCKET}.items():
            text = text.replace(old, new.replace("ENDPOINT", repr(endpoint)))
        name = page.relative_to(ROOT)
        blocks += [(f"{name} python block {k + 1}", b) for k, b in enumerate(python_blocks(text))]
    return blocks


def test_readme_python_blocks_run(tmp_path, monkeypatch, s3):
    blocks = page_blocks(s3)
    assert len(python_blocks(README.read_text())) >= 3 and len(blocks) >= 8
    sizes = [(40, 48), (56, 40), (48, 48), (37, 60)]
    for split, per_class in (("train", 4), ("val", 2)):
        for c in ("ant", "bee", "cat"):
            for i in range(per_class):
                save(Path(tmp_path, "data", split, c, f"{i}.jpg"), smooth(i, *sizes[i % 4]), quality=95)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, on any machine
    namespace: dict = {}
    for name, block in blocks:
        try:
            exec(compile(block, name, "exec"), namespace)
        except Exception as e:  # name the block that failed
            pytest.fail(f"{name} failed: {type(e).__name__}: {e}\n{block}")
    first = {name: namespace[name] for name in ("loader", "val", "one_pass", "remote")}
    packed = {d: (tmp_path / "stores" / d / "manifest.json").stat().st_mtime_ns for d in ("train", "val")}
    _run_again(blocks)
    for d, made in packed.items():  # kept, not packed again
        assert (tmp_path / "stores" / d / "manifest.json").stat().st_mtime_ns == made
    loader, val = namespace["loader"], namespace["val"]
    assert len(loader) == 3 and loader.state_dict()["epoch"] == 2  # 12 images, batches of 4, 2 epochs
    assert len(val.store) == 6 and 0 <= namespace["correct"] <= 6
    assert namespace["store"].source(0).endswith("data/train/ant/0.jpg")
    one_pass = namespace["one_pass"]  # the val folder read in place
    assert len(one_pass.store) == 6 and sum(len(y) for _, y in one_pass) == 6
    assert namespace["remote"].store.cache.fetched >= 1 and len(namespace["remote"].store) == 12
    for made in first.values():
        made.close()


def _run_again(blocks: list[tuple[str, str]]) -> None:
    """Run the pages' blocks a second time, as a user runs a training script again, in a fresh
    namespace: they must not fail on what the first run left (a store packed "once"). The blocks
    showing a pack into a fresh destination are left out: packing there again is an error on purpose
    (pass `overwrite=True` to replace a store)."""
    namespace: dict = {}
    fresh = ('mode="raw", size=32', "s3://")  # docs/packing.md's "Pack a dataset", docs/buckets.md
    for name, block in blocks:
        if any(text in block for text in fresh):
            continue
        try:
            exec(compile(block, f"{name}, run again", "exec"), namespace)
        except Exception as e:
            pytest.fail(f"{name} failed when run again: {type(e).__name__}: {e}\n{block}")
    for name in ("loader", "val", "one_pass"):
        namespace[name].close()


def test_the_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    bash = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert ci in [b.strip() for b in bash]
    assert any(b.strip().endswith("gpufeed demo") for b in bash)


def test_every_docs_page_with_python_blocks_is_run():
    """A Python block added to a docs page is run above, not left to drift."""
    with_blocks = {p for p in (ROOT / "docs").glob("*.md") if python_blocks(p.read_text())}
    # docs/video.md's blocks run on videos made in tests/test_video.py (test_the_docs_page_runs)
    run = {*PAGES, ROOT / "docs" / "video.md"}
    assert with_blocks <= run, sorted(str(p.relative_to(ROOT)) for p in with_blocks - run)
