#!/usr/bin/env bash
# ctest train_sh_evaluator: `scripts/train.sh --workers 2 --evaluator` in a short form (2 epochs
# of 16 steps, a checkpoint every 4 steps). Passes when the script exits 0 and:
#   - the evaluator's log has one record per line it printed, at least 2, steps increasing;
#   - every record's step is the one its state implies (epoch * 16 + epoch_step): the evaluator
#     read the checkpoint it names, whole;
#   - exactly one record is final, the last one, at step 32 (after epoch 2), and the evaluator
#     says it stopped there;
#   - the final record's accuracy is the test accuracy the training itself reports (the same
#     weights and test set, evaluated by the two workers in their own processes);
#   - `train` with TF_CONFIG's "evaluator" task, on the kept export folder, evaluates the final
#     checkpoint once to the same accuracy and stops;
#   - scripts/plot-evaluations.py draws the log to a PNG (skipped without matplotlib).
#
#   evaluator_test.sh BUILD_DIR
set -u
build_dir=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}

output=$(cd "${tmp}" && TMPDIR=${tmp} TRAIN_NO_BUILD=1 COLLECTIVES_BUILD_DIR=${build_dir} \
  TRAIN_TIME_LIMIT=60 "${root}/scripts/train.sh" --workers 2 --evaluator --epochs 2 \
  --train-limit 2048 --test-limit 1000 --global-batch 128 --export-every-steps 4 \
  --quiet-progress --eval-log "${tmp}/evaluations.jsonl" --export-checkpoints "${tmp}/export" 2>&1)
rc=$?
printf '%s\n' "${output}"
[[ ${rc} == 0 ]] || fail "train.sh exit status ${rc}"

printed=$(grep -c '^evaluator: step ' <<<"${output}")
grep -q '^evaluator: done: the final checkpoint was evaluated' <<<"${output}" ||
  fail "the evaluator did not stop at the final checkpoint"
test_accuracy=$(sed -n 's/^test loss: [0-9.]* - test accuracy: \([0-9.]*\) .*/\1/p' <<<"${output}")
[[ -n ${test_accuracy} ]] || fail "no test accuracy from the training"

"${python}" - "${tmp}/evaluations.jsonl" "${printed}" "${test_accuracy}" <<'PY' || exit 1
import json, sys
path, printed, test_accuracy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
records = [json.loads(line) for line in open(path) if line.strip()]
def fail(why):
    print("FAIL:", why)
    sys.exit(1)
if len(records) != printed:
    fail(f"{len(records)} records in the log, {printed} lines printed")
if len(records) < 2:
    fail(f"only {len(records)} evaluations")
steps = [r["step"] for r in records]
if steps != sorted(set(steps)):
    fail(f"steps not increasing: {steps}")
for r in records:
    if r["step"] != r["epoch"] * 16 + r["epoch_step"] or r["step"] % 4:
        fail(f"record {r} names a step its state does not imply")
finals = [i for i, r in enumerate(records) if r["final"]]
if finals != [len(records) - 1]:
    fail(f"final records at {finals}, expected only the last")
last = records[-1]
if (last["step"], last["epoch"], last["epoch_step"]) != (32, 2, 0):
    fail(f"the final record is {last}, expected step 32 after epoch 2")
if f"{last['metrics']['accuracy']:.4f}" != test_accuracy:
    fail(f"final accuracy {last['metrics']['accuracy']} differs from the training's {test_accuracy}")
print(f"ok: {len(records)} records, steps {steps}, final accuracy {test_accuracy}")
PY

# TF_CONFIG's evaluator task runs the evaluator without --evaluator: on the kept export folder it
# evaluates the final checkpoint once, to the same accuracy, and stops.
tf_config='{"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
  "evaluator": ["127.0.0.1:3"]}, "task": {"type": "evaluator", "index": 0}}'
again=$(TF_CONFIG=${tf_config} timeout 60 "${build_dir}/examples/train/train" \
  --export-checkpoints "${tmp}/export" --eval-log "${tmp}/again.jsonl" --test-limit 1000 2>&1)
rc=$?
printf '%s\n' "${again}"
[[ ${rc} == 0 ]] || fail "the TF_CONFIG evaluator's exit status is ${rc}"
[[ $(grep -c '^evaluator: step 32 (after epoch 2, final) .* accuracy: '"${test_accuracy}"' ' \
  <<<"${again}") == 1 && $(wc -l <"${tmp}/again.jsonl") == 1 ]] ||
  fail "the TF_CONFIG evaluator did not evaluate the final checkpoint once"

if "${python}" -c 'import matplotlib' 2>/dev/null; then
  "${python}" "${root}/scripts/plot-evaluations.py" "${tmp}/evaluations.jsonl" -o "${tmp}/e.png" ||
    fail "plot-evaluations.py failed"
  [[ $(head -c 4 "${tmp}/e.png" | od -An -c | tr -d ' ') == '211PNG' ]] || fail "no PNG written"
else
  echo "skipped the plot: no matplotlib for ${python}"
fi
echo "ok"
