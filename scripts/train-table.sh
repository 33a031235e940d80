#!/usr/bin/env bash
# The training demo's table (scripts/train.sh --table runs this after building `train`): every
# strategy of STRATEGIES below x every model, one scripts/train.sh run each at one global batch,
# then a markdown table "strategy | model | test accuracy | samples/s" with the date and the
# machine, for examples/train/README.md.
#
#   scripts/train-table.sh [--epochs E] [--global-batch G] [--models "mlp cnn"] [ARGS...]
#
# Defaults: 5 epochs, global batch 64 (train's default), both models; ARGS go to every run. Each
# run's own output goes to stderr; the table to stdout. A strategy is one line of STRATEGIES: a
# label, a '|', and the scripts/train.sh arguments that run it. Exit status: 0 when every run
# succeeded, 1 when one failed (its row says so), 2 on a bad command line.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

STRATEGIES=(
  "default|--strategy default"
  "one_device|--strategy one_device"
  "mirrored, 2 replicas|--strategy mirrored --replicas 2"
  "central_storage, 2 replicas|--strategy central_storage --replicas 2"
  "multi_worker, 2 workers|--workers 2"
  "parameter_server, 2 workers, 2 ps|--strategy parameter_server --workers 2 --ps 2"
)

epochs=5
global_batch=64
models="mlp cnn"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --epochs | --global-batch | --models)
      if [[ $# -lt 2 ]]; then
        echo "train-table.sh: $1 needs a value" >&2
        exit 2
      fi
      case "$1" in
        --epochs) epochs=$2 ;;
        --global-batch) global_batch=$2 ;;
        --models) models=$2 ;;
      esac
      shift 2
      ;;
    *)
      args+=("$1")
      shift
      ;;
  esac
done

# The runs are scripts/train.sh's own (built once by the caller): one child at a time, stopped
# with this script on INT or TERM (train.sh passes the TERM on to its train processes), which
# also removes the run's output file.
child=""
output=""
stop() {
  if [[ -n ${child} ]]; then kill -TERM "${child}" 2>/dev/null; fi
  if [[ -n ${output} ]]; then rm -f "${output}"; fi
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM

rows=()
status=0
for model in ${models}; do
  for entry in "${STRATEGIES[@]}"; do
    label=${entry%%|*}
    read -r -a strategy_args <<<"${entry#*|}"
    echo "== ${label}, ${model} ==" >&2
    output=$(mktemp)
    TRAIN_NO_BUILD=1 bash "${ROOT}/scripts/train.sh" "${strategy_args[@]}" --model "${model}" \
      --epochs "${epochs}" --global-batch "${global_batch}" --quiet-progress "${args[@]}" \
      >"${output}" 2>&1 &
    child=$!
    rc=0
    wait "${child}" || rc=$?
    child=""
    cat "${output}" >&2
    accuracy=$(sed -n 's/^test loss: [0-9.]* - test accuracy: \([0-9.]*\) .*/\1/p' "${output}")
    rate=$(sed -n 's/^throughput: \([0-9.]*\) samples\/s.*/\1/p' "${output}" | tail -1)
    rm -f "${output}"
    output=""
    if [[ ${rc} -ne 0 || -z ${accuracy} ]]; then
      rows+=("| ${label} | ${model} | failed (exit ${rc}) | |")
      status=1
    else
      rows+=("| ${label} | ${model} | ${accuracy} | ${rate} |")
    fi
  done
done

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
echo
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores (${cpu:-unknown CPU}), load average" \
  "$(cut -d' ' -f1-3 /proc/loadavg) at the end; ${epochs} epochs, global batch ${global_batch}," \
  "one run each:"
echo
echo "| strategy | model | test accuracy | samples/s |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit ${status}
