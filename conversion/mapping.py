"""Map Hugging Face tensor names and layouts onto OmniJax Flax NNX parameter paths.

OmniJax modules mirror the attribute names of the transformers modules, so the
mapping is mechanical: strip the stage prefix, apply the family's renames, turn the
dotted name into a path, and translate the leaf by the kind of Flax parameter it
lands on:

==================  ===========================  ======================================
Flax leaf           HF leaf                      transform
==================  ===========================  ======================================
``kernel`` (2-D)    ``weight`` [out, in]         transpose -> [in, out]
``kernel`` (N-D)    ``weight`` [out, in, *k]     move axes -> [*k, in, out] (convolutions)
``scale``           ``weight``                   none (LayerNorm)
``embedding``       ``weight``                   none (Embed)
``weight``/other    same name                    none (RMSNorm and custom params)
==================  ===========================  ======================================
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from omni_jax.errors import CheckpointError

Path = tuple
Rename = tuple[str, str]


def _hf_leaf_candidates(leaf: str) -> tuple[str, ...]:
    return ("kernel", "scale", "embedding", "weight") if leaf == "weight" else (leaf,)


def hf_key_to_path(key: str, renames: Sequence[Rename] = ()) -> Path:
    """Dotted HF key (prefix already stripped) -> tuple path with list indexes as ints."""
    for pattern, repl in renames:
        key = re.sub(pattern, repl, key)
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def transform_for(leaf: str, array: np.ndarray) -> np.ndarray:
    """Convert an HF tensor into the layout of the Flax leaf it is stored in."""
    if leaf == "kernel":
        if array.ndim == 2:
            return array.T
        if array.ndim >= 3:
            # [out, in, *spatial] -> [*spatial, in, out]
            return np.transpose(array, tuple(range(2, array.ndim)) + (1, 0))
    return array


def inverse_transform_for(leaf: str, array: np.ndarray) -> np.ndarray:
    """Inverse of :func:`transform_for` (used by the round-trip tests)."""
    if leaf == "kernel":
        if array.ndim == 2:
            return array.T
        if array.ndim >= 3:
            n = array.ndim
            return np.transpose(array, (n - 1, n - 2) + tuple(range(0, n - 2)))
    return array


def map_hf_tensors(
    hf_tensors: Mapping[str, np.ndarray] | Iterable[str],
    target_shapes: Mapping[Path, tuple],
    prefix: str,
    renames: Sequence[Rename] = (),
    ignore: Sequence[str] = (),
) -> dict[Path, tuple[str, str]]:
    """Plan the conversion: Flax path -> (HF key, Flax leaf name).

    Every Flax parameter must be covered by exactly one HF tensor under `prefix`;
    HF tensors under `prefix` that match no parameter (and no `ignore` regex) are
    an error too, since they mean the checkpoint is not the model we think it is.
    """
    plan: dict[Path, tuple[str, str]] = {}
    unused = []
    for key in hf_tensors:
        if not key.startswith(prefix):
            continue
        rel = key[len(prefix):]
        if any(re.search(p, rel) for p in ignore):
            continue
        path = hf_key_to_path(rel, renames)
        for leaf in _hf_leaf_candidates(path[-1]):
            cand = path[:-1] + (leaf,)
            if cand in target_shapes:
                if cand in plan:
                    raise CheckpointError(f"tensors {plan[cand][0]!r} and {key!r} both map to parameter {'.'.join(map(str, cand))}")
                plan[cand] = (key, leaf)
                break
        else:
            unused.append(key)
    missing = [p for p in target_shapes if p not in plan]
    if missing:
        name = ".".join(map(str, missing[0]))
        raise CheckpointError(
            f"checkpoint is missing the tensor for parameter {name!r} (prefix {prefix!r}); "
            f"{len(missing)} parameter(s) missing in all")
    if unused:
        raise CheckpointError(
            f"checkpoint tensor {unused[0]!r} matches no parameter of the model; "
            f"{len(unused)} unexpected tensor(s) in all (is this the right architecture/config?)")
    return plan


def convert_tensors(
    get_tensor: Callable[[str], np.ndarray],
    plan: Mapping[Path, tuple[str, str]],
    target_shapes: Mapping[Path, tuple],
    dtype=None,
    on_tensor: Callable[[], None] | None = None,
    place: Callable[[np.ndarray], Any] | None = None,
) -> dict[Path, Any]:
    """Read, transform, check the shape of and cast every planned tensor; `place` (e.g. onto a
    device) each as it is made, so that only the placed copy stays."""
    out: dict[Path, Any] = {}
    for path, (key, leaf) in plan.items():
        arr = transform_for(leaf, get_tensor(key))
        want = tuple(target_shapes[path])
        if tuple(arr.shape) != want:
            hf_want = tuple(inverse_transform_for(leaf, np.broadcast_to(np.int8(0), want)).shape)
            raise CheckpointError(
                f"tensor {key!r} has shape {tuple(get_tensor(key).shape)}, expected {hf_want} "
                f"(parameter {'.'.join(map(str, path))} of shape {want})")
        if dtype is not None:
            arr = arr.astype(dtype)
        arr = np.ascontiguousarray(arr)
        out[path] = arr if place is None else place(arr)
        if on_tensor is not None:
            on_tensor()
    return out


def load_hf_into(module, hf_tensors: Mapping[str, np.ndarray], prefix: str,
                 renames: Sequence[Rename] = (), ignore: Sequence[str] = (), dtype=None):
    """Fill an NNX module's parameters in place from HF tensors (tests and small models)."""
    from flax import nnx
    import jax.numpy as jnp

    _, state, _ = nnx.split(module, nnx.Param, ...)
    flat = dict(nnx.to_flat_state(state))
    shapes = {p: tuple(v.get_value().shape) for p, v in flat.items()}
    plan = map_hf_tensors(hf_tensors, shapes, prefix, renames, ignore)
    arrays = convert_tensors(lambda k: np.asarray(hf_tensors[k]), plan, shapes, dtype)
    for path, arr in arrays.items():
        flat[path].set_value(jnp.asarray(arr, dtype=flat[path].get_value().dtype if dtype is None else dtype))
    nnx.update(module, nnx.from_flat_state(flat))
    return module
