"""pyproject's filterwarnings: a deprecation raised at a call in OmniJax's own packages fails the
test that makes the call, in the test's process and in those it starts; one a library raises
inside itself does not."""

import subprocess
import sys
import warnings

import pytest


@pytest.mark.parametrize("module", ["omni_jax", "omni_jax.engine.sharding", "kernels_pallas.paged_attention",
                                    "kernels_cpu", "conversion.convert"])
@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
def test_our_deprecated_calls_fail(module, category):
    with pytest.raises(category, match="old API"):
        warnings.warn_explicit("old API", category, "f.py", 1, module=module)


@pytest.mark.parametrize("module", ["flax.nnx", "jax._src.deprecations", "omni_jax_plugin", "conversion_tools"])
def test_other_modules_deprecations_only_warn(module):
    with warnings.catch_warnings(record=True):  # the filters stay (pytest.warns would reset them)
        warnings.warn_explicit("old API", DeprecationWarning, "f.py", 1, module=module)  # raises where one matches


@pytest.mark.parametrize("module,fails", [("omni_jax.runtime.stage_loop", True), ("omni_jax.server", True),
                                          ("kernels_cpu", True), ("flax.nnx", False)])
def test_processes_a_test_starts_fail_too(module, fails):
    """Stage processes and servers do not read pytest's configuration: conftest names in
    PYTHONWARNINGS, which they inherit, each module pyproject's patterns match."""
    code = f"import warnings; warnings.warn_explicit('old API', DeprecationWarning, 'f.py', 1, module={module!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (run.returncode != 0) == fails and ("Traceback" in run.stderr) == fails, run.stderr
    assert "DeprecationWarning: old API" in run.stderr, run.stderr  # raised, or else shown
