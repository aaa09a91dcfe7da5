"""Describe a store for people: a summary table and a PNG grid of samples with their labels."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from gpufeed.store.format import VIDEO_DECODERS, StoreError
from gpufeed.store.locations import is_url
from gpufeed.store.reader import Store


def _kind(spec: dict) -> str:
    if spec["kind"] == "masks":
        return "instance masks" if spec["instances"] else f"{spec['dtype'].lstrip('<|')} label maps"
    if spec["kind"] == "keypoints":
        return f"keypoints, {spec['points']} per instance"
    if spec["kind"] != "array":
        return spec["kind"]
    return f"{spec['dtype'].lstrip('<|')} array {'x'.join(map(str, spec['shape']))}"


def describe(store: Store) -> str:
    """Multi-line summary: count, mode, shape, size on disk, classes, skipped."""
    m = store.manifest
    if store.image_shape:
        shape = "x".join(map(str, store.image_shape)) + " uint8 (HWC)"
    else:
        hw = store.shapes
        kind = "JPEG" if m.mode == "jpeg" else "video frames"
        shape = (
            f"{kind}, {int(hw[:, 0].min())}-{int(hw[:, 0].max())} x {int(hw[:, 1].min())}-{int(hw[:, 1].max())} px"
            if len(store)
            else kind
        )
        if m.mode == "video" and len(store):
            frames = np.diff(np.asarray(store.frame_offsets))
            shape += f", {int(frames.min())}-{int(frames.max())} frames ({int(frames.sum())} in all)"
    # labels of a store with classes are checked to be below len(classes) when it opens
    counts: torch.Tensor | list[int] = (
        torch.bincount(store.labels[store.labels >= 0], minlength=len(m.classes)) if m.classes else []
    )
    classes = ", ".join(f"{c} ({int(n)})" for c, n in zip(m.classes[:8], counts))
    if len(m.classes) > 8:
        classes += f", ... ({len(m.classes)} in all)"
    instances = _instances(store)
    if instances and not bool((store.labels >= 0).any()):  # a detection store: no label per image, no "(0)"s
        shown = ", ".join(m.classes[:8]) + (f", ... ({len(m.classes)} in all)" if len(m.classes) > 8 else "")
        classes = f'{shown or "none"} per object (the field "category", below), none per image (label -1)'
    rows = [
        ("store", str(store.path)),
        ("format", f"{m.format} v{m.version} (gpufeed {m.gpufeed_version}, {m.created})"),
        ("mode", m.mode),
        ("count", str(len(store))),
        ("shape", shape),
        (
            "size on disk",
            f"{store.nbytes / 1e6:.1f} MB ({store.nbytes / max(len(store), 1) / 1e3:.1f} KB/"
            f"{'video' if m.mode == 'video' else 'image'})",
        ),
        ("classes", classes or "none (unlabelled)"),
        ("fields", ", ".join(f"{name} ({_kind(spec)})" for name, spec in m.fields.items()) or "none"),
        ("skipped", str(len(m.skipped))),
    ]
    if m.mode == "video":
        rows.insert(5, ("decoded", _video_decoding(store)))
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{k:<{width}}  {v}" for k, v in rows] + instances)


def _video_decoding(store: Store) -> str:
    """How a video store's clips are decoded: from their packets alone by codec (`store.format`'s
    decoding.i64), and how many through their containers (slower: a store packed before the packets
    were indexed, or a codec or container that does not allow it)."""
    skips = (
        "packed before pack checked them" if store.nonref is None else f"{int(np.sum(store.nonref))} of {len(store)}"
    )
    skipping = f"; videos whose unreferenced frames a clip skips: {skips}"
    if store.decoding is None:
        return "every video through its container (packed before gpufeed indexed packets: pack again)" + skipping
    decoders = np.asarray(store.decoding[:, 0])
    alone = Counter(VIDEO_DECODERS[d] for d in decoders[decoders >= 0].tolist())
    parts = [f"{n} {codec}" for codec, n in sorted(alone.items())]
    through = store.through_container()
    text = f"from packets alone: {', '.join(parts) or 'none'}"
    text += f"; {through} through their containers" if through else ""
    return text + skipping


def _instances(store: Store) -> list[str]:
    """Lines counting the objects of each category, "  person: 1,234 instances (id 1, 12 crowd)", in
    id order under a heading: a store whose samples carry their objects' category ids (a JSON field
    "category", as a COCO file packs), named by `store.categories` where it records them; [] for
    others. A store in a bucket is not counted (every shard would be downloaded)."""
    fields = store.fields
    if fields.get("category", {}).get("kind") != "json":
        return []
    names = store.categories
    if is_url(str(store.path)):
        listed = ", ".join(f"{name} (id {c})" for c, name in names.items()) or "not recorded"
        return [f"categories: {listed}; instances not counted (a store in a bucket: its shards would be downloaded)"]
    counts: Counter = Counter()
    crowd: Counter = Counter()
    unreadable = 0
    column = store.column("category")
    marks = store.column("iscrowd") if fields.get("iscrowd", {}).get("kind") == "json" else None
    for i in range(len(store)):
        try:
            ids = column.value(i)
            flags = marks.value(i) if marks is not None else None
        except StoreError:
            unreadable += 1
            continue
        if not isinstance(ids, list):
            continue
        flags = flags if isinstance(flags, list) and len(flags) == len(ids) else [0] * len(ids)
        for c, flag in zip(ids, flags):
            key = c if isinstance(c, (int, str)) else str(c)
            counts[key] += 1
            crowd[key] += bool(flag)
    lines = []
    for c in sorted(set(names) | set(counts), key=lambda c: (isinstance(c, str), c)):  # ids: numbers, then text
        n = f"{counts[c]:,} instance{'' if counts[c] == 1 else 's'}"
        said = f"{crowd[c]:,} crowd" if crowd[c] else ""
        if c in names:
            lines.append(f"  {names[c]}: {n} (id {c}{', ' + said if said else ''})")
        else:  # a store that does not record the categories' names
            lines.append(f"  id {c}: {n}{f' ({said})' if said else ''}")
    if unreadable:
        lines.append(f"  ({unreadable} samples' categories unreadable: gpufeed verify names the damaged files)")
    heading = "instances per category"
    if crowd.total():
        heading += " (a Loader leaves crowd ones out unless keep_crowd=True)"
    return [f"{heading}:", *lines] if lines else [f"{heading}: none"]


def list_skipped(store: Store, limit: int | None = 20) -> str:
    """The files the pack skipped, one per line with its reason; the first `limit` (None: all)."""
    skipped = store.manifest.skipped
    shown = skipped if limit is None else skipped[:limit]
    lines = [f"  {s.get('path', '?')}: {s.get('reason', '?')}" for s in shown]
    if len(shown) < len(skipped):
        lines.append(f"  ... and {len(skipped) - len(shown)} more (--all-skipped lists every one)")
    return "\n".join(["skipped files:", *lines]) if lines else ""


BLANK = (224, 224, 224)  # the tile of a sample that could not be decoded


def save_grid(
    store: Store, out: str | Path, n: int = 16, tile: int = 128, columns: int = 8
) -> tuple[Path, dict[int, str]]:
    """Write a PNG grid of `n` samples spread evenly over the store, captioned with labels. Returns the
    PNG's path and the samples that could not be decoded (index: why), drawn as blank tiles: a jpeg
    store whose bytes were damaged after packing (`verify` names the file)."""
    n = min(n, len(store))
    picks = torch.linspace(0, len(store) - 1, n).round().long().tolist() if n else []
    rows = max(1, -(-n // columns))
    canvas = Image.new("RGB", (columns * tile, rows * (tile + 14)), "white")
    draw = ImageDraw.Draw(canvas)
    undecodable: dict[int, str] = {}
    for k, i in enumerate(picks):
        x, y = (k % columns) * tile, (k // columns) * (tile + 14)
        try:
            # a video's middle frame (not all of them: `store[i]` decodes every frame)
            image, label = (store.frame(i), int(store.labels[i])) if store.mode == "video" else store[i]
        except (RuntimeError, ValueError, OSError) as e:  # Pillow's decode raises OSError
            undecodable[i] = f"{type(e).__name__}: {e}"
            draw.rectangle((x, y, x + tile - 1, y + tile - 1), fill=BLANK)
            draw.text((x + 2, y + tile), f"{i}: undecodable", fill="black")
            continue
        pil = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
        pil.thumbnail((tile, tile))
        canvas.paste(pil, (x + (tile - pil.width) // 2, y + (tile - pil.height) // 2))
        name = store.classes[label] if 0 <= label < len(store.classes) else str(label)
        draw.text((x + 2, y + tile), f"{i}: {name}"[:22], fill="black")
    out = Path(out)
    canvas.save(out)
    return out, undecodable
