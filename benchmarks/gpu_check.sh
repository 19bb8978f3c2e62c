#!/usr/bin/env bash
# What to run whenever a GPU is lent, in one command: no network, no pretrained weights, about 8 minutes on one H100.
#
#   bash benchmarks/gpu_check.sh                  # on a CUDA machine; writes benchmarks/results/gpu_check.md
#   bash benchmarks/gpu_check.sh --device cpu     # the same steps at tiny sizes, on a CPU (what the test suite runs)
#
# Steps, each recorded in the one results file with its command and exit status (a failing step does not stop the
# others; the script exits non-zero if any failed):
#   1. tests/test_cuda.py (skipped as a whole without CUDA);
#   2. the MX kernels against torchao (bench_formats.py);
#   3. the calibration cost (bench_calibration_cost.py: a step of the default method, with and without activation
#      checkpointing, and of the paper's, against an unquantized step; peak memory of each) of randomly
#      initialised bfloat16 models of Llama-3.2-1B and Llama-3.1-8B shapes, one sequence per step.
set -uo pipefail

device=cuda
output=benchmarks/results/gpu_check.md
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --output) output=$2; shift 2 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--device cuda|cpu] [--output FILE]" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
python=${PYTHON:-python}
if [[ $device == cpu ]]; then
  size=256 repeats=1 shapes=("tiny:32")
else
  size=4096 repeats=5 shapes=("llama-3.2-1b:2048" "llama-3.1-8b:1024")  # shape:tokens per step
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0

# step TITLE RESULT_FILE COMMAND...: runs COMMAND, appends its title, command, status and RESULT_FILE (the
# output's tail where it wrote none, or failed) to the report.
step() {
  local title=$1 result=$2
  shift 2
  echo "== $title" >&2
  local start=$SECONDS
  "$@" >"$work/log" 2>&1
  local status=$?
  {
    echo
    echo "## $title"
    echo
    echo "\`$*\`: exit status $status, $((SECONDS - start)) s"
    echo
    if [[ $status -eq 0 && -n $result && -s $result ]]; then
      sed -e '1,/^Command: /d' -e 's/^## /### /' "$result"  # its own title and command go, its sections nest
    else
      echo '```'
      tail -n 15 "$work/log"
      echo '```'
    fi
  } >>"$work/report.md"
  [[ $status -eq 0 ]] || failed=1
}

{
  echo "# GPU check"
  echo
  echo "\`bash benchmarks/gpu_check.sh --device $device\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
    "$(date -u +%Y-%m-%d)."
} >"$work/report.md"

step "tests/test_cuda.py" "" "$python" -m pytest -q -p no:cacheprovider -n 0 -W ignore tests/test_cuda.py
step "MX kernels" "$work/formats.md" \
  "$python" benchmarks/bench_formats.py --device "$device" --size "$size" --repeats "$repeats" --output "$work/formats.md"
for entry in "${shapes[@]}"; do
  shape=${entry%%:*} tokens=${entry##*:}
  step "Calibration cost, $shape" "$work/cost-$shape.md" \
    "$python" benchmarks/bench_calibration_cost.py --shape "$shape" --dtype bfloat16 --device "$device" \
    --batch-sizes 1 --seq-len "$tokens" --steps 4 --repeats 1 --no-run --memory --output "$work/cost-$shape.md"
done

mkdir -p "$(dirname "$output")"
cp "$work/report.md" "$output"
cat "$output"
exit $failed
