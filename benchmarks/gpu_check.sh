#!/usr/bin/env bash
# The GPU check (issue 18): on a machine with a CUDA 12 GPU, one command
#
#     bash benchmarks/gpu_check.sh [--steps 200]
#
# 1. installs cupy-cuda12x (hetps[gpu]) into the current Python environment;
# 2. runs the tests that need CUDA (tests/test_gpu_cuda.py) with HETPS_REQUIRE_CUDA=1, so they fail
#    rather than skip when cupy cannot reach a device;
# 3. runs benchmarks/ctr.py with a real gpu trainer (cupy) in async and sync mode, which prints the
#    dense stage's time per step on the GPU against the CPU's (one BLAS thread), the run's examples/s,
#    and its prediction for a 16-core host from the dense stage measured on this GPU.
#
# Without a CUDA GPU it stops at once with exit status 2 and says so: it makes no GPU claim.
# Run from anywhere; it works in the repository it belongs to. PYTHON picks the interpreter.
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STEPS=200
if [[ "${1:-}" == "--steps" && -n "${2:-}" ]]; then
    STEPS=$2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

fail() { echo "gpu_check: $*" >&2; exit 2; }

echo "== 1/4 the GPU"
command -v nvidia-smi >/dev/null 2>&1 || fail "no nvidia-smi: this machine has no NVIDIA driver; nothing was checked"
nvidia-smi -L 2>/dev/null | grep -q . || fail "nvidia-smi lists no GPU; nothing was checked"
nvidia-smi -L

echo "== 2/4 installing cupy-cuda12x"
"$PY" -m pip install --quiet "cupy-cuda12x>=13" || fail "pip could not install cupy-cuda12x"
"$PY" - <<'EOF' || fail "cupy is installed but cannot use a CUDA device (driver / CUDA 12 runtime?); nothing was checked"
import cupy
n = cupy.cuda.runtime.getDeviceCount()
props = cupy.cuda.runtime.getDeviceProperties(0)
x = cupy.arange(10, dtype=cupy.float32)
assert float((x * 2).sum()) == 90.0
print(f"cupy {cupy.__version__}: {n} device(s); device 0: {props['name'].decode()}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}")
EOF

echo "== 3/4 the tests that need CUDA"
HETPS_REQUIRE_CUDA=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_cuda.py

echo "== 4/4 benchmarks/ctr.py with a real gpu trainer"
"$PY" benchmarks/ctr.py --skip-paddle --modes async,sync --steps "$STEPS"
