"""The example notebooks and scripts in examples/ run on the tiny model.

Every notebook is executed with nbclient in a fresh working directory; the scripts
are checked to parse their command line, and one is run end to end. All share one
OMNI_JAX_CACHE (the tiny checkpoint is built once) and the session's JAX compilation cache,
so stages that compile the same shapes (the thinker of every example) compile them once.
"""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = ["text_chat", "speech_reply", "omni_inputs"]


@pytest.fixture(scope="module")
def example_env(tmp_path_factory):
    """Environment of the kernels and scripts: shared model and compilation caches, CPU JAX."""
    root = tmp_path_factory.mktemp("examples_cache")
    with pytest.MonkeyPatch.context() as mp:
        # A kernel started by nbclient, and its stage processes, inherit os.environ.
        mp.setenv("OMNI_JAX_CACHE", str(root / "models"))
        mp.setenv("JAX_PLATFORMS", "cpu")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        from omni_jax.models.qwen2_5_omni.tiny import tiny_checkpoint

        tiny_checkpoint()  # build the tiny model once, before the first notebook needs it
        # The kernels and stage processes inherit the session's JAX compilation cache (conftest):
        # the thinker shapes every example uses, and the CLI demo before them, compile once.
        yield root


def _outputs(nb, kind=None):
    """(cell index, output) pairs of the executed notebook's code cells."""
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code"
            for o in c.get("outputs", []) if kind is None or o.output_type == kind]


def _text(nb) -> str:
    """Everything the notebook printed or displayed as text, in order, each output on lines of its
    own (stderr's progress bars end without a newline)."""
    parts = []
    for _, o in _outputs(nb):
        if o.output_type == "stream":
            parts.append(o.text if o.text.endswith("\n") else o.text + "\n")
        elif "data" in o:
            parts.append(o.data.get("text/plain", "") + "\n")
    return "".join(parts)


def run_notebook(name: str, workdir: Path):
    """Execute examples/<name>.ipynb in `workdir` with the venv's kernel; return the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    # Which python runs the kernel: it must be this venv's (where omni_jax is installed).
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print('KERNEL_PYTHON=' + sys.executable)"))
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    errors = _outputs(nb, "error")
    assert not errors, errors
    first = "".join(o.text for _, o in _outputs(nb, "stream") if "KERNEL_PYTHON=" in o.text)
    assert f"KERNEL_PYTHON={sys.executable}" in first, first
    return nb


def test_notebooks_are_saved_without_outputs():
    import nbformat

    for name in NOTEBOOKS:
        nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), name
        # The first code cell holds the parameters: the model, "tiny" by default.
        assert code[0].source.startswith('MODEL = "tiny"') and "omni-jax convert" in code[0].source, name


def test_text_chat_notebook(example_env, tmp_path):
    nb = run_notebook("text_chat", tmp_path)
    text = _text(nb)
    assert text.count("assistant: ") >= 2  # two turns
    # Streamed: several updates (those the notebook had not read yet come as one, so there may
    # be fewer than tokens).
    assert "12 tokens, finish_reason=length]" in text
    updates = int(text.split(" updates, 12 tokens")[0].rsplit("[", 1)[1])
    assert 2 <= updates <= 13
    # The history holds both turns and both replies.
    assert "system:" in text and text.count("     user:") == 2 and text.count("assistant:") >= 4


def test_speech_reply_notebook(example_env, tmp_path):
    nb = run_notebook("speech_reply", tmp_path)
    text = _text(nb)
    assert "voices: Chelsie, Ethan" in text
    for metric in ("TTFT", "time to first audio", "RTF"):
        assert metric in text
    with wave.open(str(tmp_path / "reply.wav")) as f:
        assert f.getframerate() == 24000 and f.getnchannels() == 1 and f.getnframes() > 0
    audio = [o for _, o in _outputs(nb, "display_data") if "<audio" in o.data.get("text/html", "")]
    assert len(audio) == 1


def test_omni_inputs_notebook(example_env, tmp_path):
    nb = run_notebook("omni_inputs", tmp_path)
    text = _text(nb)
    images = [o for _, o in _outputs(nb) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the picture and the frames
    counts = [int(line.split()[0]) for line in text.splitlines() if line.endswith(" prompt tokens")
              or "prompt tokens (each" in line]
    assert len(counts) == 2 and all(n > 300 for n in counts), counts  # media expanded to encoder tokens
    assert text.count("answer: ") == 2
    assert "a bare array has no sample rate" in text


def _script(name: str, *args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_script_help(name):
    r = _script(name, "--help", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--model" in r.stdout and "omni-jax convert" in r.stdout


def test_phone_call_script_help():
    # The bridge itself runs against a server in test_realtime.py (test_the_phone_example_bridges_a_call).
    r = _script("phone_call", "--help", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--server" in r.stdout and "Twilio" in r.stdout


def test_speech_reply_script(example_env, tmp_path):
    """The script versions mirror the notebooks; this one exercises all three stages."""
    r = _script("speech_reply", "--model", "tiny", "--voice", "Chelsie", "--out", "out.wav", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "voices: Chelsie, Ethan" in r.stdout and "RTF" in r.stdout and "wrote out.wav" in r.stdout
    with wave.open(str(tmp_path / "out.wav")) as f:
        assert f.getframerate() == 24000 and f.getnframes() > 0
