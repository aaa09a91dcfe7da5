"""The loader's settings that measurements chose (mostly the JPEG path's), in one value passed down
from the Loader.

Each default is the one a training-loop benchmark picked
(docs/benchmarks.md, "Design measurements"); the benchmarks build other values from a row's
settings (`benchmarks/feeds.py`: `jpeg:pipelines=2` is `Tuning(pipelines=2)`) and pass them to
`gpufeed.Loader(tuning=...)` to compare, so no module global exists for a benchmark to patch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Tuning:
    """The loader's measured settings: the JPEG path's, which raw tiers gather in the augment kernel, and
    where a bucket's downloads run."""

    # pipelines on a GPU, each a producer thread with its own GPU decoder and stream, sharing the CPU
    # workers: two were faster alone but slowed the training loop they fed (a second producer thread
    # takes CPU and GIL from the training thread)
    pipelines: int = 1
    # with several pipelines, their GPU decodes take turns (a shared lock) rather than run at once
    turns: bool = True
    # CUDA priority of the JPEG path's streams: 0 is the default streams' (a training loop's), the
    # lowest; negative numbers go ahead of it
    priority: int = 0
    # a batch's GPU share is decoded from `Scheduler.start` on, on a thread of its own (False: in
    # `finish`, on the producer thread)
    gpu_early: bool = True
    # the next epoch's first batches are made as an epoch ends (`loader.producer.Carried`)
    carry: bool = True
    # a video store's decode processes run this much nicer than the training loop's process (0: as
    # nice): r2plus1d_18 fed by 16 processes on an H100 host of 16 cores, 234 and 247 clips/s against
    # 209 and 235 at 0 (two rounds; docs/benchmarks.md, "Video clips")
    decode_nice: int = 10
    # a video clip's decode skips the frames outside the clip that no frame refers to (FFmpeg's
    # skip_frame NONREF, H.264 only): 20 % more clips/s decoding alone on a 16-core H100 host, the same
    # training rate there (docs/benchmarks.md, "Video clips", D). None: for the videos whose marks pack
    # checked (it decoded them again so and got every other frame the same: `VideoIndex.nonref_exact`),
    # so a stream whose marks are wrong decodes whole; True: every H.264 video, trusting its marks;
    # False: none
    skip_nonref: bool | None = None
    # a video store's batches of clips decoded at once, a producer thread each: with a clip a decode
    # process, a process that ends its clip early takes the next batches' (2 before it was a setting; 3
    # on the development box, 2 processes and 2 clips a batch, gave 153-165 clips/s against 133-144
    # where a batch's copy took 10 ms, the same where it took 3; not measured on a GPU host)
    clip_batches: int = 2
    # threads decoding a video store's clips on the GPU's engines (`decoders=("nvdec", ...)`): TorchCodec's
    # beta backend in one process gave 305-313 clips/s on 8 threads, 305-372 on 16 (decode.codecs.nvdec)
    nvdec_threads: int = 8
    # a store in a bucket downloads its shards in a process of its own (`store.fetch_process`), out of
    # reach of the training process's GIL: the fetch ahead carried a fifth of a 1 Gbit/s link beside a
    # thread that kept the GIL, all of it alone (the development box). Off: in ResNet-18 training on an
    # H100 host a cold epoch ran at 95.8 / 83.8 % of a 1 / 10 Gbit/s link with it, 97.8 / 95.8 % without
    # (docs/benchmarks.md, "Training from a bucket")
    fetch_process: bool = False
    # a store in a bucket: the shard a rank reads first (a cold pass's first batch waits for it) downloads
    # alone until it is in the cache, where off it does until its files are asked for (the next shards
    # then share the link with it: a cold epoch's first batch after 2.9-3.1 shard-times at 1 Gbit/s,
    # issue 66's goal 2). Off: on an H100 host its first batch came 0.05-0.11 s sooner at 1 Gbit/s and
    # 0.04-0.07 s later at 10, its cold epochs no faster (docs/benchmarks.md, "Training from a bucket")
    lead_lands_first: bool = False
    # the batch kernels run once on a stand-in while the first batch decodes (Triton compiles a
    # kernel the first time a machine runs it)
    compile_ahead: bool = True
    # the engines decode YCbCr 4:2:0 images to their planes and the resize kernel converts them,
    # instead of a colour conversion kernel per image beside the model's
    planar: bool = True
    # steering (`decode.scheduling.steering`): the GPU decoders' part of a batch moves by `gpu_step` per batch,
    # up while the loop waited more than `starved` of the time between batches and the producer waited
    # on the CPU more than on the GPU decoders; a GPU share under `gpu_min` of the batch goes to the
    # CPU too; the CPU's rate is reckoned at `cpu_load` of what was measured; the loop's time per
    # batch is the median of its last `steer_steps`
    gpu_step: float = 0.05
    starved: float = 0.1
    gpu_min: float = 0.25
    cpu_load: float = 1.0
    steer_steps: int = 8
    # the GPU decoders decode only while a loop fed with them runs faster, by `cost_margin`, than one fed
    # by the CPU alone (`steering.CostCheck`); the two are compared over a window of `steer_steps` batches
    # every `cost_probe` batches at first, less often while the answer stays
    cost_check: bool = True
    cost_probe: int = 32
    cost_margin: float = 0.02
    # tickets per living worker (ready or starting) in each CPU share: the workers take them as they come free
    tickets: int = 2
    # nvImageCodec's allocations rounded up to this many MiB, on the device and page-locked
    nv_padding_mb: int = 32
    # the engines' decoder makes its buffers for a whole batch of the store's images at once
    prealloc: bool = True
    # the GPU decoders are made, and decode once, on a thread of their own while the CPU decodes the
    # first batches (False: in the constructor, and the first GPU share waits for their first decode).
    # A fresh process's first batch comes in 0.6 s instead of 1.0 (H100; docs/benchmarks.md,
    # "Start-up and GPU memory")
    open_ahead: bool = True
    # a folder read in place reads each batch's files ahead (two batches ahead, on its reader threads) for
    # the decoders of the loader's process only; the decode workers read their share themselves. Without
    # GPU decoders that is none. With them, `read_gpu_share` reads ahead only their likely share and
    # `read_spare` of the batch more (`Scheduler.read_first`), the rest as they ask (False: every file of
    # a batch). H100, 16 cores, 20,000 photos, four rounds: ResNet-18 training fed in place 96.1 % of the
    # ceiling (88.7-97.9) against 87.3 % (82.2-91.7), eval passes 17.8k img/s against 16.7k
    # (docs/benchmarks.md, "Reading a folder in place")
    read_gpu_share: bool = True
    read_spare: float = 0.125
    # raw stores: the tiers whose augment kernel reads store rows itself (on the host tier it reads
    # only the crop regions over PCIe, fewer bytes than gathering whole rows first); the others gather
    # rows, then augment
    fused_gather: tuple[str, ...] = ("gpu", "host")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
