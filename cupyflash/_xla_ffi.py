"""XLA's typed FFI (custom call API version 1) from Python, through ctypes: no C compiler.

A handler is a C function `XLA_FFI_Error* handler(XLA_FFI_CallFrame*)`. Here it is a ctypes
callback wrapped in a PyCapsule, which `jax.ffi.register_ffi_target` accepts like a compiled one.
The structures below mirror xla/ffi/api/c_api.h as jaxlib ships it (`jax.ffi.include_dir()`).
Only fields whose offsets are the same in API versions 0.3 (jaxlib 0.10), 0.4 (0.11) and 0.5
(0.12) are read or written: versions since then renamed the extension type, some API functions
and added fields at struct ends and API functions at the API struct's end, which moves nothing
used here. tests/test_jax_integration.py checks these layouts against the installed header.

A handler is called in two ways:
  * at registration, with a metadata extension in `extension_start`: it must answer the API
    version it was written for (XLA refuses versions outside its supported range) and its
    traits (none: not safe to capture into a CUDA graph, since it allocates through CuPy);
  * at execution (stage EXECUTE), with its buffers, attributes and a context from which the
    CUDA stream and device ordinal are read.
A Python exception becomes an XLA_FFI_Error carrying its message, which JAX raises.
"""

import ctypes
import functools
import traceback

import numpy

# The API version whose header these structures follow. XLA accepts any version from 0.1 up to
# its own; older XLA (before the range check) wanted exactly its own, so we answer the smaller.
API_VERSION = (0, 3)

_EXTENSION_METADATA = 1
_STAGE_EXECUTE = 3
_ARG_BUFFER = _RET_BUFFER = 1
_ATTR_SCALAR = 3
_ERROR_INTERNAL = 13
_MEMCPY_DEVICE_TO_DEVICE = 3

c_size_t, c_int64, c_int32, c_void_p = ctypes.c_size_t, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
c_enum = ctypes.c_int  # C enums are int-sized on the platforms JAX supports


def _struct(name, fields):
    return type(name, (ctypes.Structure,), {"_fields_": fields})


ApiVersion = _struct("XLA_FFI_Api_Version", [
    ("struct_size", c_size_t), ("extension_start", c_void_p),
    ("major_version", ctypes.c_int), ("minor_version", ctypes.c_int)])
ExtensionBase = _struct("XLA_FFI_Extension_Base", [  # XLA_FFI_InternalExtension since 0.4
    ("struct_size", c_size_t), ("type", c_enum), ("next", c_void_p)])
Metadata = _struct("XLA_FFI_Metadata", [
    ("struct_size", c_size_t), ("api_version", ApiVersion), ("traits", ctypes.c_uint32),
    ("state_type_id", c_int64)])
MetadataExtension = _struct("XLA_FFI_Metadata_Extension", [
    ("extension_base", ExtensionBase), ("metadata", ctypes.POINTER(Metadata))])
ByteSpan = _struct("XLA_FFI_ByteSpan", [("ptr", c_void_p), ("len", c_size_t)])
Scalar = _struct("XLA_FFI_Scalar", [("dtype", c_enum), ("value", c_void_p)])
Buffer = _struct("XLA_FFI_Buffer", [
    ("struct_size", c_size_t), ("extension_start", c_void_p),
    ("dtype", c_enum), ("data", c_void_p), ("rank", c_int64), ("dims", ctypes.POINTER(c_int64))])
Args = _struct("XLA_FFI_Args", [
    ("struct_size", c_size_t), ("extension_start", c_void_p),
    ("size", c_int64), ("types", ctypes.POINTER(c_enum)), ("args", ctypes.POINTER(c_void_p))])
Rets = _struct("XLA_FFI_Rets", [
    ("struct_size", c_size_t), ("extension_start", c_void_p),
    ("size", c_int64), ("types", ctypes.POINTER(c_enum)), ("rets", ctypes.POINTER(c_void_p))])
Attrs = _struct("XLA_FFI_Attrs", [
    ("struct_size", c_size_t), ("extension_start", c_void_p),
    ("size", c_int64), ("types", ctypes.POINTER(c_enum)),
    ("names", ctypes.POINTER(ctypes.POINTER(ByteSpan))), ("attrs", ctypes.POINTER(c_void_p))])
ErrorCreateArgs = _struct("XLA_FFI_Error_Create_Args", [
    ("struct_size", c_size_t), ("extension_start", c_void_p),
    ("message", ctypes.c_char_p), ("errc", c_enum)])
StreamGetArgs = _struct("XLA_FFI_Stream_Get_Args", [
    ("struct_size", c_size_t), ("extension_start", c_void_p), ("ctx", c_void_p), ("stream", c_void_p)])
