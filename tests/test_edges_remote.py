"""Edges of stores in a bucket and their cache (issue 63): nothing of the user's lost, nothing hung,
nothing silently wrong. Against the S3 API server of test_remote.py (moto, on 127.0.0.1)."""

from __future__ import annotations

import http.server
import socketserver
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

import gpufeed
import gpufeed.store.locations as locations
import gpufeed.store.remote as remote_module
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
        fs.invalidate_cache()  # (gpufeed's own client wrote the bucket)
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


class _Stuck(http.server.BaseHTTPRequestHandler):
    """A proxy in front of the S3 server that, once `stuck` is set, takes each request and never answers
    (a stuck proxy, a dead NAT): until `freed` is set, at the test's end."""

    upstream = ""
    stuck = False
    freed = threading.Event()

    def _forward(self):
        if type(self).stuck:
            type(self).freed.wait()
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
        request = urllib.request.Request(self.upstream + self.path, data=body, method=self.command,
                                         headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
        try:
            with urllib.request.urlopen(request) as answer:
                status, headers, payload = answer.status, answer.getheaders(), answer.read()
        except urllib.error.HTTPError as e:
            status, headers, payload = e.code, e.headers.items(), e.read()
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
        self.send_header("Content-Length", length if self.command == "HEAD" else str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    def log_message(self, *args):
        pass


def _within(seconds: float, call):
    """`call()`'s result or error, failing the test where it has neither after `seconds` (it hung)."""
    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_server_that_never_answers_is_named_in_an_error_within_the_timeouts(bucket, server, tmp_path, monkeypatch):
    """Every request has a connect and a read timeout (gpufeed's defaults, or storage_options'), and one
    the server never answers is tried again once: then a StoreError names the file and the URL (the
    Loader waited for ever: botocore's 60 s and 5 attempts under s3fs's and gpufeed's tries)."""
    import s3fs

    monkeypatch.setattr(locations, "CONNECT_TIMEOUT", 0.3)
    monkeypatch.setattr(locations, "READ_TIMEOUT", 0.3)
    monkeypatch.setattr(remote_module, "BACKOFF", 0.01)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own tries of each request: one
    _Stuck.upstream, _Stuck.stuck = server, False
    _Stuck.freed.clear()
    proxy = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Stuck)
    proxy.daemon_threads = True
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        options = _options(f"http://127.0.0.1:{proxy.server_address[1]}")
        loader = gpufeed.Loader("s3://bucket/train", batch_size=4, device="cpu", augment=OPS, num_workers=1,
                                cache_dir=tmp_path / "cache", storage_options=options)
        _Stuck.stuck = True
        with pytest.raises(StoreError, match=r"s3://bucket/train/shards/\d{5}.*did not answer \(2 tries"):
            _within(60, lambda: next(iter(loader)))
        loader.close()
        with pytest.raises(StoreError, match=r"s3://bucket/train/manifest\.json: the server did not answer"):
            _within(60, lambda: gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "other", storage_options=options))
    finally:
        _Stuck.freed.set()
        proxy.shutdown()
        proxy.server_close()
    # storage_options' own timeouts are the ones used; gpufeed's fill in those they leave out
    config = locations.with_timeouts("s3://b/s", {"config_kwargs": {"read_timeout": 7}})["config_kwargs"]
    assert config == {"read_timeout": 7, "connect_timeout": 0.3, "retries": {"total_max_attempts": 1}}
    client = locations.with_timeouts("https://host/s", {})["client_kwargs"]
    assert client["timeout"].sock_read == client["timeout"].sock_connect == 0.3
