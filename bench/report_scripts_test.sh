#!/usr/bin/env bash
# ctest SpeedTargetsReport.* and PlotSweep.*: the report scripts on malformed input say which file
# is wrong and how, with exit status 1, never with a Python traceback.
#
#   report_scripts_test.sh CASE PYTHON SCRIPT
#     unreadable_files  speed_targets_report.py on a folder whose CSVs lack a column or hold NaN
#                       and whose JSON does not parse (each a KeyError, ValueError or
#                       JSONDecodeError traceback before)
#     collective_path   plot_sweep.py on a CSV whose collective is "all/reduce" writes
#                       busbw_all_reduce.png in --out (a FileNotFoundError traceback before);
#                       skipped (77) without matplotlib
set -u
case_name=$1
python=$2
script=$3
tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT

expect() {  # expect STATUS PATTERN...: the last run's status and output
  local status=$1 pattern
  shift
  if [[ ${rc} -ne ${status} ]]; then
    echo "FAIL: exit status ${rc}, expected ${status}"
    failed=1
  fi
  if grep -q Traceback "${tmp}/out"; then
    echo "FAIL: a Python traceback"
    failed=1
  fi
  for pattern in "$@"; do
    if ! grep -qE -- "${pattern}" "${tmp}/out"; then
      echo "FAIL: no line matches '${pattern}'"
      failed=1
    fi
  done
}

failed=0
case ${case_name} in
  unreadable_files)
    printf 'world_size,size_bytes,time_us\n2,1048576,10\n' >"${tmp}/r1_all_reduce_2.csv"
    printf 'collective,size_bytes,time_ratio_ours_over_mpi,wrong\nall_reduce,8,nan,0\n' \
      >"${tmp}/r1_all_reduce_8B_2.csv"
    printf 'collective,size_bytes,wrong\nbroadcast,1048576,nan\n' >"${tmp}/r1_bcast_gather_1M_2.csv"
    : >"${tmp}/r1_kernels.json"
    printf 'workload,speedup\n1000x4K,3\n' >"${tmp}/r1_packing.csv"
    "${python}" "${script}" "${tmp}" >"${tmp}/out" 2>&1
    rc=$?
    expect 1 "r1_all_reduce_2.csv: no column collective" \
      "r1_all_reduce_8B_2.csv line 2: time_ratio_ours_over_mpi 'nan' is not a finite number" \
      "r1_bcast_gather_1M_2.csv line 2: wrong 'nan' is not a finite number" \
      "r1_kernels.json: Expecting value" "r1_packing.csv: no column mode" \
      "^all-reduce 1 MiB, 2 ranks: ours/MPI time +- +- " "some files could not be read"
    ;;
  collective_path)
    printf 'collective,world_size,size_bytes,busbw_gbps\nall/reduce,2,1024,1.5\n' >"${tmp}/sweep.csv"
    "${python}" "${script}" --out "${tmp}/plots" "${tmp}/sweep.csv" >"${tmp}/out" 2>&1
    rc=$?
    if grep -q "matplotlib is missing" "${tmp}/out"; then
      echo "skipped: plot_sweep.py needs matplotlib"
      exit 77
    fi
    expect 0 "plots/busbw_all_reduce.png"
    if [[ ! -f ${tmp}/plots/busbw_all_reduce.png ]]; then
      echo "FAIL: no busbw_all_reduce.png in --out: $(cd "${tmp}" && find . -name '*.png')"
      failed=1
    fi
    ;;
  *)
    echo "FAIL: unknown case ${case_name}"
    failed=1
    ;;
esac
if [[ ${failed} -ne 0 ]]; then
  cat "${tmp}/out"
  exit 1
fi
echo "ok: ${case_name}"
