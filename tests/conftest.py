"""Session fixtures: tiny random checkpoints (built once, never downloaded).

Where torch is installed (the Python 3.11 environment), the tiny checkpoints are built by
transformers and converted, so the same weights serve the parity tests and the rest. Without
torch (the Python 3.12 run of `.ci/py312`) the converted fixtures are the package's
numpy-built tiny models instead (same architectures, other random weights), the tests that
need the transformers reference carry the `torch` marker (`-m "not torch"` deselects them),
and the modules that import torch at the top are not collected: the summary names them.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One JAX compilation cache for the session, this process and every stage process it starts:
# the many engines of the suite compile the same tiny programs once. Engines count a program
# loaded from it as a compilation (engine/runner.py), so no warm-up test gets weaker.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="omni-jax-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
    # Tiny programs compile in well under the default 1 s threshold; cache them all.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# Likewise one cache of traced programs (engine/program_cache.py) for every stage process.
if "OMNI_JAX_PROGRAM_CACHE_DIR" not in os.environ:
    os.environ["OMNI_JAX_PROGRAM_CACHE_DIR"] = tempfile.mkdtemp(prefix="omni-jax-test-programs-")
    atexit.register(shutil.rmtree, os.environ["OMNI_JAX_PROGRAM_CACHE_DIR"], True)

import pytest

import hf_tiny
from omni_jax.engine.jitted import COMPILE_WORKERS_ENV
from omni_jax.models.qwen2_5_omni import tiny as qwen2_5_tiny
from omni_jax.models.qwen3_omni import tiny as qwen3_tiny

# Warm-ups compile one program at a time here, in this process and the stage processes it starts:
# the suite's workers keep every core busy already, and threads then cost more than they save
# (+5% wall, +11% CPU on 2 cores for the AR-engine modules). Tests of the threads set it
# themselves (test_compile_ahead.py, the vocoders' no-compilation-after-warm-up fixtures).
os.environ.setdefault(COMPILE_WORKERS_ENV, "1")

# `pytest --cpu-report`: CPU seconds per module (what CI's two busy cores spend on each).
pytest_plugins = ("cpu_report",)

HAVE_TORCH = importlib.util.find_spec("torch") is not None
# The fixtures that build or load a model with transformers (and so need torch).
REFERENCE_FIXTURES = {"qwen2_5_omni_hf_dir", "qwen2_5_omni_hf_model", "qwen3_omni_hf_dir", "qwen3_omni_hf_model"}
_TOP_LEVEL_IMPORT = re.compile(r"^(?:import|from) (\w+)", re.M)


def _imports_torch(path, seen=()) -> bool:
    """Whether a module of the suite imports torch at the top, itself or through another module
    of the suite."""
    names = set(_TOP_LEVEL_IMPORT.findall(path.read_text()))
    local = [path.parent / f"{n}.py" for n in names]
    return "torch" in names or any(m.is_file() and m not in seen and _imports_torch(m, (*seen, path)) for m in local)


def pytest_configure(config):
    """pyproject's filterwarnings that name modules, for the stage processes, servers and workers
    a test starts, which do not read pytest's configuration: Python's own filters
    (PYTHONWARNINGS, which they inherit) match a module by its whole name, so each module of the
    repository's packages that a filter's pattern matches is named there. Shown first, once per
    place, the deprecations the rest of the code raises: pytest shows them itself only while no
    -W option is set, which PYTHONWARNINGS is for xdist's workers."""
    root = Path(config.rootpath)
    modules = [".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
               for d in sorted(root.iterdir()) if (d / "__init__.py").is_file() for f in sorted(d.rglob("*.py"))]
    filters = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w] or [
        "default::DeprecationWarning", "default::PendingDeprecationWarning"]
    for line in config.getini("filterwarnings"):
        action, message, category, pattern = (line.split(":", 4) + [""] * 4)[:4]
        if pattern:
            filters += [f for m in modules if re.match(pattern, m)
                        for f in [f"{action}:{message}:{category}:{m}"] if f not in filters]
    os.environ["PYTHONWARNINGS"] = ",".join(filters)


def pytest_ignore_collect(collection_path, config):
    """Without torch, a test module that imports it at the top cannot be imported: leave it out
    (and say so in the summary) instead of failing the collection."""
    if HAVE_TORCH or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if _imports_torch(collection_path) else None


# The modules that take the most worker time (`--durations`, 3.11 suite on 2 cores), about
# longest first. xdist's loadfile hands out modules in collection order (a first batch to each
# worker in turn, then one to whichever is free): started last, one of these would run on one
# worker while the other idles. The two that build no tiny-preset pipeline (their own buckets,
# GPU programs) start the two workers, as they share no compiled program with the rest.
# Every module over about 90 s is listed: the rest, alphabetical, are short enough to even out
# the two workers' ends (in a run where the list stopped at 8, test_voice_page's 115 s came near
# the end and ran alone for a minute and a half).
SLOW_MODULES = ("test_parallel.py", "test_gpu_compile.py", "test_async_chunk_pipeline.py", "test_server.py",
                "test_e2e_speech.py", "test_transcription.py", "test_text_apis.py", "test_kernels.py",
                "test_voice_page.py", "test_examples.py", "test_engine.py", "test_pipeline.py",
                "test_token2wav_streaming.py", "test_model_source.py", "test_server_hostile.py")


