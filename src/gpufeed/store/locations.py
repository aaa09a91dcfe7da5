"""Where a store is, and how big: names and sizes a user gives, read without torch (packing workers and
the CLI import this, not the readers)."""

from __future__ import annotations

import re


def is_url(path: object) -> bool:
    """Whether `path` names a store through fsspec (`protocol://...`) rather than a local path."""
    return isinstance(path, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None


def shown(url: str) -> str:
    """`url` as it may be logged: no user, password or query (which may hold signatures or keys)."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1", url.split("?", 1)[0])


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
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise ImportError(f"{shown(url)}: no fsspec filesystem for it ({e}; e.g. pip install s3fs for s3://)") from None
