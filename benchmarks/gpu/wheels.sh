#!/usr/bin/env bash
# Download the wheels the GPU check needs on the GPU machine (Python 3.12, manylinux x86_64,
# nothing downloadable there) into benchmarks/gpu/wheels/ (git-ignored), pinned by
# requirements.txt beside this script; then carry that folder to the machine (README "GPU check").
#   bash benchmarks/gpu/wheels.sh [PYTHON]      # PYTHON: any Python with pip (default python3)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${1:-python3}"
dest="$here/wheels"
limit_mib=40
rm -rf "$dest"
mkdir -p "$dest"
# pip matches each manylinux tag exactly: list the ones these wheels are published under.
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" -r "$here/requirements.txt"
want=$(grep -cE '^[A-Za-z]' "$here/requirements.txt")
got=$(ls "$dest"/*.whl | wc -l)
if [ "$got" -ne "$want" ]; then
    echo "wheels.sh: $got wheels for $want pinned packages in $dest" >&2
    exit 1
fi
kib=$(du -sk "$dest" | cut -f1)
echo "wheels.sh: $got wheels, $((kib / 1024)) MiB ($kib KiB) in $dest"
if [ "$kib" -gt $((limit_mib * 1024)) ]; then
    echo "wheels.sh: over the $limit_mib MiB budget" >&2
    exit 1
fi
