"""The same photos served by other streaming libraries, for remote_bench's comparison rows: MosaicML
streaming (MDS shards) and LitData (its optimized chunks), written from the image folder, uploaded to
the benchmark's bucket and read back through the same link with each library's own cache and data
loader. Neither decodes on the GPU: their workers decode with PIL and crop and flip with torchvision
(the recipe of feeds.py), the batches are normalized to fp16 on the device, as feeds.py's
`dataloader` row does. A benchmark-only import; the libraries are not gpufeed dependencies.

Each `Other` yields (images, labels) on the device for one epoch per iteration, and tells the bytes
its cache folder holds (neither counts what it downloaded).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

LIBRARIES = ("streaming", "litdata")


def available() -> list[str]:
    """The libraries that import here (MosaicML streaming imports transformers at its import)."""
    out = []
    for name in LIBRARIES:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a missing or broken optional install: no row
            continue
        out.append(name)
    return out


def _samples(folder: Path) -> list[tuple[str, int]]:
    """(path, label) of the folder's images, classes in sorted order, as ImageFolder numbers them."""
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    return [(str(f), k) for k, c in enumerate(classes) for f in sorted((folder / c).iterdir())]


def _record(item: tuple[str, int]) -> dict:
    """One sample as both libraries store it: the JPEG's bytes and its label (LitData's `optimize`
    calls this in its workers: a module function)."""
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def write(name: str, folder: Path, local: Path, shard_bytes: int) -> Path:
    """`folder`'s photos in library `name`'s format under `local` (made once), shards of about
    `shard_bytes`, as that library's writer makes them."""
    if local.exists():
        return local
    samples = _samples(folder)
    if name == "streaming":
        from streaming import MDSWriter

        with MDSWriter(out=str(local), columns={"image": "bytes", "label": "int"}, size_limit=shard_bytes) as out:
            for item in samples:
                out.write(_record(item))
    else:
        import litdata

        litdata.optimize(fn=_record, inputs=samples, output_dir=str(local), chunk_bytes=shard_bytes,
                         num_workers=min(8, os.cpu_count() or 1), start_method="fork", verbose=False)
    return local


# chunks a LitData worker keeps in its cache at once: max(4, max_pre_download) (its StreamingDataset;
# its own warning puts the peak at workers x max_pre_download x chunk size)
LITDATA_KEEP = 4


def workers_for(name: str, workers: int, cache_limit: int | None, shard_bytes: int) -> int:
    """The data loader workers library `name` gets for a cache of `cache_limit` bytes: LitData as many
    as keep their chunks within it (one at least), by its own rule; its 16 workers through a quarter
    cache (1 GB of chunks kept in 145 MB) thrashed and its downloads hung, twice. The others: `workers`."""
    if name != "litdata" or cache_limit is None:
        return workers
    return max(1, min(workers, cache_limit // (LITDATA_KEEP * shard_bytes)))


class _Decode:
    """PIL decode, then feeds.py's CPU recipe (crop, flip, uint8 CHW); a class, not a closure, so that
    spawned workers get it pickled."""

    def __init__(self, size: int):
        from feeds import cpu_recipe

        self.tf = cpu_recipe(size)

    def __call__(self, sample: dict):
        from PIL import Image

        return self.tf(Image.open(io.BytesIO(sample["image"])).convert("RGB")), int(sample["label"])


class Other:
    """Library `name`'s dataset over `url` (s3://BUCKET/PREFIX) with its cache in `cache` (at most
    `cache_limit` bytes, None: no limit) and its data loader of `workers` processes; `endpoint` and
    (key, secret) reach the bucket."""

    def __init__(self, name: str, url: str, cache: Path, endpoint: str, keys: tuple[str, str], batch: int,
                 size: int, device: str, workers: int, cache_limit: int | None = None):
        self.name, self.cache, self.device = name, cache, device
        cache.mkdir(parents=True, exist_ok=True)
        if name == "streaming":
            self.loader = _streaming(url, cache, endpoint, keys, batch, size, workers, cache_limit)
        else:
            self.loader = _litdata(url, cache, endpoint, keys, batch, size, workers, cache_limit)

    def __iter__(self):
        from feeds import normalized

        return normalized(self.loader, self.device)

    def cached(self) -> int:
        """Bytes in the cache folder now."""
        return sum(f.stat().st_size for f in self.cache.rglob("*") if f.is_file())


def _streaming(url, cache, endpoint, keys, batch, size, workers, cache_limit):
    from streaming import StreamingDataLoader, StreamingDataset

    os.environ.update(S3_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=keys[0], AWS_SECRET_ACCESS_KEY=keys[1])
    decode = _Decode(size)

    class Photos(StreamingDataset):
        def __getitem__(self, i):
            return decode(super().__getitem__(i))

    data = Photos(remote=url, local=str(cache), shuffle=True, batch_size=batch, cache_limit=cache_limit)
    return StreamingDataLoader(data, batch_size=batch, num_workers=workers, drop_last=True, pin_memory=True,
                               persistent_workers=workers > 0, prefetch_factor=4 if workers else None)


def _litdata(url, cache, endpoint, keys, batch, size, workers, cache_limit):
    import litdata

    if endpoint.startswith("http:"):
        _allow_http()

    decode = _Decode(size)
    options = {"endpoint_url": endpoint, "aws_access_key_id": keys[0], "aws_secret_access_key": keys[1]}
    limit = cache_limit if cache_limit is not None else "1000GB"
    data = litdata.StreamingDataset(url, cache_dir=str(cache), shuffle=True, drop_last=True, storage_options=options,
                                    max_cache_size=limit, transform=decode)
    # workers spawned: forked ones waited for chunks that never came (a 16-core H200, twice; LitData's
    # error names obstore after a fork), and each says allow_http again (`_allow_http`)
    spawned = dict(multiprocessing_context="spawn", worker_init_fn=_allow_http if endpoint.startswith("http:") else None)
    return litdata.StreamingDataLoader(data, batch_size=batch, num_workers=workers, pin_memory=True,
                                       persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                                       **(spawned if workers else {}))


def _allow_http(worker: int | None = None) -> None:
    """LitData's chunk downloads go through obstore, whose client refuses plain http unless told: the
    local server is http. Said in this process and in each spawned worker (`worker`: its number)."""
    from litdata.streaming import downloader

    if isinstance(getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None), dict):
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
