#!/usr/bin/env bash
# Every GPU check in one run, for a device machine lent for a few minutes
# (CUDA toolkit and PyTorch, no TensorFlow). Each step has its own time limit,
# so one slow step cannot take the others' results with it.
#
#   OUT=results_folder bash benchmarks/gpu/device_checks.sh
#
# Steps, in order of importance (logs under $OUT, one line each in
# $OUT/summary.txt with the exit status and the seconds taken):
#   ef_check         the fused error-feedback op's kernels against a host
#                    reference, then its timings at n = 25M
#   selection_check  the selection kernels against torch.topk (--quick sizes)
#   selection_timing the selection's timing table (full: 30 runs a case)
#   ef_memcheck      the fused op's small cases under compute-sanitizer memcheck
#   ef_racecheck     the same under racecheck
set -u
export PATH="$PATH:/usr/local/cuda/bin"
out="${OUT:-gpu_results}"
mkdir -p "$out"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
python="$(command -v python3 || command -v python)"

step() {  # step NAME SECONDS COMMAND...: runs COMMAND into $out/NAME.log
  local name="$1" limit="$2" start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc in $(($(date +%s) - start)) s" | tee -a "$out/summary.txt"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2
  "$python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
} >"$out/device.txt" 2>&1
cat "$out/device.txt"
arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '.')"
flags=(-O3 -std=c++17 "-arch=sm_${arch:-90}" -DTF_TOPK_HARNESS_MAIN)
nvcc "${flags[@]}" benchmarks/gpu/harness.cu -o "$build/ef_check" &
nvcc "${flags[@]}" -lineinfo -DTF_TOPK_DEBUG_CHECKS=1 benchmarks/gpu/harness.cu \
  -o "$build/ef_check_debug" &
wait

step ef_check 120 "$build/ef_check"
step selection_check 160 "$python" benchmarks/gpu_check.py --quick --skip-timing \
  --json "$out/selection_check.json"
step selection_timing 100 "$python" benchmarks/gpu_check.py --skip-correctness \
  --json "$out/selection_timing.json"
step ef_memcheck 80 compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$build/ef_check_debug" --small
step ef_racecheck 80 compute-sanitizer --tool racecheck --error-exitcode 9 \
  "$build/ef_check_debug" --small
