"""The checkpoint a `model` argument names, made ready to load.

A `model` is one of: a built-in tiny model ("tiny", "tiny-qwen3_omni"; built on first use), a
converted OmniJax checkpoint (a directory with omni_jax_config.json), a Hugging Face checkpoint
directory (config.json + safetensors), or a Hugging Face Hub id such as "Qwen/Qwen2.5-Omni-7B",
as vLLM takes one. A Hub id is fetched with huggingface_hub (its cache, its token, HF_ENDPOINT
and HF_HUB_OFFLINE apply; only the files conversion reads), and a Hugging Face checkpoint is
converted once into this cache (`OMNI_JAX_CACHE/converted`, `~/.cache/omni-jax` by default):
later starts load the conversion. `omni-jax convert` does the same into a directory of your
choice.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import os
import re
import shutil
import sys

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

from conversion.convert import TOKENIZER_FILES, convert, describe, read_hf_config

from .checkpoint import CONFIG_FILE, read_config
from .errors import CheckpointError, UnknownModelError
from .models.registry import family_of, resolve_model, stages_of, tiny_family
from .paths import cache_root

# A Hub repo id (owner/name), and the files of one that conversion reads: the weights and their
# index, the configs, the tokenizer's and processor's files, Qwen2.5-Omni's voices.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json", "spk_dict.pt", *TOKENIZER_FILES)
# Weights keep the checkpoint's own dtype when it is float32 (tests, tiny models); released
# checkpoints (bfloat16) stay bfloat16, as `omni-jax convert` writes by default.
_KEPT_DTYPES = ("float32",)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """`--model` and `--revision`, for the commands that start an engine."""
    p.add_argument("--model", default="tiny",
                   help="a Hugging Face Hub id (Qwen/Qwen2.5-Omni-7B) or checkpoint directory, converted once into "
                        "the cache; a converted checkpoint directory; or a built-in tiny random model: 'tiny' "
                        "(Qwen2.5-Omni, default) or 'tiny-qwen3_omni'")
    add_revision_argument(p)


def add_revision_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None, help="a Hub model's branch, tag or commit (default: main)")


def checkpoint_dir(model: str, revision: str | None = None, progress: bool = True) -> str:
    """A converted checkpoint directory for `model` (module docstring), a Hub model at `revision`
    (a branch, tag or commit; None: main): fetched and converted first if need be;
    CheckpointError saying what `model` is not, or what failed."""
    _check_revision(model, revision)
    if tiny_family(model) is not None:
        return resolve_model(model)
    if os.path.isfile(os.path.join(model, CONFIG_FILE)):
        return model
    if os.path.isfile(os.path.join(model, "config.json")):
        return converted(model, _local_key(model), model, progress)
    if os.path.exists(model):
        raise CheckpointError(f"{model} is not an OmniJax checkpoint ({CONFIG_FILE} missing) nor a Hugging Face one "
                              f"(config.json missing)")
    if HUB_ID.fullmatch(model):
        return _from_hub(model, revision, progress)
    raise CheckpointError(f"{model}: no such directory, and not a Hugging Face model id (owner/name) or a built-in "
                          f"tiny model")


def _check_revision(model: str, revision: str | None) -> None:
    if revision is not None and (os.path.exists(model) or not HUB_ID.fullmatch(model)):
        raise CheckpointError(f"a revision ({revision!r}) is for a Hugging Face Hub id, and {model} is not one")


def model_config(model: str, revision: str | None = None) -> tuple[str, dict, list[str]]:
    """(family, HF config, stages) of `model` (as checkpoint_dir takes it) without converting it or
    fetching its weights: a Hub model's config.json alone is fetched. The stages of a checkpoint
    not converted yet are those its config sets up, the speech ones only with audio output on
    (`enable_audio_output`); conversion goes by the weights present."""
    _check_revision(model, revision)
    if os.path.isfile(os.path.join(model, "config.json")):
        hf_config = read_hf_config(model)
    elif HUB_ID.fullmatch(model) and not os.path.exists(model):
        hf_config = read_hf_config(fetch(model, revision, ("config.json",)))
    else:  # a converted or tiny model, or an error saying what `model` is not
        cfg = read_config(checkpoint_dir(model, revision, progress=False))
        return cfg["family"], cfg["hf_config"], list(cfg["stages"])
    try:
        family = family_of(hf_config)
    except UnknownModelError as e:
        raise CheckpointError(f"{model}: {e}") from None
    text, *speech = stages_of(family).items()
    speaks = hf_config.get("enable_audio_output", True) is not False
    return family, hf_config, [n for n, spec in (text, *(speech if speaks else ())) if spec.config_key in hf_config]


def _from_hub(repo_id: str, revision: str | None, progress: bool) -> str:
    """A Hub model's conversion. Its config is fetched first (one small file, whose snapshot names
    the commit): a commit converted before loads without its weights fetched again (their
    download may have been deleted since)."""
    prefix = repo_id.replace("/", "--")
    try:
        commit = os.path.basename(os.path.normpath(fetch(repo_id, revision, ("config.json",))))
    except CheckpointError as e:
        kept = sorted(glob.glob(os.path.join(cache_root(), "converted", f"{prefix}-*", CONFIG_FILE)))
        if kept:
            raise CheckpointError(f"{e}. Converted before, and loadable as the model: "
                                  f"{', '.join(os.path.dirname(k) for k in kept)}") from None
        raise
    key = f"{prefix}-{commit[:12]}"
    done = os.path.join(cache_root(), "converted", key)
    if os.path.isfile(os.path.join(done, CONFIG_FILE)):
        return done
    print(f"[omni-jax] {repo_id}: fetching its weights from the Hugging Face Hub ({constants.ENDPOINT}) into its "
          f"cache ({constants.HF_HUB_CACHE}), or taking them from there", file=sys.stderr)
    return converted(fetch(repo_id, commit), key, repo_id, progress)


def fetch(repo_id: str, revision: str | None = None, patterns: tuple[str, ...] = HUB_FILES) -> str:
    """The local snapshot of a Hub model at `revision` (downloaded if the cache lacks it): the
    files conversion reads (`patterns`)."""
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns))
    except GatedRepoError:
        raise CheckpointError(f"{repo_id} is gated on the Hugging Face Hub: accept its terms on its page, then log in "
                              f"(`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such directory, and no such model on the Hugging Face Hub (a private "
                              f"one needs `hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo_id} has no revision {revision!r} on the Hugging Face Hub") from None
    except LocalEntryNotFoundError as e:  # offline, or the Hub unreachable, and not in the cache
        why = str(e).splitlines()[0]
        raise CheckpointError(f"{repo_id} is not in the Hugging Face cache and the Hub cannot be reached ({why}); "
                              f"download it where it can (`hf download {repo_id}`) and pass its directory "
                              f"as the model") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"fetching {repo_id} from the Hugging Face Hub failed: {e}") from None


def converted(hf_dir: str, key: str, name: str, progress: bool = True) -> str:
    """The cache's conversion of the Hugging Face checkpoint at `hf_dir` (kept under `key`), made
    now if it is not there yet; one process converts while any other waits for it."""
    out = os.path.join(cache_root(), "converted", key)
    if os.path.isfile(os.path.join(out, CONFIG_FILE)):
        return out
    hf_config = read_hf_config(hf_dir)
    try:
        family_of(hf_config)  # not a Qwen-Omni checkpoint: say so before anything is written
    except UnknownModelError as e:
        raise CheckpointError(f"{name}: {e}") from None
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with _locked(out + ".lock"):
        if os.path.isfile(os.path.join(out, CONFIG_FILE)):  # another process converted it meanwhile
            return out
        _check_space(hf_dir, out, name)
        dtype = _dtype_of(hf_config)
        print(f"[omni-jax] {name}: converting it to OmniJax's format ({dtype}) into {out}, once (later starts "
              f"load it from there)", file=sys.stderr)
        try:
            convert(hf_dir, out, dtype, overwrite=True, progress=progress)
        except OSError as e:  # a disk that filled up, a file unreadable: nothing half-written is kept
            raise CheckpointError(f"converting {name} into {out} failed: {e}") from e
        print(f"[omni-jax] converted {name}:\n{describe(out)}", file=sys.stderr)
    return out


def _local_key(hf_dir: str) -> str:
    """A cache key for a checkpoint directory: its name and a hash of where it is and what it
    holds (its config, and its weights' names, sizes and times), so a changed one converts again."""
    path = os.path.realpath(hf_dir)
    h = hashlib.sha256(path.encode())
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    for f in sorted(_weight_files(path)):
        st = os.stat(f)
        h.update(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{os.path.basename(path)}-{h.hexdigest()[:12]}"


def _weight_files(hf_dir: str) -> list[str]:
    return glob.glob(os.path.join(hf_dir, "*.safetensors")) + glob.glob(os.path.join(hf_dir, "spk_dict.pt"))


def _dtype_of(hf_config: dict) -> str:
    dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return dtype if dtype in _KEPT_DTYPES else "bfloat16"


def _check_space(hf_dir: str, out: str, name: str) -> None:
    """A conversion needs about as much disk as the weights it reads: refuse at once if the cache
    has less, rather than fail part way through minutes of writing."""
    need = sum(os.path.getsize(f) for f in _weight_files(hf_dir))
    free = shutil.disk_usage(os.path.dirname(out)).free
    if need > free:
        raise CheckpointError(f"converting {name} needs about {need / 1e9:.1f} GB in {os.path.dirname(out)}, which has "
                              f"{free / 1e9:.1f} GB free; free some, or point OMNI_JAX_CACHE at another disk")


@contextlib.contextmanager
def _locked(path: str):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

