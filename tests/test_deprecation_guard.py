"""pyproject's filterwarnings: a deprecation raised at a call in OmniJax's own packages fails the
test that makes the call; one a library raises inside itself does not."""

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
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", UserWarning)  # the filters above stay
        warnings.warn_explicit("old API", DeprecationWarning, "f.py", 1, module=module)
    assert [str(w.message) for w in seen] == ["old API"]
