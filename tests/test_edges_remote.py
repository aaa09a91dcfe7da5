"""Edges of stores in a bucket and their cache (issue 63): nothing of the user's lost, nothing hung,
nothing silently wrong. Against the S3 API server of test_remote.py (moto, on 127.0.0.1)."""

from __future__ import annotations

import http.server
import socketserver
import threading

import numpy as np
import pytest
import test_remote
import torch
from test_remote import OPS, _options

import gpufeed
import gpufeed.store.locations as locations
import gpufeed.store.fetch as fetch_module
import gpufeed.store.remote as remote_module
from gpufeed.loader.inputs.remote import smallest_cache
from gpufeed.packing.packer import PackError
from gpufeed.sources import SourceError
from gpufeed.store import StoreError

pytest.importorskip("s3fs")
server, bucket = test_remote.server, test_remote.bucket  # its fixtures: the S3 server, the bucket and its stores


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
        test_remote.relay(self)

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
    monkeypatch.setattr(fetch_module, "BACKOFF", 0.01)
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
            _within(60, lambda: gpufeed.open("s3://bucket/train", cache_dir=tmp_path / "other",
                                             storage_options=options))
    finally:
        _Stuck.freed.set()
        proxy.shutdown()
        proxy.server_close()
    # storage_options' own timeouts are the ones used; gpufeed's fill in those they leave out
    config = locations.with_timeouts("s3://b/s", {"config_kwargs": {"read_timeout": 7}})["config_kwargs"]
    assert config == {"read_timeout": 7, "connect_timeout": 0.3, "retries": {"total_max_attempts": 1}}
    client = locations.with_timeouts("https://host/s", {})["client_kwargs"]
    assert client["timeout"].sock_read == client["timeout"].sock_connect == 0.3


