"""A `torch.save` file's tensors as numpy arrays, without torch (Qwen2.5-Omni's voices come in one).

The file is a zip: `<name>/data.pkl`, a pickle of the saved object whose tensors point at raw
storages, `<name>/data/<key>`. The pickle is read by an unpickler that builds only what such a
file of tensors holds (dicts, tensors, their storages); any other class or function it names is
refused, so no code a file carries can run (as torch.load's weights_only). Little-endian storages,
as torch writes them on every platform OmniJax runs on.
"""

from __future__ import annotations

import collections
import pickle
import zipfile

import ml_dtypes
import numpy as np

_STORAGES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class TorchFileError(ValueError):
    """A file this reader cannot read (not the zip format, or a pickle naming other classes)."""


class _Storage:
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2: a view of `storage` (elements), copied out."""
    step = storage.dtype.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * step for s in stride)).copy()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self.archive, self.prefix, self.storages = archive, prefix, {}

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _STORAGES:
            return _Storage(_STORAGES[name])
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise TorchFileError(f"it names {module}.{name}, which a file of tensors does not need")

    def persistent_load(self, pid):
        kind, storage, key, _location, _numel = pid
        if kind != "storage" or not isinstance(storage, _Storage):
            raise TorchFileError(f"it holds a persistent object {kind!r} that is not a tensor's storage")
        if key not in self.storages:
            raw = self.archive.read(f"{self.prefix}/data/{key}")
            self.storages[key] = np.frombuffer(raw, dtype=storage.dtype)
        return self.storages[key]


def load(path: str):
    """The object saved at `path`, its tensors as numpy arrays; TorchFileError if it cannot be
    read this way."""
    if not zipfile.is_zipfile(path):
        raise TorchFileError("it is not in torch's zip format (saved by torch < 1.6)")
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise TorchFileError("it holds no single data.pkl")
        prefix = pickles[0][:-len("/data.pkl")]
        with archive.open(pickles[0]) as f:
            return _Unpickler(f, archive, prefix).load()
