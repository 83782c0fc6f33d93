"""DLPack capsules read, consumed and built by hand with ctypes, for tests
of inputs no real producer makes (a CUDA device without a GPU, lanes, a
null data pointer)."""
import ctypes
import sys

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


# ---- produced tensors: one capsule per tensor, and a count of deleter calls --------------
#
# A Produced tensor's deleter counts its calls, so a test can hold every path
# to exactly one. Its capsule has no destructor: a destructor that runs Python
# code (a ctypes callback) would run while the consumer's exception is in
# flight, which Python code cannot do safely. The test plays the producer's
# destructor instead: finish() runs the deleter if no consumer took the
# tensor (renamed the capsule "used_*"). The deleter is module-level, since a
# Buffer may outlive the test's locals; the struct, shape, strides and data
# live in the Produced object (close() keeps it in a small graveyard, so a
# late deleter call still finds its memory).

_capsule_new_owned = _api["PyCapsule_New"]
_capsule_new_owned.restype = ctypes.py_object
_capsule_new_owned.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_LIVE = {}                     # managed struct address -> Produced
_GRAVEYARD = []                # closed Produced objects, kept a while (see above)
CALLBACK_ERRORS = []           # what went wrong inside the deleter (it cannot raise)
STRAY_DELETES = []             # deleter calls for tensors no test holds any more


def _on_delete(pointer):
    try:
        owner = _LIVE.get(pointer)
        if owner is None:
            STRAY_DELETES.append(pointer)
        else:
            owner.deleted += 1
    except BaseException as error:   # noqa: BLE001 - recorded: a callback cannot raise
        CALLBACK_ERRORS.append(repr(error))


_PRODUCED_DELETER = _DELETER(_on_delete)
_PRODUCED_DELETER_ADDRESS = ctypes.cast(_PRODUCED_DELETER, ctypes.c_void_p).value

ITEMSIZE = {(2, 32): 4, (4, 16): 2, (2, 16): 2}   # (code, bits) rlhfz takes -> bytes


class Produced:
    """One DLPack tensor, field by field, and (from capsule()) the one capsule
    that owns it. data is an address (None: null); shape and strides are what
    the struct points at (strides None: a null pointer); ndim may claim
    another length, safe only outside 0..8 (rlhfz must refuse before reading
    the shape). name is the capsule's name, by default the proper one."""

    _UNSET = object()

    def __init__(self, data, shape, strides=None, *, ndim=None, code=2, bits=32, lanes=1,
                 device=(1, 0), byte_offset=0, versioned=True, major=1, minor=0, flags=0,
                 null_shape=False, deleter=True, name=_UNSET, keep=None):
        self.keep = keep                        # whatever owns the memory at `data`
        self.shape_array = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides_array = (None if strides is None
                              else (ctypes.c_int64 * max(len(strides), 1))(*strides))
        self.managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = data
        t.device = DLDevice(*device)
        t.ndim = len(shape) if ndim is None else ndim
        t.dtype = DLDataType(code, bits, lanes)
        if not null_shape:
            t.shape = ctypes.cast(self.shape_array, ctypes.POINTER(ctypes.c_int64))
        if self.strides_array is not None:
            t.strides = ctypes.cast(self.strides_array, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset
        if versioned:
            self.managed.major, self.managed.minor, self.managed.flags = major, minor, flags
        self.has_deleter = bool(deleter)
        if deleter:
            self.managed.deleter = _PRODUCED_DELETER_ADDRESS
        self.address = ctypes.addressof(self.managed)
        self.proper = VERSIONED if versioned else LEGACY
        self.name = self.proper if name is Produced._UNSET else name
        self.deleted = 0
        self.capsules = []
        _LIVE[self.address] = self

    def capsule(self):
        """The capsule (one per tensor: it owns it). The test keeps a
        reference, to see afterwards what the consumer did with it."""
        assert not self.capsules, "one capsule per tensor"
        capsule = _capsule_new_owned(self.address, self.name, None)
        self.capsules.append(capsule)
        return capsule

    def taken(self) -> bool:
        """Whether a consumer took the tensor (renamed its capsule)."""
        return (bool(self.capsules) and self.name == self.proper
                and capsule_name(self.capsules[0]) == USED[self.proper])

    def finish(self):
        """What the producer's destructor does once the capsule dies: run the
        deleter unless a consumer took the tensor. Returns the references to
        the capsule that someone besides this object still holds."""
        extra = 0
        if self.capsules:
            extra = sys.getrefcount(self.capsules[0]) - 2   # the list's and the argument's
            if self.name == self.proper and not self.taken() and self.has_deleter:
                _on_delete(self.address)
        self.capsules.clear()
        return extra

    def close(self):
        """Stop tracking; the memory stays in the graveyard a while."""
        _LIVE.pop(self.address, None)
        _GRAVEYARD.append(self)
        del _GRAVEYARD[:-512]