def test_what_killed_processes_left_is_reclaimed_and_what_live_ones_hold_is_not(bucket, tmp_path, monkeypatch):
    """A reader killed mid-download left its temporary folder in the cache, and a pack to a bucket killed
    mid-pack its scratch folder in TMPDIR, for good: the next store opened on that cache, and the next
    pack, remove them (and the cache's temporary folders of a gpufeed before folders were held), never
    a folder a live process holds, nor one in TMPDIR that is not a held pack's."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import textwrap
    from pathlib import Path

    from gpufeed.store.scratch import held_folder
    from gpufeed.synth import natural_image

    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(f"""
        import threading, time
        import gpufeed
        from gpufeed.store.fetch import Fetcher

        store = gpufeed.open("s3://bucket/train", cache_dir={str(cache)!r}, storage_options={bucket["options"]!r})
        stuck = threading.Event()

        def get(self, remote, files, into):  # a download that never ends: the process is killed in it
            (into / "part").write_bytes(b"partial")
            stuck.set()
            time.sleep(600)

        Fetcher.get = get
        threading.Thread(target=store.cache.ensure, args=(0,), daemon=True).start()
        if not stuck.wait(60):
            raise SystemExit("the shard's download was not the one patched")

        class Stalled:  # a dataset the pack never finishes reading
            def __len__(self):
                return 2

            def __getitem__(self, i):
                print("stuck", flush=True)
                time.sleep(600)

        gpufeed.pack(Stalled(), "s3://bucket/killed", mode="jpeg", workers=1, progress=False,
                     storage_options={bucket["options"]!r})
    """))
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(Path(gpufeed.__file__).parent.parent),
                                                                      os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout.readline() == "stuck\n"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    dead = [*(cache / "shards").glob(f".00000-{child.pid}-*"), *tmp.glob(f"gpufeed-pack-{child.pid}-*")]
    assert len(dead) == 2 and (dead[0] / "part").exists()
    legacy = cache / "shards" / ".00001-abcd_123"  # a download folder of a gpufeed before they were held
    foreign = tmp / "gpufeed-pack-x8d_2k1q"  # in TMPDIR, a folder no held pack made: not ours to judge
    for folder in (legacy, foreign):
        folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with held_folder(cache / "shards", ".00002-") as reading, held_folder(tmp, "gpufeed-pack-") as packing:
        _open(bucket, "s3://bucket/train", cache)
        rng = np.random.default_rng(0)
        data = [{"image": natural_image(rng, 32, 32, k), "label": 0} for k in range(2)]
        gpufeed.pack(data, "s3://bucket/after-kill", mode="jpeg", workers=1, progress=False,
                     storage_options=bucket["options"])
        assert not any(folder.exists() for folder in (*dead, legacy))
        assert reading.exists() and packing.exists() and foreign.exists()


@pytest.mark.parametrize("how", ["deleted", "read-only"])
def test_a_cache_folder_deleted_or_made_read_only_mid_epoch_is_named(bucket, tmp_path, how):
    """The cache folder deleted (or made read-only) under a Loader mid-epoch: a StoreError naming the
    folder and what became of it, not a raw FileNotFoundError or OSError (nor "not found" in the bucket)."""
    import shutil

    if how == "read-only":
        probe = tmp_path / "probe"
        probe.mkdir(mode=0o555)
        try:
            (probe / "file").touch()
            pytest.skip("this user writes into a read-only folder (root)")
        except PermissionError:
            pass
    cache = tmp_path / "cache"
    store = _open(bucket, "s3://bucket/train", cache)
    limit = smallest_cache(store, 4)
    assert limit < store.nbytes  # the epoch downloads after the change, and evicts
    loader = gpufeed.Loader("s3://bucket/train", batch_size=4, device="cpu", augment=OPS, num_workers=1,
                            cache_dir=cache, storage_options=bucket["options"], cache_limit=limit)
    batches = iter(loader)
    next(batches)
    try:
        if how == "deleted":
            while cache.exists():  # (the fetch ahead may be writing in it)
                shutil.rmtree(cache, ignore_errors=True)
        else:
            for folder in (cache, *[p for p in cache.rglob("*") if p.is_dir()]):
                folder.chmod(0o555)
        became = "gone" if how == "deleted" else "not writable"
        with pytest.raises(StoreError, match=f"cache folder {cache}.* {became}"):
            for _ in batches:
                pass
    finally:
        loader.close()
        for folder in (cache, *[p for p in cache.rglob("*") if p.is_dir()]) if cache.exists() else ():
            folder.chmod(0o755)


def test_a_store_url_with_a_query_or_fragment_is_refused_not_cut(bucket, tmp_path):
    """A store's URL names its folder, and each file's URL is made from it: a query or a fragment can't
    be kept, and is refused (it was dropped without a word, or became part of a key), its text not
    shown; nothing is made in the cache or the bucket."""
    fs = bucket["fs"]
    for url in ("s3://bucket/train?versionId=abc123", "s3://bucket/train#abc123", "s3://bucket/new?X-Amz-Signature=abc123"):
        with pytest.raises(ValueError, match=r"s3://bucket/(train|new): a store's URL can't have a query") as error:
            gpufeed.Loader(url, batch_size=4, device="cpu", augment=OPS, cache_dir=tmp_path / "cache",
                           storage_options=bucket["options"])
        assert "abc123" not in str(error.value) and not (tmp_path / "cache").exists()
        with pytest.raises(ValueError, match="query") as error:
            gpufeed.pack(bucket["src"], url, mode="jpeg", workers=1, progress=False, storage_options=bucket["options"],
                         overwrite=True)
        assert "abc123" not in str(error.value)
    fs.invalidate_cache()
    assert not [p for p in fs.find("bucket") if "?" in p or "#" in p or p.startswith("bucket/new")]


def _deleted_maps(folder) -> set[str]:
    """The files under `folder` this process still maps though they are deleted (their room not freed)."""
    with open("/proc/self/maps") as f:
        lines = f.read().splitlines()
    return {line.split(maxsplit=5)[-1] for line in lines if line.endswith(" (deleted)") and str(folder) in line}


def test_a_batch_s_fields_come_from_the_shards_it_was_read_from_not_a_new_download(bucket, tmp_path, monkeypatch):
    """A batch's fields ("source" here) are read on the training thread from the shards its images were
    read from, as opened then: a training loop slower than the producer found them evicted and the
    cache downloaded them again on its thread (159 downloads an epoch instead of 82)."""
    import threading
    import time

    from gpufeed.store.remote import ShardCache

    cache = tmp_path / "cache"
    limit = smallest_cache(_open(bucket, "s3://bucket/train", tmp_path / "peek"), 4)
    where, real = [], ShardCache._download

    def download(self, k, ahead):
        where.append(threading.current_thread().name)
        return real(self, k, ahead)

    monkeypatch.setattr(ShardCache, "_download", download)
    loader = gpufeed.Loader("s3://bucket/train", batch_size=4, device="cpu", augment=OPS, num_workers=1,
                            cache_dir=cache, storage_options=bucket["options"], cache_limit=limit, fields=("source",),
                            drop_last=False, pad=False)
    flat = gpufeed.open(bucket["flat"])
    try:
        seen = []
        for number, batch in enumerate(loader):
            time.sleep(0.15)  # a training step: the producer runs ahead, and the cache evicts behind it
            samples = loader.plan(0, number)[0].tolist()
            assert batch["source"] == [flat.source(i) for i in samples]
            seen += samples
        assert sorted(seen) == list(range(40)) and where
        assert threading.current_thread().name not in where
    finally:
        loader.close()


def test_a_remote_store_lets_go_of_the_shards_its_cache_evicted(bucket, tmp_path):
    """Opening a shard lets go of those opened before that the cache evicted (and this process does not
    hold): their memory maps kept the deleted files' room on the cache disk, every shard of an epoch
    over a cache of a few."""
    import gc

    store = _open(bucket, "s3://bucket/train", tmp_path / "cache")
    sizes = [s["bytes"] for s in store.manifest.shards]
    store.cache.limit = sizes[0] + sizes[1] + max(sizes[2:4])  # room for three shards
    store.shard(0), store.shard(1), store.shard(2)
    store.cache.hold(1)
    try:
        store.shard(3)  # evicts 0 (the least recently used, not held) for 3, and lets go of its maps
        gc.collect()
        assert not store.cache.present(0) and store.cache.present(1)
        assert not _deleted_maps(tmp_path / "cache")
    finally:
        store.cache.release(1)


@pytest.fixture(scope="module")
def many_shards(bucket, tmp_path_factory):
    """A store in the bucket of 48 small images in about 24 shards: a cache of a few holds little of it."""
    from gpufeed.synth import natural_image

    rng = np.random.default_rng(4)
    data = [{"image": natural_image(rng, 24, 24, k), "label": k % 3} for k in range(48)]
    gpufeed.pack(data, "s3://bucket/many", mode="jpeg", workers=1, progress=False, shard_size="1500B",
                 storage_options=bucket["options"], overwrite=True)
    store = gpufeed.open("s3://bucket/many", cache_dir=tmp_path_factory.mktemp("peek"),
                         storage_options=bucket["options"])
    assert len(store.manifest.shards) >= 20
    return store


def test_processes_sharing_a_cache_folder_are_sized_together_or_refused(bucket, many_shards, tmp_path, monkeypatch):
    """A cache folder read by another process now: another cache_limit is refused, and so is one more
    process than LOCAL_WORLD_SIZE says, with the settings to use (each counted on its part of the
    limit alone: two ranks blocked for two minutes mid-epoch, then failed; the smaller limit blamed
    itself for the other's shards); with them, it reads. A process gone no longer counts. A store only
    opened (as `gpufeed inspect` opens it) joins no cache folder's readers: it reads beside them."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cache, url = tmp_path / "cache", "s3://bucket/many"
    one = smallest_cache(many_shards, 1)  # (LOCAL_WORLD_SIZE unset: one rank)
    two = 2 * one
    assert two < many_shards.nbytes
    script = tmp_path / "other.py"
    script.write_text(textwrap.dedent(f"""
        import time
        import gpufeed
        store = gpufeed.open({url!r}, cache_dir={str(cache)!r}, cache_limit={two},
                             storage_options={bucket["options"]!r})
        store.cache.join()  # as a Loader joins as it is made
        print("open", flush=True)
        time.sleep(600)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(gpufeed.__file__).parent.parent),
                                                      os.environ.get("PYTHONPATH", "")]))
    other = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    kw = dict(batch_size=1, device="cpu", augment=OPS, num_workers=1, cache_dir=cache,
              storage_options=bucket["options"])
    try:
        assert other.stdout.readline() == "open\n"
        differs = rf"read now by process {other.pid} on \S+ with cache_limit {two} \(this one: {one}\)"
        with pytest.raises(ValueError, match=differs):
            gpufeed.Loader(url, cache_limit=one, **kw)
        looked = gpufeed.open(url, cache_dir=cache, storage_options=bucket["options"])  # no limit: only looks
        assert len(looked) == len(many_shards) and looked.cache.others()[0].pid == other.pid
        looked.close()
        with pytest.raises(ValueError, match=rf"LOCAL_WORLD_SIZE=2 .*cache_limit at least {two} bytes"):
            gpufeed.Loader(url, cache_limit=two, **kw)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        loader = gpufeed.Loader(url, cache_limit=two, **kw)
        assert len([batch for _, batch in zip(range(6), loader)]) == 6
        loader.close()
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    gpufeed.Loader(url, cache_limit=one, **kw).close()  # the other process is gone


def test_a_shuffle_window_the_cache_can_t_hold_is_refused_with_the_one_it_can(bucket, many_shards, tmp_path):
    """A shuffle_window asked for (a full shuffle, here) through a cache too small for it is refused
    when the Loader is made, naming the window that fits and the limit the asked one needs (it failed
    mid-epoch); the window named reads every sample once."""
    import re

    shards = len(many_shards.manifest.shards)
    limit = smallest_cache(many_shards, 1) + max(s["bytes"] for s in many_shards.manifest.shards)
    kw = dict(batch_size=1, device="cpu", augment=OPS, num_workers=1, cache_dir=tmp_path / "cache",
              storage_options=bucket["options"], cache_limit=limit)
    with pytest.raises(ValueError, match=rf"shuffle_window {shards} .*at most (\d+), or raise cache_limit to "
                                          rf"{many_shards.nbytes} bytes") as error:
        gpufeed.Loader("s3://bucket/many", shuffle_window=shards, **kw)
    fits = int(re.search(r"at most (\d+)", str(error.value)).group(1))
    assert fits == 2
    loader = gpufeed.Loader("s3://bucket/many", shuffle_window=fits, **kw)
    try:
        assert sorted(torch.cat([y for _, y in loader]).tolist()) == sorted(many_shards.labels.tolist())
    finally:
        loader.close()
