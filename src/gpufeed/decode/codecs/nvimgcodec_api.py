"""nvImageCodec's C API through ctypes: a batch decoded into one buffer with two GIL round trips.

nvImageCodec's Python binding lets go of the GIL and takes it back about three times per image (to
make each code stream, read its header and make its Image). In a training process, each time it
takes the GIL back it waits for the training thread to let go of it, so a batch's decode call
lasts many times its own work (docs/benchmarks.md, "nvImageCodec through its C API"). Here the
per-image calls are quick C calls made holding the GIL (`ctypes.PyDLL`), and only the batch's decode
and the wait for it let go of it (`ctypes.CDLL`).

The structures are those of nvImageCodec 0.9 (`nvimgcodec_header`); `open_library` refuses other
major.minor versions.
"""

from __future__ import annotations

import ctypes as C
import functools
import importlib.util
import threading
from pathlib import Path

import numpy as np

from gpufeed.decode.codecs.nvimgcodec_header import (
    BACKENDS,
    BUFFER_DEVICE,
    BUFFER_HOST,
    COLORSPEC_SRGB,
    COLORSPEC_SYCC,
    DEVICE_CPU_ONLY,
    LOAD_HINT_FIXED,
    PROCESSING_SUCCESS,
    SAMPLEFORMAT_I_RGB,
    SAMPLING_420,
    SAMPLING_NONE,
    T_BACKEND,
    T_BACKEND_PARAMS,
    T_DECODE_PARAMS,
    T_DEVICE_ALLOCATOR,
    T_EXECUTION_PARAMS,
    T_EXTENSION_DESC,
    T_IMAGE_INFO,
    T_INSTANCE_CREATE_INFO,
    T_PINNED_ALLOCATOR,
    T_PROPERTIES,
    UINT8,
    Backend,
    BackendParams,
    DecodeParams,
    DeviceAllocator,
    ExecutionParams,
    ExtensionDesc,
    ImageInfo,
    InstanceCreateInfo,
    PinnedAllocator,
    PlaneInfo,
    Properties,
    field_offset,
    filled,
)

SUPPORTED = ("0.9.",)  # nvImageCodec versions whose structures these are
# the extensions an instance loads: nvJPEG's (the `hw` and `cuda` backends) and libjpeg-turbo's (`cpu`)
EXTENSIONS = ("libnvjpeg_ext.so", "libjpeg_turbo_ext.so")

# nvJPEG (under the `hw` and `cuda` backends) rounds its device and page-locked allocations up to a
# multiple of these many bytes, so that buffers outgrown by larger batches grow in a few large steps:
# freeing device memory (cuMemFree) waits for the whole GPU, the model's kernels included. (Room for
# the usual batch from the start, `BatchDecoder`'s `room`, is what kept the engines' decode calls
# from freeing in the training loop measured:
# docs/benchmarks.md, "The engines' room and nvJPEG's padding")


class Library:
    """libnvimgcodec's functions: `fast` ones keep the GIL (quick C calls), `slow` ones let go of it."""

    def __init__(self, path: str):
        self.fast, self.slow = C.PyDLL(path), C.CDLL(path)
        vp, pp = C.c_void_p, C.POINTER(C.c_void_p)
        for lib in (self.fast, self.slow):
            lib.nvimgcodecGetProperties.argtypes = [C.POINTER(Properties)]
            lib.nvimgcodecInstanceCreate.argtypes = [pp, C.POINTER(InstanceCreateInfo)]
            lib.nvimgcodecExtensionCreate.argtypes = [vp, pp, C.POINTER(ExtensionDesc)]
            lib.nvimgcodecDecoderCreate.argtypes = [vp, pp, C.POINTER(ExecutionParams), C.c_char_p]
            lib.nvimgcodecDecoderDestroy.argtypes = [vp]
            # per-image calls take the handle's address as an int: no ctypes objects made per image
            lib.nvimgcodecCodeStreamCreateFromHostMem.argtypes = [vp, vp, vp, C.c_size_t, vp]
            lib.nvimgcodecCodeStreamDestroy.argtypes = [vp]
            lib.nvimgcodecCodeStreamGetImageInfo.argtypes = [vp, vp]
            lib.nvimgcodecImageCreate.argtypes = [vp, vp, vp]
            lib.nvimgcodecImageDestroy.argtypes = [vp]
            lib.nvimgcodecDecoderDecode.argtypes = [vp, vp, vp, C.c_int, C.POINTER(DecodeParams), pp]
            lib.nvimgcodecFutureWaitForAll.argtypes = [vp]
            lib.nvimgcodecFutureGetProcessingStatus.argtypes = [vp, vp, C.POINTER(C.c_size_t)]
            lib.nvimgcodecFutureDestroy.argtypes = [vp]


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"nvImageCodec: {what} failed (status {status})")


