#!/usr/bin/env bash
# What to run whenever a GPU is lent, in one command: no network, no pretrained weights.
#
#   bash benchmarks/gpu_check.sh                  # on a CUDA machine; writes benchmarks/results/gpu_check.md
#   bash benchmarks/gpu_check.sh --only llama-3.1-8b --output more.md   # only some steps (resume a cut-off run)
#   bash benchmarks/gpu_check.sh --device cpu     # the same steps at tiny sizes, on a CPU (what the test suite runs)
#   bash benchmarks/gpu_check.sh --logs logs/     # also keep each step's whole output, as logs/STEP.log
#
# Steps, each recorded in the one results file with its command and exit status as soon as it ends (a failing step
# does not stop the others, a run cut off keeps the steps it finished; the script exits non-zero if any failed):
#   tests         tests/test_cuda.py (skipped as a whole without CUDA): one summary line per failure in the report,
#                 each failure's short traceback in its log;
#   kernels       the MX kernels against torchao (bench_formats.py);
#   <shape>       the calibration cost (bench_calibration_cost.py: a step of the default method, with and without
#                 activation checkpointing, and of the paper's, against an unquantized step) of a randomly
#                 initialised bfloat16 model of that shape, one sequence per step: llama-3.2-1b (2048 tokens) and
#                 llama-3.1-8b (1024 tokens, with the peak memory of each workload; the offloaded one is left out
#                 for time: saving and reloading 16 GB, see bench_calibration_cost.py --memory-workloads).
# Measured on an H200 (2026-11-28, pytest on four workers): tests 117 s, kernels 43 s, llama-3.2-1b 83 s,
# llama-3.1-8b 206 s with its memory table: 449 s in all, inside the 8 minutes a lent device's check should take.
# Needs the package installed (the model cards are package data): the script checks that first.
set -uo pipefail

device=cuda
output=benchmarks/results/gpu_check.md
only=""
logs=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --output) output=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --logs) logs=$2; shift 2 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--device cuda|cpu] [--output FILE] [--only STEP,...] [--logs DIR]" >&2
       exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
python=${PYTHON:-python}
if [[ $device == cpu ]]; then
  size=256 repeats=1 shapes=("tiny:32:memory") test_workers=0
else
  # the CUDA tests are mostly compilation, on the host's cores: four pytest workers
  size=4096 repeats=5 shapes=("llama-3.2-1b:2048:" "llama-3.1-8b:1024:memory") test_workers=4  # shape:tokens:memory?
fi
[[ $device == cuda* ]] || test_workers=0  # no CUDA: every CUDA test skips, and starting workers is the step's cost
steps=("tests" "kernels")
for entry in "${shapes[@]}"; do steps+=("${entry%%:*}"); done
for name in ${only//,/ }; do
  if [[ " ${steps[*]} " != *" $name "* ]]; then
    echo "gpu_check.sh: --only names an unknown step '$name'; the steps on $device are: ${steps[*]}" >&2
    exit 2
  fi
done
# An uninstalled checkout lacks the package-data mapping of optimum_dmx.model_cards, which saving a model needs: say so
# now rather than as a failed test after minutes of device time.
if ! "$python" -c "import optimum_dmx.model_cards" 2>/dev/null; then
  echo "gpu_check.sh: '$python' cannot import optimum_dmx.model_cards: install the package (pip install --no-deps ." \
    "or --target DIR on PYTHONPATH), or link optimum_dmx/model_cards to ../model_cards in this checkout" >&2
  exit 2
fi
# wanted NAME: whether step NAME runs (every step, unless --only names some)
wanted() { [[ -z $only || ",$only," == *",$1,"* ]]; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0

# step NAME TITLE RESULT_FILE COMMAND...: runs COMMAND, appends its title, command, status and RESULT_FILE (the
# output's tail where it wrote none, or failed) to the report, and keeps its whole output as NAME.log under --logs.
step() {
  local name=$1 title=$2 result=$3
  shift 3
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
      tail -n 25 "$work/log"
      echo '```'
    fi
  } >>"$work/report.md"
  [[ $status -eq 0 ]] || failed=1
  [[ -z $logs ]] || cp "$work/log" "$logs/$name.log"
  cp "$work/report.md" "$output"  # after every step, so a run cut short still leaves what it measured
}

{
  echo "# GPU check"
  echo
  echo "\`bash benchmarks/gpu_check.sh --device $device\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
    "$(date -u +%Y-%m-%d)."
} >"$work/report.md"
mkdir -p "$(dirname "$output")" ${logs:+"$logs"}

# captured output off (compilation logs at DEBUG drown the failures): short tracebacks, then a line per failure
wanted tests && step tests "tests/test_cuda.py" "" \
  "$python" -m pytest -q -p no:cacheprovider -p no:logging -n "$test_workers" -W ignore --tb=short --show-capture=no -rfE \
  tests/test_cuda.py
wanted kernels && step kernels "MX kernels" "$work/formats.md" \
  "$python" benchmarks/bench_formats.py --device "$device" --size "$size" --repeats "$repeats" --output "$work/formats.md"
for entry in "${shapes[@]}"; do
  IFS=: read -r shape tokens memory <<<"$entry"
  wanted "$shape" || continue
  step "$shape" "Calibration cost, $shape" "$work/cost-$shape.md" \
    "$python" benchmarks/bench_calibration_cost.py --shape "$shape" --dtype bfloat16 --device "$device" \
    --batch-sizes 1 --seq-len "$tokens" --steps 4 --repeats 1 --no-run ${memory:+--memory} \
    --memory-workloads "unquantized,dMX,dMX checkpointed" --output "$work/cost-$shape.md"
done

cat "$output"
exit $failed
