"""models/torch_file.py: a torch.save file's tensors read without torch, equal to torch.load's,
and a file whose pickle names anything but tensors refused without running it."""

from __future__ import annotations

import collections
import io
import pickle
import zipfile

import numpy as np
import pytest
import torch

from omni_jax.models import torch_file


def test_tensors_read_as_torch_reads_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    saved = {
        "f32": base, "bf16": base.to(torch.bfloat16), "f16": base.half(), "i64": torch.arange(5),
        "bool": base > 0, "transposed": base.t(), "sliced": base[2:5, 1:7:2],  # strides and an offset
        "nested": collections.OrderedDict(a={"b": base[0], "n": 3}, c=[base[1], 2.5, "text"]),
        "scalar": torch.tensor(7.0),
    }
    path = tmp_path / "t.pt"
    torch.save(saved, path)
    got = torch_file.load(str(path))

    def same(a, b):
        if isinstance(b, torch.Tensor):
            want = b.float().numpy() if b.dtype == torch.bfloat16 else b.numpy()
            assert isinstance(a, np.ndarray) and a.shape == want.shape
            assert np.array_equal(np.asarray(a, want.dtype), want)
        elif isinstance(b, dict):
            assert list(a) == list(b)
            for k in b:
                same(a[k], b[k])
        elif isinstance(b, list):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    same(got, saved)
    assert got["bf16"].dtype.name == "bfloat16"


def _zip_with(tmp_path, payload: bytes) -> str:
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", payload)
    return str(path)


class _Runs:
    def __reduce__(self):
        import os

        return (os.system, ("touch should-not-exist",))


def test_a_pickle_naming_other_things_is_refused_unrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(torch_file.TorchFileError, match=r"names (posix|os)\.system, which a file of tensors"):
        torch_file.load(_zip_with(tmp_path, pickle.dumps(_Runs(), protocol=2)))
    assert not (tmp_path / "should-not-exist").exists()
    legacy = io.BytesIO()
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    (tmp_path / "old.pt").write_bytes(legacy.getvalue())
    with pytest.raises(torch_file.TorchFileError, match="not in torch's zip format"):
        torch_file.load(str(tmp_path / "old.pt"))
