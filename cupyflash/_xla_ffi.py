"""XLA's typed FFI (custom call API version 1) from Python, through ctypes: no C compiler.

A handler is a C function `XLA_FFI_Error* handler(XLA_FFI_CallFrame*)`. Here it is a ctypes
callback wrapped in a PyCapsule, which `jax.ffi.register_ffi_target` accepts like a compiled one.
The structures below mirror xla/ffi/api/c_api.h as jaxlib ships it (`jax.ffi.include_dir()`).
Only fields whose offsets are the same in API versions 0.3 (jaxlib 0.10), 0.4 (0.11) and 0.5
(0.12) are read or written: versions since then renamed the extension type, some API functions
and added fields at struct ends and API functions at the API struct's end, which moves nothing
used here. tests/test_jax_ffi.py checks these layouts against the installed header.

A handler is called in two ways:
  * at registration, with a metadata extension in `extension_start`: it must answer the API
    version it was written for (XLA refuses versions outside its supported range) and its
    traits, which XLA reads only there (JAX's CUDA plugin takes none at registration):
    COMMAND_BUFFER_COMPATIBLE lets XLA trace the handler into a command buffer (a CUDA graph),
    for the targets whose calls launch the same kernels every time and allocate nothing;
  * at execution (stage EXECUTE), with its buffers, attributes and a context from which the
    CUDA stream and device ordinal are read.
A Python exception becomes an XLA_FFI_Error carrying its message, which JAX raises.

XLA runs a GPU handler on the host for every call, so `Call` reads the frame only where asked:
the buffers' addresses and one scalar attribute cost a few raw loads each (`arg_pointers`,
`ret_pointers`, `first_scalar`); `args`, `rets` and `attrs` decode everything.
"""

import ctypes
import functools
import traceback

import numpy

# The API version whose header these structures follow. XLA accepts any version from 0.1 up to
# its own; older XLA (before the range check) wanted exactly its own, so we answer the smaller.
API_VERSION = (0, 3)

_EXTENSION_METADATA = 1
COMMAND_BUFFER_COMPATIBLE = 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
_STAGE_EXECUTE = 3
_ARG_BUFFER = _RET_BUFFER = 1
_ATTR_SCALAR = 3
_S64 = 5  # XLA_FFI_DataType_S64
_ERROR_INTERNAL = 13

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

_Handler = ctypes.CFUNCTYPE(c_void_p, c_void_p)  # the frame as an address: no ctypes object per call


