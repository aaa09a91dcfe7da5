"""The half of the Ray adapter that runs on Ray's CPU workers: read, decode, fit to S×S uint8.

These functions run wherever Ray schedules them, so they import only numpy, Pillow and the
store reader; the GPU host never decodes.
"""

from __future__ import annotations

import os

import numpy as np
import ray.data
from PIL import Image

from gpufeed.logs import logger
from gpufeed.packing import imaging

log = logger(__name__)


def read_store(
    path: str | os.PathLike, rows_per_block: int = 1024, rank: int | None = None, world_size: int | None = None
) -> ray.data.Dataset:
    """A Ray Dataset of this rank's samples of a gpufeed store (rank::world_size), rows
    {"image", "label"} (in store order where Ray Data preserves order).

    `image` is HWC uint8 pixels for raw stores and the encoded bytes for jpeg stores. Rank and
    world size come from the arguments, else torch.distributed, else RANK/WORLD_SIZE, as for
    the Loader. The store is opened by the workers, so `path` must be the same on every node
    (shared filesystem, or the store copied to each node).
    """
    from gpufeed.loader.sampler import resolve_rank
    from gpufeed.store.opening import open_store

    path = os.path.abspath(path)
    rank, world_size = resolve_rank(rank, world_size)
    mine = np.arange(rank, len(open_store(path)), world_size)
    blocks = max(1, -(-len(mine) // rows_per_block))
    ids = ray.data.from_numpy(mine).repartition(blocks)
    # (ray's annotation wants a function of the batch alone; fn_kwargs gives the rest)
    return ids.map_batches(_store_rows, fn_kwargs={"path": path}, batch_format="numpy")  # type: ignore[arg-type]


def _store_rows(batch: dict[str, np.ndarray], path: str) -> dict[str, np.ndarray]:
    from gpufeed.store.opening import open_store

    store = open_store(path)  # O(1): a manifest read and memory maps
    idx = batch["data"]
    labels = np.asarray(store.labels)[idx]
    if store.mode == "raw":
        return {"image": np.take(store.images, idx, axis=0), "label": labels}
    encoded = np.empty(len(idx), dtype=object)
    for k, i in enumerate(idx):
        encoded[k] = bytes(store.data[store.offsets[i] : store.offsets[i + 1]])
    return {"image": encoded, "label": labels}


def fixed_size(
    dataset: ray.data.Dataset,
    size: int,
    fit: str = "crop",
    image_column: str = "image",
    max_pixels: int = imaging.DEFAULT_MAX_PIXELS,
) -> ray.data.Dataset:
    """`dataset` with every image as size×size×3 uint8, made on the Ray workers.

    Images may be decoded arrays (`ray.data.read_images`) or encoded bytes (`read_store` of a
    jpeg store, `read_binary_files`); JPEGs are downscaled in the DCT domain while decoding,
    exactly as `gpufeed.pack` does, so a batch matches a raw store packed with the same size
    and fit. Images that cannot be decoded are dropped, each with a warning naming its row.
    """
    return dataset.map_batches(
        _fit_batch,  # type: ignore[arg-type]  # (a function of the batch and fn_kwargs)
        batch_format="numpy",
        fn_kwargs={"size": size, "fit": fit, "column": image_column, "max_pixels": max_pixels},
    )


def _fit_batch(
    batch: dict[str, np.ndarray], size: int, fit: str, column: str, max_pixels: int
) -> dict[str, np.ndarray]:
    images = batch[column]
    if isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.shape[1:] == (size, size, 3):
        return batch
    out = np.empty((len(images), size, size, 3), dtype=np.uint8)
    keep = np.ones(len(images), dtype=bool)
    with imaging.own_bomb_guard():
        for k, image in enumerate(images):
            try:
                out[k] = _fit_one(image, size, fit, max_pixels)
            except imaging.BadImage as e:
                keep[k] = False
                name = batch["path"][k] if "path" in batch else f"row {k} of a batch"
                log.warning("gpufeed.ray: %s dropped: %s", name, e)
    rest = {key: value[keep] for key, value in batch.items() if key != column}
    return {column: out[keep], **rest}


def _fit_one(image, size: int, fit: str, max_pixels: int) -> np.ndarray:
    if isinstance(image, (bytes, bytearray, memoryview)):
        img = imaging.decode(bytes(image), "raw", size, fit, max_pixels=max_pixels, max_side=size)
    else:
        array = np.asarray(image, dtype=np.uint8)
        img = imaging.to_rgb(Image.fromarray(array if array.ndim == 2 or array.shape[2] != 1 else array[:, :, 0]))
    return imaging.fit_square(img, size, fit)
