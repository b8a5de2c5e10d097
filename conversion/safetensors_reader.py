"""Read safetensors files into numpy without torch, bfloat16 included.

`safetensors.numpy` cannot represent bfloat16 (the dtype of real Qwen checkpoints),
so this parses the format directly: 8-byte little-endian header length, a JSON
header of {name: {dtype, shape, data_offsets}}, then the raw bytes, which are
memory-mapped. Truncated or corrupt files are reported with the file name.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from .mapping import CheckpointError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """One memory-mapped safetensors file; `get(name)` returns a numpy view."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (too short)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors header")
            try:
                header = json.loads(f.read(header_len))
            except ValueError as e:
                raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        for name, info in header.items():
            end = info["data_offsets"][1]
            if end > data_len:
                raise CheckpointError(
                    f"{path}: truncated: tensor {name!r} ends at byte {end} of the data section "
                    f"but the file holds only {data_len}")
            if info["dtype"] not in _DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        self.header = header
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if size else None

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        start, end = info["data_offsets"]
        buf = self._map[self._data_start + start: self._data_start + end]
        return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


class SafetensorsCheckpoint:
    """All safetensors shards of an HF model directory, addressed by tensor name."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors weights found in {hf_dir} (expected model.safetensors "
                                  f"or model.safetensors.index.json with shards)")
        self.files = {}
        self._where: dict[str, SafetensorsFile] = {}
        for fname in files:
            path = os.path.join(hf_dir, fname)
            if not os.path.exists(path):
                raise CheckpointError(f"shard {fname} listed in the index is missing from {hf_dir}")
            st = SafetensorsFile(path)
            self.files[fname] = st
            for k in st.keys():
                self._where[k] = st

    def keys(self):
        return self._where.keys()

    def __iter__(self):
        return iter(self._where)

    def __contains__(self, key):
        return key in self._where

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)
