"""Edges of stores in a bucket and their cache (issue 63): nothing of the user's lost, nothing hung,
nothing silently wrong. Against the S3 API server of test_remote.py (moto, on 127.0.0.1)."""

from __future__ import annotations

import numpy as np
import pytest

import gpufeed
from gpufeed.packing.packer import PackError
from gpufeed.sources import SourceError
from gpufeed.store import StoreError
from test_remote import OPS, _options, bucket, server  # noqa: F401  (the fixtures, and what they are made of)

pytest.importorskip("s3fs")


def _open(bucket, url: str, cache, **kw):
    return gpufeed.open(url, cache_dir=cache, storage_options=bucket["options"], **kw)


def test_a_failed_overwrite_leaves_the_store_in_the_bucket_as_it_was(bucket, tmp_path):
    """An overwrite whose source is mistyped or empty fails before anything in the bucket is touched:
    the store there still opens, with its shards (the old manifest was removed before the source was
    checked, and the store was gone)."""
    fs, options = bucket["fs"], bucket["options"]
    gpufeed.pack(bucket["src"], "s3://bucket/kept", mode="jpeg", workers=1, progress=False, shard_size="8KB",
                 storage_options=options)
    before = sorted(fs.find("bucket/kept"))
    (tmp_path / "empty").mkdir()
    for wrong in (tmp_path / "mistyped", tmp_path / "empty"):
        with pytest.raises((SourceError, PackError)):
            gpufeed.pack(wrong, "s3://bucket/kept", mode="jpeg", workers=1, progress=False, overwrite=True,
                         storage_options=options)
        assert sorted(fs.find("bucket/kept")) == before
        store = _open(bucket, "s3://bucket/kept", tmp_path / "cache")
        assert len(store) == 40 and np.array_equal(store.labels.numpy(), gpufeed.open(bucket["flat"]).labels.numpy())


def test_a_cache_folder_is_one_gpufeed_made_for_the_store_or_a_new_one(bucket, tmp_path, monkeypatch):
    """The cache deletes and writes files in its folder: an empty cache_dir (an unset environment
    variable: it was the working directory), a folder of the user's, or another store's cache is
    refused, and nothing in it is touched; a new folder is marked, and opens again."""
    work = tmp_path / "work"
    mine = {"shards/00000/important.txt": "mine", "top/manifest.json": "{}", "notes.txt": "mine too"}
    for name, text in mine.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    monkeypatch.chdir(work)
    for cache_dir, match in (("", "cache_dir is empty"), (work, "files gpufeed did not make")):
        with pytest.raises(ValueError, match=match):
            _open(bucket, "s3://bucket/train", cache_dir)
        with pytest.raises(ValueError, match=match):
            gpufeed.Loader("s3://bucket/train", batch_size=4, device="cpu", augment=OPS, cache_dir=cache_dir,
                           storage_options=bucket["options"])
        assert {str(p.relative_to(work)): p.read_text() for p in work.rglob("*") if p.is_file()} == mine
    assert len(_open(bucket, "s3://bucket/train", tmp_path / "new")) == 40
    assert (tmp_path / "new" / ".gpufeed-cache").read_text().endswith("store: s3://bucket/train\n")
    assert len(_open(bucket, "s3://bucket/train", tmp_path / "new")) == 40
    with pytest.raises(ValueError, match="cache of s3://bucket/train"):
        _open(bucket, "s3://bucket/kept", tmp_path / "new")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a folder"):
        _open(bucket, "s3://bucket/train", tmp_path / "file")
