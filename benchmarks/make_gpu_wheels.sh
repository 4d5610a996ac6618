#!/usr/bin/env bash
# Builds the `.whl/` folder that benchmarks/gpu_check.sh installs on the GPU machine, which has no
# network, Python 3.12, numpy, scipy and cupy-cuda13x, and none of hetps's other dependencies:
#
#     bash benchmarks/make_gpu_wheels.sh [DEST]        # DEST: default .whl (git-ignored)
#
# Only what the check's code path imports: `import runtime, transpiler` and `transpile` (pyzmq,
# msgspec, cryptography, threadpoolctl, networkx for placement, onnx with protobuf, ml_dtypes and
# typing_extensions, rocksdict for the tiered sparse tables, which `runtime.ps` imports) and pytest
# with pytest-timeout (pytest.ini's --timeout) for the CUDA tests.
# Left out: numba with llvmlite (63 MiB; ops_registry/compiled.py's kernels for large numpy arrays,
# which fall back to plain numpy without it: the same results, slower), pyarrow, tqdm, matplotlib,
# tensorboardX, pygraphviz, PyYAML, ray (nothing on the check's path imports them).
# The versions are the ones this repository is tested with; the folder stays under 64 MiB (~23).
# PYTHON_VERSION overrides the target Python (e.g. PYTHON_VERSION=3.11 for a dry run on 3.11).
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYV=${PYTHON_VERSION:-3.12}
PKGS=(
    pyzmq==27.3.0
    msgspec==0.23.0
    cryptography==48.0.0
    cffi==2.0.0
    pycparser==3.0
    threadpoolctl==3.8.0
    networkx==3.6.1
    onnx==1.23.2
    protobuf==7.36.2
    ml_dtypes==0.7.0
    typing_extensions==4.16.0
    pytest==9.0.3
    pytest-timeout==2.4.0
    pluggy==1.6.0
    iniconfig==2.3.0
    packaging==26.4
    Pygments==2.20.0
    rocksdict==0.3.29
)
mkdir -p "$DEST"
for p in "${PKGS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$p"
done
du -sh "$DEST"
size=$(du -sm "$DEST" | cut -f1)
if (( size >= 64 )); then
    echo "make_gpu_wheels: $DEST is ${size} MiB, over the 64 MiB a device run carries" >&2
    exit 1
fi