_EXTENSIONS: list = []
# the library opened once, whichever thread asks first (the decoders open on a thread of their own,
# `Tuning.open_ahead`, one per pipeline)
LIFECYCLE = threading.Lock()


def open_library() -> tuple[Library, int]:
    """`_open_library`, once for the process (whichever thread asks first)."""
    with LIFECYCLE:
        return _open_library()


def library_folder() -> Path:
    """The folder of the installed `nvidia.nvimgcodec` wheel, where its libnvimgcodec is (its Python
    module not imported); ImportError where it is not installed."""
    spec = importlib.util.find_spec("nvidia.nvimgcodec")  # (ModuleNotFoundError without any `nvidia`)
    if spec is None or spec.origin is None:
        raise ImportError("No module named 'nvidia.nvimgcodec'")
    return Path(spec.origin).parent


@functools.cache
def _instance() -> tuple[Library, int, list, str]:
    """The library of the installed `nvidia.nvimgcodec`, an instance of it, its JPEG extensions'
    modules (`EXTENSIONS`, loaded, not yet made) and its version, kept for the process. Its Python
    module is not imported: that makes an instance with every extension (JPEG 2000, TIFF, OpenCV,
    ...), which took about half of a GPU Loader's start (docs/benchmarks.md, "Start-up and GPU
    memory"). ImportError where it is not installed."""
    home = library_folder()
    lib = Library(str(home / "libnvimgcodec.so.0"))
    properties = filled(Properties, T_PROPERTIES)
    check(lib.fast.nvimgcodecGetProperties(C.byref(properties)), "reading its version")
    v = properties.version
    version = f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
    if not version.startswith(SUPPORTED):
        raise RuntimeError(f"nvImageCodec {version}: gpufeed's C calls are for {' or '.join(SUPPORTED)}x")
    info = filled(
        InstanceCreateInfo,
        T_INSTANCE_CREATE_INFO,
        load_builtin_modules=1,
        load_extension_modules=0,
        create_debug_messenger=0,
    )  # no log on stderr: a failure is said by gpufeed
    instance = C.c_void_p()
    # made once a process, on a thread while batches decode elsewhere (`Tuning.open_ahead`): the
    # calls that load and set up codecs (a second in all) let go of the GIL; no decoder exists yet.
    # (Making and destroying decoders keep it, as they always did: with it let go the CUDA tests
    # crashed in two runs of about ten, a lock around both did not stop that, and one around the
    # first decode as well hung them)
    check(lib.slow.nvimgcodecInstanceCreate(C.byref(instance), C.byref(info)), "creating an instance")
    modules = []
    for name in EXTENSIONS:
        found = sorted((home / "extensions").glob(name + "*"))
        if not found:
            raise RuntimeError(f"nvImageCodec {version} has no {name} in {home / 'extensions'}")
        modules.append((name, C.CDLL(str(found[0]))))
    return lib, instance.value, modules, version  # type: ignore[return-value]  # made: InstanceCreate succeeded


