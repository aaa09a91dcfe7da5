"""Where a store is, and how big: names and sizes a user gives, read without torch (packing workers and
the CLI import this, not the readers)."""

from __future__ import annotations

import re

CONNECT_TIMEOUT = 10.0  # seconds a request to a bucket waits for its connection (one in reach connects in ms)
READ_TIMEOUT = 30.0  # seconds a request waits for the next bytes of its answer (a bucket's first byte: well under 1 s)


def is_url(path: object) -> bool:
    """Whether `path` names a store through fsspec (`protocol://...`) rather than a local path."""
    return isinstance(path, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None


def shown(url: str) -> str:
    """`url` as it may be logged: no user, password or query (which may hold signatures or keys)."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1", url.split("?", 1)[0])


def store_url(url: str) -> str:
    """`url`, a store's in a bucket (its folder: gpufeed adds each file's path to it), without a
    trailing "/"; a ValueError where it has a query (`?...`) or a fragment (`#...`), which no file's
    URL made from it could keep: they were dropped without a word (or became part of a key). The
    message shows neither (a query may hold a signature)."""
    if "?" in url or "#" in url:
        raise ValueError(
            f"{shown(url).split('#', 1)[0]}: a store's URL can't have a query (?...) or a fragment (#...): it "
            "names the store's folder, and each file's URL is made from it; give the folder's plain URL "
            "(credentials and other settings go in storage_options)"
        )
    return url.rstrip("/")


def parse_size(size: int | str | None, what: str = "size") -> int | None:
    """Bytes from an int or a string with a unit ("256MB", "200GB", "1.5GiB", "512k"); None stays None."""
    if size is None:
        return None
    if isinstance(size, bool):
        raise ValueError(f"{what} must be a number of bytes or a string with a unit, got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        units = {
            "": 1,
            "b": 1,
            "k": 1e3,
            "kb": 1e3,
            "m": 1e6,
            "mb": 1e6,
            "g": 1e9,
            "gb": 1e9,
            "t": 1e12,
            "tb": 1e12,
            "kib": 1 << 10,
            "mib": 1 << 20,
            "gib": 1 << 30,
            "tib": 1 << 40,
        }
        text = str(size).strip().lower().replace(" ", "")
        number = text.rstrip("kmgtbi")
        unit = text[len(number) :]
        try:
            value = int(float(number) * units[unit])
        except (ValueError, KeyError):
            raise ValueError(
                f"{what} {size!r}: not a number of bytes or a number with a unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            ) from None
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {size!r}")
    return value


def filesystem(url: str, storage_options: dict | None):
    """(fsspec filesystem, path in it) for `url`. A URL that holds credentials is refused (they would be
    shown wherever the URL is): they go in `storage_options`, or where the filesystem reads them."""
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            "stores in a bucket need fsspec (pip install fsspec, and s3fs, gcsfs or adlfs for S3, GCS or Azure)"
        ) from None
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/@]*@", url):
        raise ValueError(
            f"{shown(url)}: credentials in a URL are not used (nor shown): give them in "
            "storage_options, or as the filesystem reads them (environment, config files)"
        )
    try:
        return fsspec.core.url_to_fs(url, **with_timeouts(url, storage_options or {}))
    except (ImportError, ValueError) as e:
        raise ImportError(f"{shown(url)}: no fsspec filesystem for it ({e}; e.g. pip install s3fs for s3://)") from None


def with_timeouts(url: str, options: dict) -> dict:
    """`options` (fsspec's storage_options) with a connect and a read timeout for every request, where
    the filesystem of `url` is one whose settings gpufeed knows and `options` set none: `CONNECT_TIMEOUT`
    and `READ_TIMEOUT`. S3 (s3fs): botocore's `config_kwargs` "connect_timeout" and "read_timeout", and
    its retries off ("retries": {"total_max_attempts": 1}; s3fs tries each request 5 times, gpufeed each
    download again): botocore's own 60 s and 5 attempts, under s3fs's 5 and gpufeed's tries, left a
    server that accepts and never answers waiting for hours. HTTP(S): aiohttp's `client_kwargs`
    "timeout" (a `ClientTimeout` of sock_connect and sock_read, and no total: a large file may take
    longer than its 300 s). Other filesystems keep their own settings."""
    protocol = url.split("://", 1)[0].lower()
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", CONNECT_TIMEOUT)
        config.setdefault("read_timeout", READ_TIMEOUT)
        config.setdefault("retries", {"total_max_attempts": 1})
        return {**options, "config_kwargs": config}
    if protocol in ("http", "https"):
        client = dict(options.get("client_kwargs") or {})
        if "timeout" not in client:
            import aiohttp  # fsspec's HTTP filesystem runs on it

            client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT)
        return {**options, "client_kwargs": client}
    return options
