#!/usr/bin/env bash
# The one-command GPU check, from the repo root (README "GPU check"):
#   bash benchmarks/gpu/check.sh            # on the GPU machine, benchmarks/gpu/wheels carried
#   bash benchmarks/gpu/check.sh --cpu      # tiny models, interpret-mode kernels, on any CPU
# Installs the carried wheels (wheels.sh) offline into a fresh folder, puts it and the repo root
# first on PYTHONPATH (OmniJax is not pip-installed there), then runs check.py with the rest of
# the arguments. PYTHON picks the interpreter (default python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
wheels="$root/benchmarks/gpu/wheels"
site=""
if ls "$wheels"/*.whl >/dev/null 2>&1; then
    if "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        site="$(mktemp -d "${TMPDIR:-/tmp}/omni-jax-wheels-XXXXXX")"
        # --no-deps --no-index: exactly the pinned set, nothing fetched, the environment untouched.
        "$py" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --target "$site" "$wheels"/*.whl
        echo "[check.sh] installed $(ls "$wheels"/*.whl | wc -l) wheels into $site"
    else
        echo "[check.sh] the wheels are for Python 3.12; $("$py" -V 2>&1) uses its own packages"
    fi
else
    echo "[check.sh] no wheels in $wheels (bash benchmarks/gpu/wheels.sh builds them); using installed packages"
fi
export OMNI_JAX_CHECK_SITE="$site"
export PYTHONPATH="${site:+$site:}$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
rc=0
"$py" "$root/benchmarks/gpu/check.py" "$@" || rc=$?
[ -n "$site" ] && rm -rf "$site"
exit $rc
