#!/usr/bin/env bash
# What a lent CUDA machine runs (the `device` tool's `run`, from the repo root, with `.whl` carried):
# graphbuf's CUDA tests, bench/bench_cuda.py, and both drills on cuda; `tools/device_check.sh STAGE...` runs
# only the stages named (pytest bench_cuda drill drill_staged model_drill). Not part of CI. Each stage has its
# own time limit and writes one log under $OUT; a failing stage does not stop the next. bench/bench_steps.py
# is not a stage: it times host work against vLLM's CPU build, which a device machine (offline) cannot
# install and whose figures are the host's; run it where the other cpu benchmarks run.
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/graphbuf-device}
mkdir -p "$OUT"
log=$OUT/env.log
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || {
    echo "editable install failed: in-place build, adapter linked"
    python3 setup.py -q build_ext --inplace
    ln -sfn ../../adapters/vllm_ascend graphbuf/adapters/vllm_ascend
    export PYTHONPATH=/tmp/site:$PWD
  }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, transformers, graphbuf.buffers.native as n; print(sys.version.split()[0], \
torch.__version__, torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__, \
'native kernel', n.KERNEL is not None)"
} > "$log" 2>&1

stage() {  # stage NAME LIMIT CMD...: run CMD under LIMIT seconds into $OUT/NAME.log, then its status and time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "stage $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/$name.log" >> "$log"
}

run_stage() {
  case $1 in
    pytest) stage pytest 150 python3 -m pytest -q -m cuda -rs -p no:cacheprovider --continue-on-collection-errors \
      -n 8 tests ;;
    bench_cuda) stage bench_cuda 170 python3 bench/bench_cuda.py --quick --json "$OUT/bench_cuda.json" ;;
    drill) stage drill 90 python3 -m graphbuf drill gemma4-31b-it-mtp --device cuda ;;
    drill_staged) stage drill_staged 50 python3 -m graphbuf drill gemma4-31b-it-mtp --device cuda --staged \
      --replays 20 ;;
    model_drill) stage model_drill 80 python3 -m graphbuf drill gemma4-31b-it-mtp --model tiny --device cuda ;;
    *) echo "unknown stage $1" >> "$log" ;;
  esac
}
for s in "${@:-pytest bench_cuda drill drill_staged model_drill}"; do
  for one in $s; do run_stage "$one"; done
done
cat "$log"
