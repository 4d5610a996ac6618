#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU and cupy already installed (cupy-cuda13x), no network,
# and none of hetps's own dependencies but numpy and scipy, one command
#
#     bash benchmarks/gpu_check.sh [--steps 100]
#
# 1. installs the wheels of the carried `.whl/` folder (benchmarks/make_gpu_wheels.sh builds it; see
#    benchmarks/README.md) into /tmp/site, without network or dependency resolution, and checks that
#    hetps imports; it never installs cupy;
# 2. checks the GPU: nvidia-smi lists one, and cupy computes on it;
# 3. runs the tests that need CUDA (tests/runtime/exec/test_gpu_cuda.py) with HETPS_REQUIRE_CUDA=1,
#    so they fail rather than skip when cupy cannot reach a device;
# 4. times the dense stage (the CTR MLP's forward + backward) on the GPU against one CPU core, at
#    batch 512, 4096 and 16384;
# 5. runs benchmarks/ctr.py with one real gpu trainer (cupy) fed by as many cpu trainers and shards
#    as the cores allow (benchmarks/gpu_layout.py: 16 cores -> 12 cpu trainers, 2 shards, 1 gpu
#    trainer) in async and sync mode at the same three batch sizes (fewer steps for the larger
#    ones), each bounded in time by what is left of the budget (BUDGET_S, 470 s); it prints the gpu
#    trainer's host <-> device crossings, graph replays and CPU ms per step (docs/gpu.md).
#
# Results go to $OUT (a device run's output folder) or else out/gpu_check/: one file per stage
# (*.txt: its output; dense_stage.json; cuda_tests.xml; layout.txt: stage 5's processes and runs).
# The whole check takes under 8 minutes: it says so, and fails, when it did not.
# Without a CUDA GPU it stops at stage 2 with exit status 2 and says so: it makes no GPU claim
# (stage 1 still runs, which is the dry run on a machine without one). PYTHON picks the interpreter;
# WHEELS the wheel folder (default .whl).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEPS=100
if [[ "${1:-}" == "--steps" && -n "${2:-}" ]]; then
    STEPS=$2
fi
BUDGET_S=${BUDGET_S:-470}  # the whole check, under 8 minutes; stage 5 fits what is left
RESULTS=${OUT:-$PWD/out/gpu_check}
mkdir -p "$RESULTS"
START=$SECONDS

fail() { echo "gpu_check: $*" | tee -a "$RESULTS/summary.txt" >&2; exit 2; }
stage() { echo "== $* ($((SECONDS - START)) s)" | tee -a "$RESULTS/summary.txt"; }

stage "1/5 hetps's dependencies from .whl/"
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHEELS"/*.whl \
        || fail "pip could not install the wheels of .whl/ (built for another Python? see benchmarks/README.md)"
    export PYTHONPATH="/tmp/site:$PWD"
else
    echo "no $WHEELS/ folder: using the packages this interpreter has"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" - <<'EOF' 2>&1 | tee "$RESULTS/imports.txt" || fail "hetps does not import (a wheel missing from .whl/?); nothing was checked"
import sys

import msgspec, pytest, pytest_timeout, threadpoolctl, zmq  # noqa: F401
import runtime, transpiler  # noqa: F401
from runtime.engines import LocalEngine  # noqa: F401

print(f"python {sys.version.split()[0]}; hetps imports from {runtime.__file__}")
EOF

stage "2/5 the GPU"
command -v nvidia-smi >/dev/null 2>&1 || fail "no nvidia-smi: this machine has no NVIDIA driver; no GPU was checked"
nvidia-smi -L 2>/dev/null | grep -q . || fail "nvidia-smi lists no GPU; no GPU was checked"
nvidia-smi -L | tee "$RESULTS/gpu.txt"
"$PY" - <<'EOF' 2>&1 | tee -a "$RESULTS/gpu.txt" || fail "cupy is missing or cannot use a CUDA device (driver / CUDA runtime?); no GPU was checked"
import os

import cupy

n = cupy.cuda.runtime.getDeviceCount()
props = cupy.cuda.runtime.getDeviceProperties(0)
x = cupy.arange(10, dtype=cupy.float32)
assert float((x * 2).sum()) == 90.0
print(f"cupy {cupy.__version__}: {n} device(s); device 0: {props['name'].decode()}, "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}; CUPY_TF32={os.environ.get('CUPY_TF32', '')!r} "
      "(unset or 0: float32 GEMMs without TF32, docs/gpu.md)")
EOF

status=0
stage "3/5 the tests that need CUDA"
HETPS_REQUIRE_CUDA=1 timeout 150 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$RESULTS/cuda_tests.xml" \
    tests/runtime/exec/test_gpu_cuda.py 2>&1 | tee "$RESULTS/cuda_tests.txt" || status=1

stage "4/5 the dense stage: GPU against one CPU core"
timeout 60 "$PY" - "$RESULTS/dense_stage.json" <<'EOF' 2>&1 | tee "$RESULTS/dense_stage.txt" || status=1
import json
import sys

sys.path.insert(0, "benchmarks")
import ctr

got = {}
for batch in (512, 4096, 16384):
    ms = got[batch] = ctr.dense_stage_ms(repeats=20 if batch < 16384 else 5, batch=batch)
    print(f"batch {batch:>5}: cpu {ms['cpu']:9.2f} CPU ms per step (1 BLAS thread), gpu {ms['gpu']:7.3f} ms "
          f"per step: {ms['cpu'] / ms['gpu']:.1f}x")
json.dump(got, open(sys.argv[1], "w"), indent=1)
EOF

stage "5/5 benchmarks/ctr.py with a real gpu trainer, async and sync"
# trainers and shards from the cores, the batch matrix within the budget left (benchmarks/gpu_layout.py)
eval "$("$PY" benchmarks/gpu_layout.py --nproc "$(nproc)" --left $((BUDGET_S - (SECONDS - START) - 15)) \
    --steps "$STEPS")"
echo "$(nproc) cores: $CPU_TRAINERS cpu trainers, $SHARDS shards, $GPU_TRAINERS gpu trainer(s); runs" \
    "(batch:steps:warm-up:limit s) $RUNS${DROPPED:+; dropped for want of time: batch $DROPPED}" \
    | tee "$RESULTS/layout.txt" | tee -a "$RESULTS/summary.txt"
[[ -z "$DROPPED" ]] || status=1
for spec in $RUNS; do
    IFS=: read -r batch steps warmup limit <<<"$spec"
    echo "-- batch $batch: $warmup warm-up + $steps timed steps (at most $limit s)"
    timeout "$limit" "$PY" benchmarks/ctr.py --skip-paddle --modes async,sync --batch "$batch" \
        --trainers "cpu=$CPU_TRAINERS,gpu=$GPU_TRAINERS" --servers "$SHARDS" \
        --steps "$steps" --warmup "$warmup" 2>&1 | tee "$RESULTS/ctr_batch$batch.txt" || status=1
done

took=$((SECONDS - START))
if ((took > BUDGET_S)); then
    echo "gpu_check: took $took s, over its budget of $BUDGET_S s" | tee -a "$RESULTS/summary.txt"
    status=1
fi
stage "done in $took s (budget $BUDGET_S s): exit status $status"
exit $status
