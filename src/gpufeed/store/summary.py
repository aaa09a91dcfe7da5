"""Describe a store for people: a summary table and a PNG grid of samples with their labels."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw

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
        shape = (
            f"JPEG, {int(hw[:, 0].min())}-{int(hw[:, 0].max())} x {int(hw[:, 1].min())}-{int(hw[:, 1].max())} px"
            if len(store)
            else "JPEG"
        )
    # labels of a store with classes are checked to be below len(classes) when it opens
    counts: torch.Tensor | list[int] = (
        torch.bincount(store.labels[store.labels >= 0], minlength=len(m.classes)) if m.classes else []
    )
    classes = ", ".join(f"{c} ({int(n)})" for c, n in zip(m.classes[:8], counts))
    if len(m.classes) > 8:
        classes += f", ... ({len(m.classes)} in all)"
    rows = [
        ("store", str(store.path)),
        ("format", f"{m.format} v{m.version} (gpufeed {m.gpufeed_version}, {m.created})"),
        ("mode", m.mode),
        ("count", str(len(store))),
        ("shape", shape),
        ("size on disk", f"{store.nbytes / 1e6:.1f} MB ({store.nbytes / max(len(store), 1) / 1e3:.1f} KB/image)"),
        ("classes", classes or "none (unlabelled)"),
        ("fields", ", ".join(f"{name} ({_kind(spec)})" for name, spec in m.fields.items()) or "none"),
        ("skipped", str(len(m.skipped))),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


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
            image, label = store[i]
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
