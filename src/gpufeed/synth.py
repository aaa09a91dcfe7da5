"""Natural-looking sample images made on the spot (no download) for the demo, tests and bench.

Smooth multi-scale colour fields plus shapes and fine grain: they compress like photos
(tens of KB at 500×375, quality 90), unlike flat colour, so decode timings mean something.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from gpufeed.processes import run_each


def _field(rng: np.random.Generator, h: int, w: int, cells: int, amp: float) -> np.ndarray:
    small = rng.normal(0, amp, size=(max(2, h * cells // max(h, w)), max(2, w * cells // max(h, w)), 3))
    img = Image.fromarray(np.clip(small + 128, 0, 255).astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.float32) - 128


def natural_image(rng: np.random.Generator, height: int = 375, width: int = 500, label: int = 0) -> np.ndarray:
    """One HWC uint8 image; `label` tints it so classes differ visibly."""
    base = np.array([(label * 67) % 256, (label * 137 + 80) % 256, (label * 29 + 160) % 256], np.float32)
    img = 0.5 * base + 64
    img = img + _field(rng, height, width, 4, 60) + _field(rng, height, width, 24, 30)
    img = img + _field(rng, height, width, 120, 12) + rng.normal(0, 4, size=(height, width, 3))
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    for _ in range(rng.integers(2, 6)):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1, y1 = x0 + rng.integers(10, width // 2), y0 + rng.integers(10, height // 2)
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)  # type: ignore[arg-type]
    return np.asarray(pil)


def natural_images(count: int, height: int = 375, width: int = 500, seed: int = 0) -> list[np.ndarray]:
    """`count` natural-looking HWC uint8 images, one tint per index."""
    rng = np.random.default_rng(seed)
    return [natural_image(rng, height, width, i) for i in range(count)]


def photos(sizes: list[tuple[int, int]], seed: int = 0) -> list[np.ndarray]:
    """`natural_images`, one per (height, width) of `sizes`, each resized to its size."""
    return [
        np.asarray(Image.fromarray(im).resize((w, h)))
        for im, (h, w) in zip(natural_images(len(sizes), seed=seed), sizes)
    ]


def encode_jpegs(images: list[np.ndarray], quality: int = 90) -> list[bytes]:
    """Each image as baseline JPEG bytes at `quality`."""
    out = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def make_image_folder(
    root: str | Path,
    per_class: int = 32,
    classes: int = 4,
    height: int = 375,
    width: int = 500,
    quality: int = 90,
    seed: int = 0,
) -> Path:
    """Write an ImageFolder tree of JPEGs (class_000/000000.jpg, ...) and return its root."""
    root = Path(root)
    jobs = [
        (root / f"class_{c:03d}", c, start, min(start + 64, per_class), height, width, quality, seed)
        for c in range(classes)
        for start in range(0, per_class, 64)
    ]
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    run_each(_write_chunk, jobs, here=per_class * classes <= 256)
    return root


def _write_chunk(job: tuple) -> None:
    folder, label, start, stop, height, width, quality, seed = job
    rng = np.random.default_rng([seed, label, start])
    for i in range(start, stop):
        pixels = natural_image(rng, height, width, label=label)
        Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", quality=quality)


def natural_video(
    rng: np.random.Generator, frames: int, height: int = 240, width: int = 320, label: int = 0, step: int = 0
) -> np.ndarray:
    """(frames, H, W, 3) uint8: a camera panning over a natural image (`natural_image`), objects
    moving across it and sensor noise per frame, so that it compresses and decodes like footage.
    `step` > 0 instead adds `step` * frame index to every pixel of a still image (and no noise): a
    frame's content encodes its index, for tests of which frames a clip holds and of one crop per clip."""
    if step:
        base = natural_image(rng, height, width, label).astype(np.int16) // 4 + 10  # 10..73: room for 180 more
        return np.stack([np.clip(base + step * t, 0, 255).astype(np.uint8) for t in range(frames)])
    pan = max(8, frames * 2)
    scene = natural_image(rng, height + pan, width + pan, label)
    shapes = [
        (
            rng.integers(0, width),
            rng.integers(0, height),
            rng.integers(12, max(13, width // 4)),
            rng.normal(0, 3, 2),
            tuple(int(c) for c in rng.integers(0, 256, 3)),
        )
        for _ in range(int(rng.integers(2, 5)))
    ]
    dx, dy = rng.uniform(-1, 1, 2)
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        x0 = int(np.clip(pan / 2 + dx * t, 0, pan))
        y0 = int(np.clip(pan / 2 + dy * t, 0, pan))
        pil = Image.fromarray(scene[y0 : y0 + height, x0 : x0 + width])
        draw = ImageDraw.Draw(pil)
        for x, y, r, (vx, vy), color in shapes:
            cx, cy = x + vx * t, y + vy * t
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
        noisy = np.asarray(pil, np.int16) + rng.integers(-4, 5, size=(height, width, 1), dtype=np.int16)
        out[t] = np.clip(noisy, 0, 255).astype(np.uint8)
    return out


def encode_video(
    frames: np.ndarray,
    fps: int = 30,
    codec: str = "libx264",
    gop: int = 32,
    crf: int = 23,
    container: str = "mp4",
    pts: list[int] | None = None,
) -> bytes:
    """`frames` (T, H, W, 3 uint8; even sides) as a video file's bytes, a keyframe every `gop` frames,
    through PyAV (FFmpeg's libx264, libx265, libvpx-vp9 or libsvtav1 where the build has them).
    `pts`: each frame's presentation time in 1/fps units (default 0, 1, 2, ...: a variable frame rate
    where they are uneven)."""
    from gpufeed.sources.videos import pyav

    av = pyav()
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as sink:
        stream = sink.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        options = {"g": str(gop), "keyint_min": str(gop)}
        if codec in ("libx264", "libx265"):
            options |= {"crf": str(crf), "preset": "veryfast", "sc_threshold": "0"}
        elif codec == "libvpx-vp9":
            options |= {"crf": str(crf + 10), "b": "0", "deadline": "realtime", "cpu-used": "8"}
        elif codec == "libsvtav1":
            options |= {"crf": str(crf + 12), "preset": "12"}
        if codec == "libx265":
            options["x265-params"] = f"log-level=none:keyint={gop}:min-keyint={gop}:scenecut=0"
        stream.options = options
        for t, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = t if pts is None else pts[t]
            for packet in stream.encode(frame):
                sink.mux(packet)
        for packet in stream.encode(None):
            sink.mux(packet)
    return out.getvalue()


def make_video_folder(
    root: str | Path,
    per_class: int = 4,
    classes: int = 2,
    frames: tuple[int, int] = (30, 60),
    height: int = 240,
    width: int = 320,
    codec: str = "libx264",
    gop: int = 32,
    seed: int = 0,
    step: int = 0,
) -> Path:
    """A class-folder tree of videos (class_000/000000.mp4, ...) of `frames` (low, high) frames each at
    30 fps (`natural_video`; `step` as there), and its root."""
    root = Path(root)
    suffix = ".webm" if codec == "libvpx-vp9" else ".mp4"
    jobs = []
    for c in range(classes):
        folder = root / f"class_{c:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs += [
            (folder / f"{i:06d}{suffix}", c, i, frames, height, width, codec, gop, seed, step) for i in range(per_class)
        ]
    run_each(_write_video, jobs, here=len(jobs) <= 8)
    return root


def _write_video(job: tuple) -> None:
    path, label, i, frames, height, width, codec, gop, seed, step = job
    rng = np.random.default_rng([seed, label, i])
    count = int(rng.integers(frames[0], frames[1] + 1))
    clip = natural_video(rng, count, height, width, label, step)
    container = "webm" if path.suffix == ".webm" else "mp4"
    path.write_bytes(encode_video(clip, codec=codec, gop=gop, container=container, crf=12 if step else 23))
