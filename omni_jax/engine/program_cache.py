"""Traced programs kept between processes, so that a stage started again skips tracing them.

JAX's persistent compilation cache keys each executable by the lowered module, so a restarted
stage still traces and lowers every step program to find it: the real Qwen2.5-Omni-7B thinker's
step took ~0.85 s a bucket to trace and lower for CUDA (2-core CPU), ~25 s a start. A
`ProgramCache` keeps each program as `jax.export` writes it (its StableHLO, serialized), keyed by
what determines the trace: the scope (the code's digest, JAX's version, the backend's devices,
JAX's numeric flags and the variables JAX and XLA read, and what the caller names: a stage's
family, configuration and checkpoint config) plus the program's name, its arguments' tree,
shapes and dtypes and its static values. A later start reads it back (milliseconds) instead of
tracing; a miss traces and writes it. Every call, the first run's included, goes through the
exported program, so both runs run the same one. A scope directory per code version and stage;
one that no stage has started from in PRUNE_AFTER_DAYS is removed when a stage starts (every
upgrade, every edit of the code, leaves one behind).

Single-device programs only (the caller checks): an exported program keeps the shardings it
was traced with, which a mesh's arguments would have to match.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import struct
import time
import tempfile
from pathlib import Path
from typing import Callable

import jax

log = logging.getLogger("omni_jax.program_cache")

# The packages whose code a program is traced from (their Python and the CPU kernels' C++).
_CODE_PACKAGES = ("omni_jax", "kernels_pallas", "kernels_cpu")
_CODE_SUFFIXES = (".py", ".cc")
# The custom calls OmniJax's programs make (its CPU kernels' FFI targets, kernels_cpu/, and the
# Triton calls Pallas lowers its GPU kernels to): jax.export refuses targets without
# compatibility guarantees unless named; none is needed, as a program is only read back by the
# code and jaxlib that wrote it (both in the scope). A target missing here fails the export:
# that program is then traced as usual (`_program`).
_CUSTOM_CALLS = ("omni_jax_paged_attention", "omni_jax_ragged_paged_attention", "__gpu$xla.gpu.triton")


# A scope directory no stage started from for this long is removed (`prune`).
PRUNE_AFTER_DAYS = 14
_SCOPE_NAME = re.compile(r"[0-9a-f]{32}")  # what `ProgramCache` names its scope directories


class Unsupported(Exception):
    """A program the cache cannot keep (its tree or static values have no stable key)."""


@functools.cache
def code_digest() -> str:
    """sha256 of OmniJax's source files (names and contents): any change is another scope."""
    h = hashlib.sha256()
    for package in _CODE_PACKAGES:
        spec = __import__(package).__file__
        root = Path(spec).parent
        for path in sorted(p for p in root.rglob("*") if p.suffix in _CODE_SUFFIXES):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment() -> dict:
    """What else decides a trace: versions, devices, JAX's numeric flags and the variables JAX
    and XLA read (OmniJax reads none that change a trace)."""
    import jaxlib

    env = {k: v for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_"))}
    devices = jax.local_devices()
    flags = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion")
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": devices[0].platform,
            "devices": sorted({d.device_kind for d in devices}), "num_devices": len(devices),
            "flags": {f: str(getattr(jax.config, f)) for f in flags}, "env": env}


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ------------------------------------------------------------------ trees without pickle
def encode_tree(treedef) -> object:
    """A JSON form of a tree of tuples, lists, dicts (str or int keys), None and OmniJax's
    NamedTuples (a media encoder's metadata)."""
    data = treedef.node_data()
    if data is None:
        return "*"
    kind, aux = data
    kids = [encode_tree(c) for c in treedef.children()]
    if kind is type(None):
        return None
    if kind in (tuple, list):
        return {kind.__name__: kids}
    if kind is dict and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in aux):
        return {"dict": [[k, c] for k, c in zip(aux, kids)]}
    if issubclass(kind, tuple) and hasattr(kind, "_fields") and kind.__module__.startswith("omni_jax."):
        return {"namedtuple": [kind.__module__, kind.__qualname__, kids]}
    raise Unsupported(f"a {kind.__name__} node in the tree")


def _placeholder(e):
    if e == "*":
        return 0
    if e is None:
        return None
    ((kind, kids),) = e.items()
    if kind == "dict":
        return {k: _placeholder(c) for k, c in kids}
    if kind == "namedtuple":
        module, name, kids = kids
        if not module.startswith("omni_jax."):  # only OmniJax's own (what encode_tree writes)
            raise Unsupported(f"a NamedTuple of {module}")
        return getattr(importlib.import_module(module), name)(*(_placeholder(c) for c in kids))
    return {"tuple": tuple, "list": list}[kind](_placeholder(c) for c in kids)


def decode_tree(e):
    """The treedef `encode_tree` wrote."""
    return jax.tree.structure(_placeholder(e))


