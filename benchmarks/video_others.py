"""What `video_bench.py`'s rows of other decoders and loaders run (a module of its own: the pool's
processes and the DataLoader's workers, spawned without the script's `__main__`, import it by name).
Benchmark-only imports: none of these libraries is a gpufeed dependency.

- `decode_share`: one process's share of clips decoded by a library (TorchCodec on the CPU or on
  the GPU through NVDEC, decord, PyNvVideoCodec), to RGB, no augmentation;
- `dali_video`: DALI's GPU video reader (NVDEC) with its random resized crop, flip and normalize;
- `PyAVClips`: what a torch DataLoader worker does in the usual recipe: PyAV decodes a random clip to
  RGB, torchvision crops, flips and resizes it on the CPU.
"""

from __future__ import annotations

import numpy as np

# the libraries `decode_share` knows; those with cuda or nv in their names decode on the GPU (NVDEC)
DECODERS = (
    "torchcodec", "torchcodec-cuda", "torchcodec-cuda-beta", "decord", "pynvvideocodec", "pynvvideocodec-bytes"
)

_nvdec = {}  # this process's PyNvVideoCodec decoder, reused from clip to clip


def decode_share(args) -> str | None:
    """In a pool process: decode `clips` ((video, frame indices)) of `files` with `library`; an error's text."""
    library, files, clips = args
    try:
        if library.startswith("torchcodec"):
            import contextlib

            import torch
            from torchcodec.decoders import VideoDecoder, set_cuda_backend

            cuda = library != "torchcodec"
            torch.set_num_threads(1)  # as in a DataLoader worker: torch's threads on every core, in every process
            backend = set_cuda_backend("beta") if library.endswith("beta") else contextlib.nullcontext()
            with backend:
                for i, wanted in clips:
                    if cuda:
                        VideoDecoder(files[i], device="cuda").get_frames_at(indices=wanted)
                    else:
                        VideoDecoder(files[i], num_ffmpeg_threads=1).get_frames_at(indices=wanted)
            if cuda:
                torch.cuda.synchronize()
        elif library == "decord":
            import decord

            for i, wanted in clips:
                decord.VideoReader(files[i], num_threads=1).get_batch(wanted).asnumpy()
        elif library == "pynvvideocodec-bytes":  # a decoder a clip, from the video's bytes (as a store holds them)
            import PyNvVideoCodec as nvc
            import torch

            for i, wanted in clips:
                with open(files[i], "rb") as f:
                    data = f.read()
                decoder = nvc.SimpleDecoder(data, gpu_id=0, use_device_memory=True,
                                            output_color_type=nvc.OutputColorType.RGBP)
                [torch.from_dlpack(f) for f in decoder.get_batch_frames_by_index(list(wanted))]
            torch.cuda.synchronize()
        elif library == "pynvvideocodec":  # one decoder a process, given each clip's file
            import PyNvVideoCodec as nvc
            import torch

            for i, wanted in clips:
                decoder = _nvdec.get("decoder")
                if decoder is None:
                    decoder = _nvdec["decoder"] = nvc.SimpleDecoder(
                        files[i], gpu_id=0, use_device_memory=True, output_color_type=nvc.OutputColorType.RGBP
                    )
                else:
                    decoder.reconfigure_decoder(files[i])
                frames = decoder.get_batch_frames_by_index(list(wanted))
                [torch.from_dlpack(f) for f in frames]
            torch.cuda.synchronize()
        else:
            raise ValueError(f"unknown decoder {library!r}: choose from {', '.join(DECODERS)}")
    except Exception as e:  # noqa: BLE001  (the row says why it has no figure)
        return f"{type(e).__name__}: {e}"
    return None


def dali_video(files: list[str], labels: list[int], frames: int, stride: int, batch: int, size: int, threads: int,
               layout: str = "FCHW"):
    """DALI's video reader on the GPU (NVDEC) over `files`, clips of `frames` frames `stride` apart at
    random places, shuffled; a random resized crop to `size`², flip, normalize to fp16, `layout`
    (FCHW: N, T, C, H, W; CFHW: N, C, T, H, W). Yields (clips, labels) on the device, batch after batch."""
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    mean, std = [0.485 * 255, 0.456 * 255, 0.406 * 255], [0.229 * 255, 0.224 * 255, 0.225 * 255]

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=torch.cuda.current_device(), seed=0)
    def pipe():
        video, label = fn.readers.video(device="gpu", filenames=files, labels=labels, sequence_length=frames,
                                        stride=stride, random_shuffle=True, initial_fill=64, name="reader")
        video = fn.random_resized_crop(video, size=[size, size])
        video = fn.crop_mirror_normalize(video, dtype=types.FLOAT16, output_layout=layout, mean=mean, std=std,
                                         mirror=fn.random.coin_flip())
        return video, label

    it = DALIGenericIterator([pipe()], ["clips", "labels"], reader_name="reader", auto_reset=True,
                             last_batch_policy=LastBatchPolicy.DROP)
    while True:
        for out in it:
            yield out[0]["clips"], out[0]["labels"].view(-1).long()


class PyAVClips:
    """A torch Dataset of random clips, as the usual recipe decodes them in DataLoader workers: PyAV
    opens the file, seeks to the keyframe before the clip and decodes to RGB (gpufeed's decode_clip
    on the file's bytes: the same seek), then torchvision's RandomResizedCrop to `size`² and a flip,
    the same for every frame of the clip; uint8 (C, T, H, W)."""

    def __init__(self, store_path: str, frames: int, stride: int, size: int):
        self.store_path, self.frames, self.stride, self.size = store_path, frames, stride, size
        self._store = None
        self._rng = np.random.default_rng()

    def __len__(self) -> int:
        return len(self.store)

    @property
    def store(self):
        if self._store is None:
            from gpufeed import Store

            self._store = Store(self.store_path)
        return self._store

    def __getitem__(self, i: int):
        import torch
        from torchvision.transforms import v2

        from gpufeed.decode.codecs.video import ClipRequest, decode_clip

        store = self.store
        index = store.video(i)
        span = (self.frames - 1) * self.stride + 1
        start = int(self._rng.integers(0, max(1, len(index) - span)))
        wanted = np.minimum(start + np.arange(self.frames) * self.stride, len(index) - 1)
        with open(store.source(i), "rb") as f:
            data = f.read()
        rgb = decode_clip(ClipRequest(data, index.pts, index.keyframe, index.stream, wanted))
        clip = torch.from_numpy(rgb).permute(0, 3, 1, 2)  # (T, C, H, W): one crop and flip for every frame
        clip = v2.RandomHorizontalFlip()(v2.RandomResizedCrop(self.size, antialias=True)(clip))
        return clip.permute(1, 0, 2, 3).contiguous(), int(store.labels[i])