@functools.cache
def _dtypes():
    import ml_dtypes
    return {4: numpy.dtype(numpy.int32), 8: numpy.dtype(numpy.uint32),  # cu_seqlens, dropout seeds
            6: numpy.dtype(numpy.uint8),  # scratch
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


_load = ctypes.c_uint64.from_address  # one 64-bit word of XLA's memory
_int32 = ctypes.c_int32.from_address
_pair = (ctypes.c_uint64 * 2).from_address
_frame_words = (ctypes.c_uint64 * (CALL_FRAME_SIZE // 8)).from_address  # the whole frame in one read
# Word indexes of the frame's fields the fast readers use (module constants: a dictionary lookup costs as much).
_EXT, _API, _CTX, _STAGE = (getattr(CallFrame, f).offset // 8 for f in ("extension_start", "api", "ctx", "stage"))
assert CallFrame.stage.offset % 8 == 0  # the stage (an enum) is the low half of its word on little-endian hosts
_ARGS_SIZE, _ARGS = ((CallFrame.args.offset + getattr(Args, f).offset) // 8 for f in ("size", "args"))
_RETS_SIZE, _RETS = ((CallFrame.rets.offset + getattr(Rets, f).offset) // 8 for f in ("size", "rets"))
_ATTRS_SIZE, _ATTR_TYPES, _ATTR_NAMES, _ATTRS = ((CallFrame.attrs.offset + getattr(Attrs, f).offset) // 8
                                                  for f in ("size", "types", "names", "attrs"))
_DATA = Buffer.data.offset


def _pointers(words, size, table):
    """The data addresses of the buffers in a frame's args or rets table."""
    count = words[size]
    if not count:
        return []
    return [_load(buffer + _DATA).value for buffer in (ctypes.c_uint64 * count).from_address(words[table])]


class Call:
    """What a handler gets at execution, read from the call frame at `address` on demand:
    arg_pointers() and ret_pointers() (the buffers' addresses), first_scalar(name), cuda_stream(),
    device_ordinal(); args and rets (Arrays) and attrs (name -> Python scalar) decode everything."""

    def __init__(self, address):
        self.address = address
        self.words = _frame_words(address)  # its fields as 64-bit words (the stage is the low half of one)

    @property
    def frame(self):
        return CallFrame.from_address(self.address)

    def arg_pointers(self):
        """The operands' addresses, in order (every operand of our custom calls is a buffer)."""
        return _pointers(self.words, _ARGS_SIZE, _ARGS)

    def ret_pointers(self):
        return _pointers(self.words, _RETS_SIZE, _RETS)

    def first_scalar(self, name):
        """The value of attribute `name` (bytes) if it is the first attribute (XLA sorts them by
        name) and an int64 scalar, else None."""
        words = self.words
        if not words[_ATTRS_SIZE]:
            return None
        text, length = _pair(_load(words[_ATTR_NAMES]).value)  # the first name's ByteSpan
        if length != len(name) or ctypes.string_at(text, length) != name or \
                _int32(words[_ATTR_TYPES]).value != _ATTR_SCALAR:
            return None
        dtype, value = _pair(_load(words[_ATTRS]).value)  # XLA_FFI_Scalar: its dtype (an enum), its value's address
        if dtype & 0xFFFFFFFF != _S64:
            return None
        return ctypes.c_int64.from_address(value).value

    @functools.cached_property
    def args(self):
        args = self.frame.args
        return [self._buffer(args.types[i], _ARG_BUFFER, args.args[i], f"argument {i}") for i in range(args.size)]

    @functools.cached_property
    def rets(self):
        rets = self.frame.rets
        return [self._buffer(rets.types[i], _RET_BUFFER, rets.rets[i], f"result {i}") for i in range(rets.size)]

    @functools.cached_property
    def attrs(self):
        frame_attrs, attrs = self.frame.attrs, {}
        for i in range(frame_attrs.size):
            span = frame_attrs.names[i].contents
            name = ctypes.string_at(span.ptr, span.len).decode()
            if frame_attrs.types[i] != _ATTR_SCALAR:
                raise TypeError(f"attribute {name}: only scalar attributes are supported")
            scalar = ctypes.cast(frame_attrs.attrs[i], ctypes.POINTER(Scalar)).contents
            if scalar.dtype not in _SCALAR_TYPES:
                raise TypeError(f"attribute {name}: unsupported scalar type {scalar.dtype}")
            attrs[name] = ctypes.cast(scalar.value, ctypes.POINTER(_SCALAR_TYPES[scalar.dtype])).contents.value
        return attrs

    @staticmethod
    def _buffer(kind, expected, pointer, what):
        if kind != expected:
            raise TypeError(f"{what}: expected a buffer, got XLA FFI type {kind}")
        return Array(pointer, what)

    def _api_call(self, name, args_type):
        function = _api_function(self.words[_API], name)
        args = args_type(ctypes.sizeof(args_type), None, self.words[_CTX])
        error = function(args)
        if error:
            raise FfiError(f"XLA_FFI_{name} failed", error)
        return args

    def cuda_stream(self):
        """The CUstream XLA runs this call on."""
        return self._api_call("Stream_Get", StreamGetArgs).stream or 0

    def device_ordinal(self):
        return self._api_call("DeviceOrdinal_Get", DeviceOrdinalGetArgs).device_ordinal


_api_functions = {}  # (API table address, name) -> the callable entry; XLA's table lives as long as the process


def _api_function(api, name):
    function = _api_functions.get((api, name))
    if function is None:
        table = Api.from_address(api)
        if table.struct_size < getattr(Api, name).offset + ctypes.sizeof(c_void_p):
            raise RuntimeError(f"this XLA's FFI API has no {name}")
        function = _api_functions[api, name] = getattr(table, name)
    return function


def _answer_metadata(frame, traits):
    extension = ctypes.cast(frame.extension_start, ctypes.POINTER(MetadataExtension)).contents
    metadata = extension.metadata.contents
    framework = frame.api.contents.api_version
    version = min(API_VERSION, (framework.major_version, framework.minor_version))
    metadata.api_version = ApiVersion(ctypes.sizeof(ApiVersion), None, *version)
    metadata.traits = traits


def _error(frame, message):
    args = ErrorCreateArgs(struct_size=ctypes.sizeof(ErrorCreateArgs), message=message.encode(errors="replace"),
                           errc=_ERROR_INTERNAL)
    return frame.api.contents.Error_Create(ctypes.byref(args))


def _run(function, traits, address):
    try:
        if _load(address).value < CALL_FRAME_SIZE:  # struct_size
            return _error(CallFrame.from_address(address),
                          f"XLA_FFI_CallFrame of {_load(address).value} bytes, expected {CALL_FRAME_SIZE}")
        call = Call(address)
        extension = call.words[_EXT]
        if extension and ExtensionBase.from_address(extension).type == _EXTENSION_METADATA:
            _answer_metadata(call.frame, traits)
            return None
        if call.words[_STAGE] & 0xFFFFFFFF != _STAGE_EXECUTE:
            return None  # only an execute handler is registered; nothing to do at other stages
        function(call)
        return None
    except FfiError as error:
        return error.pointer
    except BaseException as error:  # noqa: BLE001 -- nothing may unwind through XLA's C frames
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        return _error(CallFrame.from_address(address), f"cupyflash: {detail}")


_keep_alive = []  # the callbacks must outlive every XLA executable that may call them


def handler_capsule(function, traits=0):
    """A PyCapsule holding a C function pointer that runs `function(Call)` at execution and answers
    `traits` (XLA_FFI_Handler_Traits bits) at registration."""
    callback = _Handler(lambda address: _run(function, traits, address))
    _keep_alive.append(callback)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = (c_void_p, ctypes.c_char_p, c_void_p)
    return new_capsule(ctypes.cast(callback, c_void_p), None, None)
