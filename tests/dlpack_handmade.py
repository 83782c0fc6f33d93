"""DLPack capsules read, consumed and built by hand with ctypes, for tests
of inputs no real producer makes (a CUDA device without a GPU, lanes, a
null data pointer)."""
import ctypes

import numpy as np

_api = ctypes.PyDLL(None)  # our own handle: leave ctypes.pythonapi's prototypes alone
_capsule_get_name = _api.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]
_capsule_get_pointer = _api.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_set_name = _api.PyCapsule_SetName
_capsule_set_name.restype = ctypes.c_int
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_new = _api.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# A capsule keeps the pointer to its name: these bytes live as long as the module.
LEGACY, VERSIONED = b"dltensor", b"dltensor_versioned"
USED = {LEGACY: b"used_dltensor", VERSIONED: b"used_dltensor_versioned"}

_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # a ctypes call releases the GIL


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


FLAG_READ_ONLY, FLAG_IS_COPIED = 1, 2


def capsule_name(capsule):
    return _capsule_get_name(capsule)


def managed_of(capsule):
    """The DLManagedTensor(Versioned) inside an unconsumed capsule."""
    name = capsule_name(capsule)
    layout = DLManagedTensorVersioned if name == VERSIONED else DLManagedTensor
    return layout.from_address(_capsule_get_pointer(capsule, name))


def take(capsule):
    """Consume a capsule as a DLPack consumer does: rename it, keep the tensor.
    Returns (managed pointer, deleter address); the caller must run the deleter."""
    name = capsule_name(capsule)
    pointer = _capsule_get_pointer(capsule, name)
    deleter = managed_of(capsule).deleter
    assert _capsule_set_name(capsule, USED[name]) == 0
    return pointer, deleter


def strides_of(capsule):
    tensor = managed_of(capsule).dl_tensor
    return tuple(tensor.strides[i] for i in range(tensor.ndim))


class Handmade:
    """A DLPack capsule built field by field (no destructor); keep this object
    alive while the capsule is in use. With deleter=True its deleter records each
    call in .deleted; without, the tensor has no deleter."""

    def __init__(self, data=None, shape=(4,), strides=None, *, code=2, bits=32, lanes=1,
                 device=(1, 0), ndim=None, byte_offset=0, versioned=False, major=1,
                 flags=0, null_shape=False, deleter=None):
        self.array = np.arange(16, dtype=np.float32) if data is None else data
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        self.managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = self.array.ctypes.data if data is not False else None
        t.device = DLDevice(*device)
        t.ndim = len(shape) if ndim is None else ndim
        t.dtype = DLDataType(code, bits, lanes)
        t.shape = None if null_shape else ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            t.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset
        self.deleted = []
        if deleter is not None:
            self.callback = _DELETER(lambda pointer: self.deleted.append(pointer))
            self.managed.deleter = ctypes.cast(self.callback, ctypes.c_void_p).value
        if versioned:
            self.managed.major, self.managed.minor = major, 0
            self.managed.flags = flags
        self.capsule = _capsule_new(ctypes.addressof(self.managed),
                                    VERSIONED if versioned else LEGACY, None)