DeviceOrdinalGetArgs = _struct("XLA_FFI_DeviceOrdinal_Get_Args", [
    ("struct_size", c_size_t), ("extension_start", c_void_p), ("ctx", c_void_p),
    ("device_ordinal", c_int32)])

_ErrorCreate = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(ErrorCreateArgs))
_StreamGet = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(StreamGetArgs))
_DeviceOrdinalGet = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(DeviceOrdinalGetArgs))

# The API's function table, in header order; only three are called, the rest hold their places.
API_FUNCTIONS = ("Error_Create", "Error_GetMessage", "Error_Destroy", "Handler_Register", "Stream_Get",
                 "Type_Register", "ExecutionContext_Get", "State_Set", "State_Get",
                 "DeviceMemory_Allocate", "DeviceMemory_Free", "ThreadPool_Schedule",
                 "ThreadPool_NumThreads", "Future_Create", "Future_SetAvailable", "Future_SetError",
                 "RunId_Get", "DeviceOrdinal_Get")
_CALLED = {"Error_Create": _ErrorCreate, "Stream_Get": _StreamGet, "DeviceOrdinal_Get": _DeviceOrdinalGet}
Api = _struct("XLA_FFI_Api", [
    ("struct_size", c_size_t), ("extension_start", c_void_p),
    ("api_version", ApiVersion), ("internal_api", c_void_p),
    *((name, _CALLED.get(name, c_void_p)) for name in API_FUNCTIONS)])

CallFrame = _struct("XLA_FFI_CallFrame", [
    ("struct_size", c_size_t), ("extension_start", ctypes.POINTER(ExtensionBase)),
    ("api", ctypes.POINTER(Api)), ("ctx", c_void_p), ("stage", c_enum),
    ("args", Args), ("rets", Rets), ("attrs", Attrs), ("future", c_void_p)])

# XLA_FFI_STRUCT_SIZE(...) of the header: the offset past a struct's last field the header names.
CALL_FRAME_SIZE = CallFrame.attrs.offset + ctypes.sizeof(Attrs)
_BUFFER_SIZE = Buffer.dims.offset + ctypes.sizeof(ctypes.c_void_p)

_Handler = ctypes.CFUNCTYPE(c_void_p, ctypes.POINTER(CallFrame))


@functools.cache
def _dtypes():
    import ml_dtypes
    return {4: numpy.dtype(numpy.int32), 8: numpy.dtype(numpy.uint32),  # cu_seqlens, dropout seeds
            10: numpy.dtype(numpy.float16), 11: numpy.dtype(numpy.float32),
            12: numpy.dtype(numpy.float64), 16: numpy.dtype(ml_dtypes.bfloat16)}


_SCALAR_TYPES = {1: ctypes.c_bool, 2: ctypes.c_int8, 3: ctypes.c_int16, 4: ctypes.c_int32, 5: ctypes.c_int64,
                 6: ctypes.c_uint8, 7: ctypes.c_uint16, 8: ctypes.c_uint32, 9: ctypes.c_uint64,
                 11: ctypes.c_float, 12: ctypes.c_double}


class FfiError(Exception):
    """An error an XLA API function returned: handed back to XLA as it is (XLA owns and frees it)."""
    def __init__(self, what, pointer):
        super().__init__(what)
        self.pointer = pointer


class Array:
    """One XLA buffer: dtype, shape and address (host or device, by platform)."""

    def __init__(self, pointer, what):
        buffer = ctypes.cast(pointer, ctypes.POINTER(Buffer)).contents
        if buffer.struct_size < _BUFFER_SIZE:
            raise RuntimeError(f"{what}: XLA_FFI_Buffer of {buffer.struct_size} bytes, expected {_BUFFER_SIZE}")
        dtypes = _dtypes()
        if buffer.dtype not in dtypes:
            raise TypeError(f"{what}: unsupported XLA data type {buffer.dtype}")
        self.dtype = dtypes[buffer.dtype]
        self.shape = tuple(buffer.dims[i] for i in range(buffer.rank))
        self.pointer = buffer.data or 0
        self.nbytes = int(numpy.prod(self.shape, dtype=numpy.int64)) * self.dtype.itemsize

    def numpy(self):
        """A NumPy view of a host buffer (writable: XLA's result buffers are written through it)."""
        raw = (ctypes.c_char * self.nbytes).from_address(self.pointer) if self.nbytes else b""
        return numpy.frombuffer(raw, dtype=self.dtype).reshape(self.shape)

    def cupy(self, device_id):
        """A CuPy view of a device buffer; XLA keeps the memory alive for the call."""
        import cupy
        memory = cupy.cuda.UnownedMemory(self.pointer, self.nbytes, None, device_id)
        return cupy.ndarray(self.shape, self.dtype, cupy.cuda.MemoryPointer(memory, 0))

    def copy_from_cupy(self, source, stream):
        """Device-to-device copy of a C-contiguous CuPy array of our shape and dtype, on `stream`."""
        import cupy
        assert source.shape == self.shape and source.dtype == self.dtype and source.flags.c_contiguous
        cupy.cuda.runtime.memcpyAsync(self.pointer, source.data.ptr, self.nbytes, _MEMCPY_DEVICE_TO_DEVICE, stream)