@functools.cache
def _open_library() -> tuple[Library, int]:
    """`_instance`'s library and instance with its JPEG extensions made, kept for the process."""
    from gpufeed.decode.codecs.pixels import quiet_codecs

    lib, instance, modules, _ = _instance()
    for name, module in modules:
        desc, extension = filled(ExtensionDesc, T_EXTENSION_DESC), C.c_void_p()
        _EXTENSIONS.append((module, desc, extension))  # kept for the process, as the instance is
        with quiet_codecs(f"loading {name}"):  # a missing library of its own (nvJPEG) is said at its decoder
            check(module.nvimgcodecExtensionModuleEntry(C.byref(desc)), f"describing {name}")
            check(lib.slow.nvimgcodecExtensionCreate(instance, C.byref(extension), C.byref(desc)), f"loading {name}")
    return lib, instance


class BatchDecoder:
    """One nvImageCodec decoder with one backend (`hw`, `cuda` or `cpu`), decoding batches of JPEGs
    into buffers the caller gives, RGB interleaved (HWC) or 4:2:0 YCbCr planes (`decode`), whole
    images, no EXIF rotation."""

    ALIGN = 256  # every image starts this many bytes apart at least, as an allocation of its own would

    def __init__(
        self,
        backend: str,
        device_id: int,
        cpu_threads: int,
        room: tuple[int, int, int] | None = None,
        padding: int = 32 << 20,
    ):
        """`padding`: nvJPEG's allocations, device and page-locked, are rounded up to this many bytes.
        `room`: (images, width, height) the engines' decoder (`hw`) makes its buffers for at once.
        nvImageCodec's default, one 1x1 image, left nvJPEG making decoder state and freeing device
        memory in the decode calls of batches that did not fit, which made the training loop beside
        it slower (docs/benchmarks.md, "The engines' room and nvJPEG's padding"); larger images or
        batches still decode."""
        self.lib, self.instance = open_library()
        self._backend = filled(
            Backend,
            T_BACKEND,
            kind=BACKENDS[backend],
            params=filled(BackendParams, T_BACKEND_PARAMS, load_hint=1.0, load_hint_policy=LOAD_HINT_FIXED),
        )
        # no allocator functions: nvJPEG's own, with the padding
        self._allocators = (
            filled(DeviceAllocator, T_DEVICE_ALLOCATOR, device_mem_padding=padding),
            filled(PinnedAllocator, T_PINNED_ALLOCATOR, pinned_mem_padding=padding),
        )
        params = filled(
            ExecutionParams,
            T_EXECUTION_PARAMS,
            max_num_cpu_threads=cpu_threads,
            device_id=DEVICE_CPU_ONLY if backend == "cpu" else device_id,
            num_backends=1,
            backends=C.pointer(self._backend),
            device_allocator=C.addressof(self._allocators[0]),
            pinned_allocator=C.addressof(self._allocators[1]),
        )
        handle = C.c_void_p()
        # no decoding options: the binding's default (fancy upsampling, as libjpeg and Pillow decode)
        options = ""
        if backend == "hw" and room:
            options = " ".join(
                f"nvjpeg_hw_decoder:preallocate_{key}={int(value)}"
                for key, value in zip(("batch_size", "width_hint", "height_hint"), room)
            )
        check(
            self.lib.fast.nvimgcodecDecoderCreate(self.instance, C.byref(handle), C.byref(params), options.encode()),
            f"creating the {backend} decoder",
        )
        self.handle = handle.value
        self.host = backend == "cpu"
        self._params = filled(DecodeParams, T_DECODE_PARAMS, apply_exif_orientation=0)
        self._streams = (C.c_void_p * 0)()  # code stream and image handles, made again into (reused)
        self._images = (C.c_void_p * 0)()
        self._infos = (ImageInfo * 0)()
        self._template = bytes(filled(ImageInfo, T_IMAGE_INFO))

    def _room(self, n: int) -> None:
        if len(self._streams) < n:
            grown = max(n, 2 * len(self._streams))
            streams, images = (C.c_void_p * grown)(), (C.c_void_p * grown)()
            # (typeshed reads a c_void_p array's slice as list[int | None], and writes one as a list of c_void_p too)
            streams[: len(self._streams)] = self._streams[:]  # type: ignore[assignment]
            images[: len(self._images)] = self._images[:]  # type: ignore[assignment]
            self._streams, self._images, self._infos = streams, images, (ImageInfo * grown)()

    def _column(self, path: str, dtype, n: int, plane: int = 0) -> np.ndarray:
        """Field `path` of the first `n` image infos (of plane `plane` for `plane_info.*`), as a numpy
        view (written in place)."""
        at = field_offset(ImageInfo, path) + plane * C.sizeof(PlaneInfo)
        infos = np.frombuffer(self._infos, np.uint8)  # type: ignore[call-overload, unused-ignore]  # (ctypes: a buffer)
        return np.ndarray((n,), dtype, infos, at, (C.sizeof(ImageInfo),))

    def read(self, data: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Parse the headers of images `data[begins[k]:ends[k]]`: (sizes (N, 2) height, width; ok (N,) bool).
        `data` must stay where it is until `decode` returns."""
        n, fast = len(begins), self.lib.fast
        self._room(n)
        infos = np.frombuffer(self._infos, np.uint8).reshape(-1, C.sizeof(ImageInfo))  # type: ignore[call-overload, unused-ignore]
        infos[:n] = np.frombuffer(self._template, np.uint8)
        base, size, slots = data.ctypes.data, C.sizeof(ImageInfo), C.addressof(self._streams)
        create, info, streams, instance = (
            fast.nvimgcodecCodeStreamCreateFromHostMem,
            fast.nvimgcodecCodeStreamGetImageInfo,
            self._streams,
            self.instance,
        )
        at = C.addressof(self._infos)
        ok = np.zeros(n, bool)
        for k, (b, e) in enumerate(zip(begins.tolist(), ends.tolist())):
            if create(instance, slots + 8 * k, base + b, e - b, None) == 0:
                ok[k] = info(streams[k], at + k * size) == 0
        sizes = np.stack(
            [self._column("plane_info.height", np.uint32, n), self._column("plane_info.width", np.uint32, n)], 1
        ).astype(np.int64)
        return sizes, ok & (sizes > 0).all(1)

    def ycc420(self, n: int) -> np.ndarray:
        """After `read`: per image, whether it is YCbCr with 4:2:0 chroma (most photos), which
        `decode(planar=...)` can give as its planes."""
        return (
            (self._column("color_spec", np.int32, n) == COLORSPEC_SYCC)
            & (self._column("chroma_subsampling", np.int32, n) == SAMPLING_420)
            & (self._column("num_planes", np.uint32, n) == 3)
        )

    @staticmethod
    def nbytes(sizes: np.ndarray, planar: np.ndarray) -> np.ndarray:
        """Bytes per image: RGB interleaved, or (`planar`) Y and two chroma planes of half the size."""
        h, w = sizes[:, 0], sizes[:, 1]
        return np.where(planar, h * w + 2 * ((h + 1) // 2) * ((w + 1) // 2), 3 * h * w)

    def layout(self, nbytes: np.ndarray) -> tuple[np.ndarray, int]:
        """Byte offsets of images of `nbytes` in one output buffer (aligned), and the buffer's size."""
        padded = -(-nbytes // self.ALIGN) * self.ALIGN
        offsets = np.cumsum(padded) - padded
        return offsets, int(padded.sum())

    def decode(
        self,
        sizes: np.ndarray,
        ok: np.ndarray,
        out: int,
        offsets: np.ndarray,
        stream: int,
        planar: np.ndarray | None = None,
    ) -> np.ndarray:
        """Decode the images `read` parsed (those `ok`) into the buffer at address `out`, image k at
        `offsets[k]`, in stream order on CUDA stream `stream`; returns per image whether it decoded.
        Images `planar` (YCbCr 4:2:0, `ycc420`) come as their Y plane and then their Cb and Cr planes at
        half the size (rounded up), each row after row: no colour conversion or upsampling on the GPU;
        the others as RGB, interleaved."""
        n, fast = len(sizes), self.lib.fast
        planar = np.zeros(n, bool) if planar is None else planar
        rgb = ~planar
        for name in ("orientation.rotated", "orientation.flip_x", "orientation.flip_y"):
            self._column(name, np.int32, n)[:] = 0
        half = (sizes + 1) // 2
        for p in (1, 2):
            self._column("plane_info.height", np.uint32, n, p)[planar] = half[planar, 0]
            self._column("plane_info.width", np.uint32, n, p)[planar] = half[planar, 1]
            self._column("plane_info.row_stride", np.uint64, n, p)[planar] = half[planar, 1]
        self._column("plane_info.row_stride", np.uint64, n)[:] = np.where(planar, 1, 3) * sizes[:, 1]
        for path, dtype, value in (
            ("color_spec", np.int32, COLORSPEC_SRGB),
            ("chroma_subsampling", np.int32, SAMPLING_NONE),
            ("sample_format", np.int32, SAMPLEFORMAT_I_RGB),
            ("num_planes", np.uint32, 1),
            ("plane_info.num_channels", np.uint32, 3),
            ("plane_info.sample_type", np.int32, UINT8),
            ("plane_info.precision", np.uint8, 0),
        ):
            self._column(path, dtype, n)[rgb] = value
        self._column("buffer", np.uint64, n)[:] = out + offsets
        self._column("buffer_kind", np.int32, n)[:] = BUFFER_HOST if self.host else BUFFER_DEVICE
        self._column("cuda_stream", np.uint64, n)[:] = stream
        at, size, slots = C.addressof(self._infos), C.sizeof(ImageInfo), C.addressof(self._images)
        create, instance = fast.nvimgcodecImageCreate, self.instance
        for k in np.flatnonzero(ok).tolist():
            ok[k] = create(instance, slots + 8 * k, at + k * size) == 0
        keep = np.flatnonzero(ok)
        decoded = np.zeros(n, bool)
        if not len(keep):
            return decoded
        streams = (C.c_void_p * len(keep))(*[self._streams[k] for k in keep.tolist()])
        images = (C.c_void_p * len(keep))(*[self._images[k] for k in keep.tolist()])
        future = C.c_void_p()
        check(
            self.lib.slow.nvimgcodecDecoderDecode(
                self.handle, streams, images, len(keep), C.byref(self._params), C.byref(future)
            ),
            "decoding",
        )
        try:
            self.lib.slow.nvimgcodecFutureWaitForAll(future)
            status, count = (C.c_uint32 * len(keep))(), C.c_size_t(len(keep))
            check(fast.nvimgcodecFutureGetProcessingStatus(future, status, C.byref(count)), "reading the statuses")
        finally:
            fast.nvimgcodecFutureDestroy(future)
        # (a ctypes array has the buffer protocol; numpy's stubs take one from Python 3.12 on)
        decoded[keep] = np.frombuffer(status, np.uint32) == PROCESSING_SUCCESS  # type: ignore[call-overload, unused-ignore]
        return decoded

    kept = False  # kept for the process (`NvImgCodecDecoder.keep_for_process`): never destroyed

    def __del__(self):
        fast = getattr(getattr(self, "lib", None), "fast", None)
        if fast is None or self.kept:
            return
        for handles, destroy in (
            (self._streams, fast.nvimgcodecCodeStreamDestroy),
            (self._images, fast.nvimgcodecImageDestroy),
        ):
            for h in handles:
                if h:
                    destroy(h)
        fast.nvimgcodecDecoderDestroy(self.handle)
