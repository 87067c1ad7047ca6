#!/usr/bin/env bash
# The checkpoint path's checks for one GPU machine, in one run of about 8 minutes:
#   1. tests/gpu (marker cuda): the staging ring, pinned buffers and snapshots on a CUDA device,
#      helper threads on the tensors' device;
#   2. benchmarks/gpu_d2h.py: a JIT save (real SIGTERM through our Trainer) of a 1.5B-parameter
#      bf16 model from CUDA with its bytes, seconds and GB/s; device-to-host GB/s of the staging
#      ring against a plain .to("cpu", non_blocking=True) into pinned memory; the pinned host
#      memory a background snapshot holds before / during / after its write;
#   2b. the save_async stall per GiB in each pinned staging mode (pinned at the save, kept,
#      pinned ahead), through the real code path, beside a blocking save of the same 4 GiB;
#   3. benchmarks/jit_scaling.py --ranks 1 --device cuda (skipped, with a message, where the
#      file is not there);
#   4. the same JIT save at 7B parameters (42 GB written), where the disk and the time allow.
# Without CUDA it runs green: step 1 skips, step 2 is a CPU smoke run of the same harness at
# small sizes, step 3 is skipped.
#
#   bash benchmarks/gpu_check.sh            (from the repository root or anywhere)
#
# The project runs from this source tree (PYTHONPATH), not from an install. A bare GPU machine
# (Python 3.12) lacks pydantic and what it needs: carry them as wheels in .whl/ (ignored by
# git); where the interpreter cannot import pydantic, the wheels are installed into /tmp/site
# first. To fetch them, on a machine with pip and an index (from the repository root):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 typing-extensions==4.16.0
# Output is also written to $OUT/gpu_check.log when $OUT is set.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
  exec > >(tee "${OUT}/gpu_check.log") 2>&1
fi

# The interpreter: $PYTHON, else this checkout's venv, else python3 (the GPU machine's).
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY=python3
fi

SITE=""
if ! "$PY" -P -c 'import pydantic' 2> /dev/null && compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  echo "==> installing the carried wheels from .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$ROOT"/.whl/*.whl || exit 1
  SITE=/tmp/site
fi
# Only our import package goes on the path: the checkout root holds operator/, which would
# shadow the standard library's `operator` module (every python here runs with -P as well).
SRC="$(mktemp -d /tmp/gpu-check-src.XXXXXX)"
ln -s "$ROOT/trainer_runtime" "$SRC/trainer_runtime"
export PYTHONPATH="$SRC${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

started=$(date +%s)
failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, record a failure
  local name=$1 limit=$2
  shift 2
  local t0
  t0=$(date +%s)
  echo
  echo "==> [$name] $* (limit ${limit} s)"
  timeout --signal=TERM --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "==> [$name] exit $rc after $(($(date +%s) - t0)) s"
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

"$PY" -P - <<'PY'
import sys, torch
cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA available: {cuda}"
      + (f", {torch.cuda.get_device_name()}" if cuda else ""))
PY
CUDA=$("$PY" -P -c 'import torch; print(int(torch.cuda.is_available()))')
if ! "$PY" -P -c 'import trainer_runtime.trainer' 2> /tmp/gpu-check-import.err; then
  echo "note: the Trainer cannot be imported here ($(tail -1 /tmp/gpu-check-import.err));"
  echo "      carry the missing packages as wheels in .whl/ (see the top of this script)."
  echo "      The JIT save is then measured through CheckpointWriter."
fi

# 1. tests/gpu (no conftest: the cluster fixtures of tests/conftest.py need packages a GPU
#    machine lacks; these tests need none of them)
step tests-gpu 100 "$PY" -P -m pytest -q -p no:cacheprovider --noconftest tests/gpu

# 2. the JIT save, device-to-host bandwidth, snapshot memory
if [ "$CUDA" = 1 ]; then
  step gpu-d2h 240 "$PY" -P benchmarks/gpu_d2h.py --device cuda
else
  echo
  echo "==> no CUDA: gpu_d2h.py runs as a CPU smoke run (small sizes, not GPU figures)"
  step gpu-d2h-cpu-smoke 240 "$PY" -P benchmarks/gpu_d2h.py --device cpu
fi

# 2b. the save_async stall per GiB: pinned at the save vs kept vs pinned ahead
if [ "$CUDA" = 1 ]; then
  step stall 150 "$PY" -P benchmarks/gpu_d2h.py --device cuda --only stall
else
  step stall-cpu-smoke 120 "$PY" -P benchmarks/gpu_d2h.py --device cpu --only stall
fi

# 3. the JIT scaling benchmark on one rank
if [ ! -f benchmarks/jit_scaling.py ]; then
  echo
  echo "==> [jit-scaling] skipped: benchmarks/jit_scaling.py is not in this checkout yet"
elif [ "$CUDA" != 1 ]; then
  echo
  echo "==> [jit-scaling] skipped: --device cuda needs CUDA"
else
  step jit-scaling 120 "$PY" -P benchmarks/jit_scaling.py --ranks 1 --device cuda
fi

# 4. a JIT save at 7B (the size docs/checkpoints.md projects): 6 bytes a parameter on disk (bf16
#    weights and AdamW's two bf16 moments, 42 GB), only where the disk has room for it and the
#    run has time left (GPU_CHECK_BUDGET seconds in all, 480 by default)
budget=${GPU_CHECK_BUDGET:-480}
left=$((budget - ($(date +%s) - started)))
free_gb=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "$CUDA" != 1 ]; then
  echo
  echo "==> [jit-7b] skipped: needs CUDA"
elif [ "${free_gb:-0}" -lt 50 ]; then
  echo
  echo "==> [jit-7b] skipped: ${free_gb} GB free under ${TMPDIR:-/tmp}, a 7B save needs 42 GB"
elif [ "$left" -lt 90 ]; then
  echo
  echo "==> [jit-7b] skipped: ${left} s left of the ${budget} s budget"
else
  step jit-7b $((left < 200 ? left : 200)) "$PY" -P benchmarks/gpu_d2h.py --device cuda --only jit --params 7B
fi

# 5. issue 38 item 5 on a GPU node's own disk and cores: our save against a raw O_DIRECT write,
#    our cold resume against transformers' (the resume faults the optimizer buffer in on a
#    helper thread where 2+ CPUs exist: on a 16-core node it has a core to itself, on the 2-core
#    VM it competes), with the tunings off and on; needs transformers in the interpreter
left=$((budget - ($(date +%s) - started)))
if ! "$PY" -P -c "import transformers" 2>/dev/null; then
  echo
  echo "==> [checkpoint-io] skipped: transformers is not installed for $PY"
elif [ "$left" -lt 120 ]; then
  echo
  echo "==> [checkpoint-io] skipped: ${left} s left of the ${budget} s budget"
else
  step checkpoint-io $((left < 240 ? left : 240)) "$PY" -P benchmarks/checkpoint_io.py --params 100M --repeats 3 --io-only --tunings both
fi

rm -rf "$SRC"
echo
echo "==> gpu_check: $(($(date +%s) - started)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  echo "==> FAILED: ${failed[*]}"
  exit 1
fi
echo "==> OK"