# ------------------------------------------------------------------ the cache
class ProgramCache:
    """Exported programs under `directory`/<scope digest>/ (see module docstring)."""

    def __init__(self, directory: str, scope: dict):
        self.scope = {"code": code_digest(), "environment": _environment(), "caller": scope}
        self.dir = os.path.join(directory, _digest(self.scope)[:32])
        self.stats = {"loaded": 0, "exported": 0}
        self._names: set[str] = set()
        self._failed: set[str] = set()

    def jit(self, name: str, fn: Callable, *, static_argnames: tuple = (), donate_argnums: tuple = (),
            compiler_options: dict | None = None):
        """`jax.jit(fn, ...)` whose body comes from the cache: per argument shapes and static
        values, the exported program is read back, or traced, exported and written. `name`
        must be unique in the process (it keys the program beside its arguments)."""
        if name in self._names:
            raise ValueError(f"program {name!r} is already cached in this process")
        self._names.add(name)

        def body(*args, **static):
            return self._program(name, fn, args, static)

        return jax.jit(body, static_argnames=static_argnames, donate_argnums=donate_argnums,
                       compiler_options=compiler_options)

    def _program(self, name: str, fn: Callable, args: tuple, static: dict):
        """Inside the jit's trace of `body`: call the exported program on `args` (tracers), or
        trace `fn` itself where the program cannot be kept (said once in the log)."""
        try:
            return self._exported(name, fn, args, static)
        except Exception as e:
            if name not in self._failed:
                self._failed.add(name)
                log.warning("program %r traced without the program cache: %s: %s", name, type(e).__name__, e)
            return fn(*args, **static)

    def _exported(self, name: str, fn: Callable, args: tuple, static: dict):
        from jax import export

        leaves, in_tree = jax.tree.flatten(args)
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.aval.weak_type) for x in leaves]
        statics = {k: repr(v) for k, v in sorted(static.items())}
        if any(" at 0x" in r for r in statics.values()):
            raise Unsupported(f"program {name!r}: a static argument without a stable repr: {statics}")
        key = _digest({"name": name, "in_tree": encode_tree(in_tree), "static": statics,
                       "avals": [(a.shape, str(a.dtype), a.weak_type) for a in avals]})
        path = os.path.join(self.dir, f"{name}-{key[:32]}.exported")
        entry = self._read(path)
        if entry is None:
            out_tree = []

            def flat(*xs):
                out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, xs), **static))
                out_tree.append(encode_tree(tree))
                return out

            checks = [export.DisabledSafetyCheck.custom_call(c) for c in _CUSTOM_CALLS]
            exported = export.export(jax.jit(flat), disabled_checks=checks)(*avals)
            entry = (out_tree[0], exported)
            self._write(path, out_tree[0], exported.serialize())
            self.stats["exported"] += 1
        else:
            self.stats["loaded"] += 1
        encoded, exported = entry
        return jax.tree.unflatten(decode_tree(encoded), exported.call(*leaves))

    @staticmethod
    def _read(path: str):
        """(encoded out tree, Exported) of an entry, or None (absent, or unreadable: traced again)."""
        from jax import export

        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:  # absent (or no directory to hold it)
            return None
        try:
            (n,) = struct.unpack("<I", blob[:4])
            return json.loads(blob[4:4 + n])["out_tree"], export.deserialize(bytearray(blob[4 + n:]))
        except Exception as e:  # a torn or foreign file: trace again and write it anew
            log.warning("program cache entry %s unreadable (%s: %s); tracing again", path, type(e).__name__, e)
            return None

    def _write(self, path: str, out_tree, serialized: bytes) -> None:
        header = json.dumps({"out_tree": out_tree}).encode()
        self._write_file(path, struct.pack("<I", len(header)) + header + serialized)

    def _write_file(self, path: str, data: bytes) -> None:
        """Write beside `path`, then rename: a reader sees all of it or none."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".writing-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    # --------------------------------------------------------------- small JSON facts
    def fact(self, name: str, compute: Callable[[], object], **key) -> object:
        """A JSON value kept beside the programs (e.g. what a one-time trace found), computed
        on a miss."""
        path = os.path.join(self.dir, f"{name}-{_digest(key)[:32]}.json")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):  # absent, unreadable or torn: computed again
            pass
        value = compute()
        try:
            self._write_file(path, json.dumps(value).encode())
        except OSError as e:  # a cache that cannot be written costs the next start a trace, nothing more
            log.warning("program cache: %s not written (%s)", path, e)
        return value


_active: ProgramCache | None = None


def activate(directory: str, scope: dict) -> ProgramCache:
    """Keep this process's cacheable programs under `directory` (a stage process, at start-up),
    marking its scope directory used and removing the scopes left unused (`prune`)."""
    cache = ProgramCache(directory, scope)
    try:
        os.utime(cache.dir)
    except OSError:  # not written yet (its first start), or not writable: nothing to mark
        pass
    prune(directory)
    use(cache)
    return cache


def prune(directory: str, max_age_s: float = PRUNE_AFTER_DAYS * 86400.0) -> list[str]:
    """Remove the scope directories under `directory` unused for `max_age_s` (by their time
    stamp, which `activate` renews); anything not named as a scope is left alone. Returns
    what was removed. A stage still running from a removed scope traces what it misses."""
    removed, now = [], time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        try:
            old = entry.is_dir(follow_symlinks=False) and now - entry.stat(follow_symlinks=False).st_mtime > max_age_s
        except OSError:
            continue
        if old and _SCOPE_NAME.fullmatch(entry.name):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    if removed:
        log.info("program cache: removed %d scope(s) unused for %.0f days", len(removed), max_age_s / 86400)
    return removed


def use(cache: ProgramCache | None) -> None:
    """Make `cache` this process's program cache (None: none)."""
    global _active
    _active = cache


def active() -> ProgramCache | None:
    return _active


def jit(name: str, fn: Callable, **kwargs):
    """`jax.jit(fn, **kwargs)` whose body comes from the process's program cache when one is
    active (`ProgramCache.jit`: a single-device stage process), else plain."""
    return jax.jit(fn, **kwargs) if _active is None else _active.jit(name, fn, **kwargs)