# Modules that serve the same pipeline (test_server's `server` and `library`, kept by `kept`),
# in the order they run: one unit of xdist's work, so one worker runs them one after the other
# and starts the server and its library once. test_server last: its last tests stop the server.
RUN_TOGETHER = ("test_realtime.py", "test_realtime_calls.py", "test_server.py")


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the RUN_TOGETHER modules in one unit, handed out in collection
    order (slow modules first: see SLOW_MODULES) rather than by their number of tests, which
    xdist 3.8 does by default."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            head, _, name = path.rpartition("/")
            return f"{head}/{RUN_TOGETHER[0]}" if name in RUN_TOGETHER else path

    config.option.loadscopereorder = False
    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Tests that use a transformers-built model need torch: mark them `torch`. The slow
    modules run first (a stable sort: each module's tests keep their order)."""
    for item in items:
        if REFERENCE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.torch)
    rank = {name: (i, 0) for i, name in enumerate(SLOW_MODULES)}
    together = min(rank.get(name, (len(SLOW_MODULES), 0)) for name in RUN_TOGETHER)[0]
    rank.update({name: (together, i) for i, name in enumerate(RUN_TOGETHER)})
    items.sort(key=lambda item: rank.get(item.path.name, (len(SLOW_MODULES), 0)))


def pytest_terminal_summary(terminalreporter):
    # Listed here, not gathered while collecting: under xdist the workers collect.
    if not HAVE_TORCH:
        left = sorted(p.name for p in Path(__file__).parent.glob("test_*.py") if _imports_torch(p))
        terminalreporter.write_line(f"torch is not installed: {len(left)} modules that import it were not "
                                    f"collected: {', '.join(left)}")


class Kept:
    """Resources the RUN_TOGETHER modules use alike (a served pipeline): each made by the first
    module that asks for it and kept for the others, until a module that is not one of its
    users starts (or the session ends). Another module's are its own for its duration."""

    def __init__(self):
        self.entries: dict = {}  # key -> (value, users, ExitStack)

    def get(self, key, start, module: str):
        """The resource `key` (equal keys: the same resource) for `module`; `start(stack)` makes
        it, entering what stops it into `stack`."""
        if key not in self.entries:
            together = [name.removesuffix(".py") for name in RUN_TOGETHER]
            users = together if module in together else [module]
            stack = contextlib.ExitStack()
            with contextlib.ExitStack() as on_error:
                on_error.push(stack)
                value = start(stack)
                on_error.pop_all()
            self.entries[key] = (value, users, stack)
        return self.entries[key][0]

    def release(self, module: str | None = None):
        """Stop what `module` does not use (None: everything)."""
        for key, (_, users, stack) in list(self.entries.items()):
            if module not in users:
                del self.entries[key]
                stack.close()


@pytest.fixture(scope="session")
def kept():
    k = Kept()
    yield k
    k.release()


@pytest.fixture(scope="module", autouse=True)
def _release_what_this_module_does_not_share(request, kept):
    kept.release(request.module.__name__)


@pytest.fixture(scope="session")
def qwen2_5_omni_hf_dir(tmp_path_factory) -> str:
    """Directory of a tiny random Qwen2.5-Omni checkpoint (safetensors + config + spk_dict.pt)."""
    return hf_tiny.build_qwen2_5_omni(str(tmp_path_factory.mktemp("qwen2_5_omni_hf")))


@pytest.fixture(scope="session")
def qwen2_5_omni_hf_model(qwen2_5_omni_hf_dir):
    """The transformers reference model loaded from the tiny checkpoint (fp32, eval mode)."""
    return hf_tiny.load_qwen2_5_omni(qwen2_5_omni_hf_dir)


@pytest.fixture(scope="session")
def converted_thinker_fp32(request, tmp_path_factory) -> str:
    """The tiny Qwen2.5-Omni in OmniJax format, fp32: the transformers-built checkpoint converted,
    or without torch the package's numpy-built tiny model."""
    return _converted(request, "qwen2_5_omni_hf_dir", str(tmp_path_factory.mktemp("omni_jax") / "tiny_fp32"),
                      lambda out: qwen2_5_tiny.build_random_checkpoint(out, qwen2_5_tiny.tiny_config(), tokenizer=False))


@pytest.fixture(scope="session")
def qwen3_omni_hf_dir(tmp_path_factory) -> str:
    """Directory of a tiny random Qwen3-Omni checkpoint."""
    import hf_tiny_qwen3

    return hf_tiny_qwen3.build_qwen3_omni(str(tmp_path_factory.mktemp("qwen3_omni_hf")))


@pytest.fixture(scope="session")
def qwen3_omni_hf_model(qwen3_omni_hf_dir):
    """The transformers reference Qwen3-Omni (fp32, eval, talker audio_config fixed)."""
    import hf_tiny_qwen3

    return hf_tiny_qwen3.load_qwen3_omni(qwen3_omni_hf_dir)


@pytest.fixture(scope="session")
def converted_qwen3_fp32(request, tmp_path_factory) -> str:
    """The tiny Qwen3-Omni in OmniJax format, fp32 (as `converted_thinker_fp32`)."""
    return _converted(request, "qwen3_omni_hf_dir", str(tmp_path_factory.mktemp("omni_jax_q3") / "tiny_fp32"),
                      qwen3_tiny.build_tiny_checkpoint)


def _converted(request, hf_dir_fixture: str, out: str, build_tiny) -> str:
    """The transformers-built checkpoint converted, or without torch `build_tiny(out)`: the same
    files as that conversion writes (no tokenizer: save_pretrained writes none), other weights."""
    if not HAVE_TORCH:
        return build_tiny(out)
    from conversion.convert import convert

    return convert(request.getfixturevalue(hf_dir_fixture), out, dtype="float32", progress=False)
