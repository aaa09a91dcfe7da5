"""The structures and constants of nvImageCodec 0.9's C API (`include/nvimgcodec.h` in its wheel), as
ctypes declares them: `nvimgcodec_api` calls the library with them. Each structure carries its own
type and size, which the library checks."""

from __future__ import annotations

import ctypes as C

MAX_PLANES, NAME_SIZE = 32, 256
DEVICE_CPU_ONLY = -99999

# nvimgcodecStructureType_t
T_PROPERTIES, T_INSTANCE_CREATE_INFO, T_DEVICE_ALLOCATOR, T_PINNED_ALLOCATOR, T_DECODE_PARAMS = 1, 2, 3, 4, 5
T_IMAGE_INFO, T_BACKEND, T_EXTENSION_DESC, T_BACKEND_PARAMS, T_EXECUTION_PARAMS = 11, 17, 27, 29, 30
BACKENDS = {"cpu": 1, "cuda": 3, "hw": 4}  # nvimgcodecBackendKind_t: CPU_ONLY, HYBRID_CPU_GPU, HW_GPU_ONLY
LOAD_HINT_FIXED = 2
COLORSPEC_SRGB, COLORSPEC_SYCC, SAMPLING_NONE, SAMPLING_420, SAMPLEFORMAT_I_RGB, UINT8 = 1, 3, 0, 3, 8, 0x0802
BUFFER_DEVICE, BUFFER_HOST = 1, 2
PROCESSING_SUCCESS = 1


class _Head(C.Structure):
    _fields_ = [("struct_type", C.c_int), ("struct_size", C.c_size_t), ("struct_next", C.c_void_p)]


def _struct(name: str, fields: list) -> type[C.Structure]:
    return type(name, (C.Structure,), {"_fields_": _Head._fields_ + fields})


Orientation = _struct("Orientation", [("rotated", C.c_int), ("flip_x", C.c_int), ("flip_y", C.c_int)])
PlaneInfo = _struct(
    "PlaneInfo",
    [
        ("width", C.c_uint32),
        ("height", C.c_uint32),
        ("row_stride", C.c_size_t),
        ("num_channels", C.c_uint32),
        ("sample_type", C.c_int),
        ("precision", C.c_uint8),
    ],
)
ImageInfo = _struct(
    "ImageInfo",
    [
        ("codec_name", C.c_char * NAME_SIZE),
        ("color_spec", C.c_int),
        ("chroma_subsampling", C.c_int),
        ("sample_format", C.c_int),
        ("orientation", Orientation),
        ("num_planes", C.c_uint32),
        ("plane_info", PlaneInfo * MAX_PLANES),
        ("buffer", C.c_void_p),
        ("buffer_kind", C.c_int),
        ("cuda_stream", C.c_void_p),
    ],
)
DeviceAllocator = _struct(
    "DeviceAllocator",
    [
        ("device_malloc", C.c_void_p),
        ("device_free", C.c_void_p),
        ("device_ctx", C.c_void_p),
        ("device_mem_padding", C.c_size_t),
    ],
)
PinnedAllocator = _struct(
    "PinnedAllocator",
    [
        ("pinned_malloc", C.c_void_p),
        ("pinned_free", C.c_void_p),
        ("pinned_ctx", C.c_void_p),
        ("pinned_mem_padding", C.c_size_t),
    ],
)
BackendParams = _struct("BackendParams", [("load_hint", C.c_float), ("load_hint_policy", C.c_int)])
Backend = _struct("Backend", [("kind", C.c_int), ("params", BackendParams)])
DecodeParams = _struct("DecodeParams", [("apply_exif_orientation", C.c_int)])
ExecutionParams = _struct(
    "ExecutionParams",
    [
        ("device_allocator", C.c_void_p),
        ("pinned_allocator", C.c_void_p),
        ("max_num_cpu_threads", C.c_int),
        ("executor", C.c_void_p),
        ("device_id", C.c_int),
        ("pre_init", C.c_int),
        ("skip_pre_sync", C.c_int),
        ("num_backends", C.c_int),
        ("backends", C.POINTER(Backend)),
    ],
)
Properties = _struct("Properties", [("version", C.c_uint32), ("cudart_version", C.c_uint32)])
ExtensionDesc = _struct(
    "ExtensionDesc",
    [
        ("instance", C.c_void_p),
        ("id", C.c_char_p),
        ("version", C.c_uint32),
        ("ext_api_version", C.c_uint32),
        ("create", C.c_void_p),
        ("destroy", C.c_void_p),
    ],
)
InstanceCreateInfo = _struct(
    "InstanceCreateInfo",
    [
        ("load_builtin_modules", C.c_int),
        ("load_extension_modules", C.c_int),
        ("extension_modules_path", C.c_char_p),
        ("create_debug_messenger", C.c_int),
        ("debug_messenger_desc", C.c_void_p),
        ("message_severity", C.c_uint32),
        ("message_category", C.c_uint32),
    ],
)


def filled(cls, struct_type: int, **values):
    """A `cls` with its type and size filled in, and `values`."""
    return cls(struct_type=struct_type, struct_size=C.sizeof(cls), **values)


def field_offset(cls, path: str) -> int:
    """Byte offset of a dotted field path in `cls` (plane_info's first plane for `plane_info.x`)."""
    offset, kind = 0, cls
    for name in path.split("."):
        f = getattr(kind, name)
        offset += f.offset
        kind = dict(kind._fields_)[name]
        if hasattr(kind, "_type_") and issubclass(kind, C.Array):
            kind = kind._type_
    return offset
