"""What an image file is, as the JPEG decoders need to know before they read its bytes as they are."""

from __future__ import annotations

from PIL import Image, ImageOps


def plain_jpeg_problem(img: Image.Image) -> str | None:
    """Why the JPEG decoders can't take `img`'s bytes as they are (not a JPEG, progressive, or to be
    turned by its EXIF orientation), or None: what packing keeps with reencode=False and a Loader
    reads in place."""
    if img.format != "JPEG":
        return f"a {img.format} image, not a JPEG"
    if img.info.get("progressive") or img.info.get("progression"):
        return "a progressive JPEG"
    if img.getexif().get(ImageOps.ExifTags.Base.Orientation, 1) != 1:
        return "an EXIF-rotated photo (packing turns it upright)"
    return None