class Call:
    """What a handler gets at execution: args and rets (Arrays), attrs (name -> Python scalar)."""

    def __init__(self, frame):
        self._frame = frame
        self.args = [self._buffer(frame.args.types[i], _ARG_BUFFER, frame.args.args[i], f"argument {i}")
                     for i in range(frame.args.size)]
        self.rets = [self._buffer(frame.rets.types[i], _RET_BUFFER, frame.rets.rets[i], f"result {i}")
                     for i in range(frame.rets.size)]
        self.attrs = {}
        for i in range(frame.attrs.size):
            span = frame.attrs.names[i].contents
            name = ctypes.string_at(span.ptr, span.len).decode()
            if frame.attrs.types[i] != _ATTR_SCALAR:
                raise TypeError(f"attribute {name}: only scalar attributes are supported")
            scalar = ctypes.cast(frame.attrs.attrs[i], ctypes.POINTER(Scalar)).contents
            if scalar.dtype not in _SCALAR_TYPES:
                raise TypeError(f"attribute {name}: unsupported scalar type {scalar.dtype}")
            self.attrs[name] = ctypes.cast(scalar.value, ctypes.POINTER(_SCALAR_TYPES[scalar.dtype])).contents.value

    @staticmethod
    def _buffer(kind, expected, pointer, what):
        if kind != expected:
            raise TypeError(f"{what}: expected a buffer, got XLA FFI type {kind}")
        return Array(pointer, what)

    def _api_call(self, name, args_type, **fields):
        api = self._frame.api.contents
        if api.struct_size < getattr(Api, name).offset + ctypes.sizeof(c_void_p):
            raise RuntimeError(f"this XLA's FFI API has no {name}")
        args = args_type(struct_size=ctypes.sizeof(args_type), ctx=self._frame.ctx, **fields)
        error = getattr(api, name)(ctypes.byref(args))
        if error:
            raise FfiError(f"XLA_FFI_{name} failed", error)
        return args

    def cuda_stream(self):
        """The CUstream XLA runs this call on."""
        return self._api_call("Stream_Get", StreamGetArgs).stream or 0

    def device_ordinal(self):
        return self._api_call("DeviceOrdinal_Get", DeviceOrdinalGetArgs).device_ordinal


def _answer_metadata(frame):
    extension = ctypes.cast(frame.extension_start, ctypes.POINTER(MetadataExtension)).contents
    metadata = extension.metadata.contents
    framework = frame.api.contents.api_version
    version = min(API_VERSION, (framework.major_version, framework.minor_version))
    metadata.api_version = ApiVersion(ctypes.sizeof(ApiVersion), None, *version)
    metadata.traits = 0


def _error(frame, message):
    args = ErrorCreateArgs(struct_size=ctypes.sizeof(ErrorCreateArgs), message=message.encode(errors="replace"),
                           errc=_ERROR_INTERNAL)
    return frame.api.contents.Error_Create(ctypes.byref(args))


def _run(function, frame_pointer):
    frame = frame_pointer.contents
    try:
        if frame.struct_size < CALL_FRAME_SIZE:
            return _error(frame, f"XLA_FFI_CallFrame of {frame.struct_size} bytes, expected {CALL_FRAME_SIZE}")
        if frame.extension_start and frame.extension_start.contents.type == _EXTENSION_METADATA:
            _answer_metadata(frame)
            return None
        if frame.stage != _STAGE_EXECUTE:
            return None  # only an execute handler is registered; nothing to do at other stages
        function(Call(frame))
        return None
    except FfiError as error:
        return error.pointer
    except BaseException as error:  # noqa: BLE001 -- nothing may unwind through XLA's C frames
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        return _error(frame, f"cupyflash: {detail}")


_keep_alive = []  # the callbacks must outlive every XLA executable that may call them


def handler_capsule(function):
    """A PyCapsule holding a C function pointer that runs `function(Call)` at execution."""
    callback = _Handler(lambda frame_pointer: _run(function, frame_pointer))
    _keep_alive.append(callback)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = (c_void_p, ctypes.c_char_p, c_void_p)
    return new_capsule(ctypes.cast(callback, c_void_p), None, None)
