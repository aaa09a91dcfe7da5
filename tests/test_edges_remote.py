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
