"""What `video_bench.py`'s rows of other decoders run in their pool's processes (a module of its own:
the processes, spawned without the script's `__main__`, import it by name)."""

from __future__ import annotations


def decode_share(args) -> str | None:
    """In a pool process: decode `clips` of `files` with `library` to RGB on the CPU; an error's text."""
    library, files, clips = args
    try:
        if library == "torchcodec":
            from torchcodec.decoders import VideoDecoder

            for i, wanted in clips:
                VideoDecoder(files[i], num_ffmpeg_threads=1).get_frames_at(indices=wanted)
        elif library == "decord":
            import decord

            for i, wanted in clips:
                decord.VideoReader(files[i], num_threads=1).get_batch(wanted).asnumpy()
        else:
            raise ValueError(library)
    except Exception as e:  # noqa: BLE001  (the row says why it has no figure)
        return f"{type(e).__name__}: {e}"
    return None
