#!/usr/bin/env bash
# ctest EmulatedCluster.*: scripts/emulated-cluster.sh on this machine, in whichever of two forms
# the machine allows (each prints which it ran, and neither passes without checking something).
#
#   emulated_cluster_test.sh SCRIPT GLOO   (GLOO: 1 where gloo_perf is built, else 0)
#   Where network namespaces can be made (root, `ip netns`): a tiny cluster, 2 hosts x 2 ranks at
#     1 Gbit/s, 8 B and 64 KiB, every result checked: the run exits 0, its table has a row per size
#     with figures for AUTO, every fixed algorithm, Open MPI and Gloo, and its namespaces and
#     bridge are gone afterwards; a run interrupted (SIGINT) once its namespaces exist leaves none
#     behind either; a delay preset on a kernel without netem is refused naming netem; and the
#     same script run as an unprivileged user is refused naming root.
#   Elsewhere: the script is refused (exit 3) with a message that names what is missing.
set -u
script=$1
gloo=$2
tmp=$(mktemp -d)
chmod 755 "${tmp}"
trap 'rm -rf "${tmp}"' EXIT
failed=0
fail() {
  echo "FAIL: $*"
  failed=1
}
# Whether this machine lets the script make namespaces (what the script itself checks first).
can_make_namespaces() {
  [[ $(id -u) -eq 0 ]] || return 1
  local probe="ectest$$"
  ip netns add "${probe}" 2>/dev/null || return 1
  ip netns del "${probe}"
}
# The namespaces and bridge a run named in its output ("hosts ecNh0..ecNh1 ... on bridge ecNbr").
leftovers() {
  local tag
  tag=$(sed -n 's/^emulated-cluster: hosts \(ec[0-9]*\)h0\.\..*/\1/p' "$1" | head -1)
  if [[ -z ${tag} ]]; then
    echo "(the run named no namespaces)"
    return
  fi
  ip netns list | grep -o "^${tag}h[0-9]*" || true
  ip link show "${tag}br" >/dev/null 2>&1 && echo "${tag}br"
  return 0
}

if ! can_make_namespaces; then
  echo "network namespaces cannot be made here: checking that the script refuses"
  rc=0
  "${script}" --hosts 2 --ranks 2 --sizes quick >"${tmp}/out" 2>&1 || rc=$?
  cat "${tmp}/out"
  [[ ${rc} -eq 3 ]] || fail "exit status ${rc}, expected 3 (refused)"
  grep -q "refused: cannot make network namespaces here: " "${tmp}/out" ||
    fail "no 'refused: cannot make network namespaces here: <why>' message"
  exit "${failed}"
fi

echo "network namespaces can be made here: a tiny cluster, 2 hosts x 2 ranks"
rc=0
timeout 120 "${script}" --hosts 2 --ranks 2 --preset 1g --sizes quick --check \
  --out "${tmp}/run" >"${tmp}/out" 2>&1 || rc=$?
cat "${tmp}/out"
[[ ${rc} -eq 0 ]] || fail "exit status ${rc}, expected 0"
for size in "8 B" "64 KiB"; do
  # size | AUTO | AUTO ran | ring | rec. doubling | two levels | Open MPI | Gloo | ratio | ratio
  row=$(grep "^| ${size} |" "${tmp}/out" || true)
  if [[ -z ${row} ]]; then
    fail "no table row for ${size}"
    continue
  fi
  fields=$(awk -F'|' '{ n = 0; for (i = 3; i < NF; ++i) if (i != 4 && $i ~ /^ *[0-9.]+ *$/) ++n;
                        print n }' <<<"${row}")
  # AUTO, ring, recursive doubling, two levels, Open MPI, Gloo (where built), the two ratios.
  expected=$((7 + gloo))
  [[ ${fields} -ge ${expected} ]] ||
    fail "row for ${size} has ${fields} figures, expected ${expected}: ${row}"
done
grep -q "^AUTO / best(Open MPI, Gloo): at most " "${tmp}/out" || fail "no AUTO / best(MPI, Gloo)"
grep -q "^AUTO / best fixed algorithm: at most " "${tmp}/out" || fail "no AUTO / best fixed line"
grep -q "this kernel has no netem\|netem delay" "${tmp}/out" || fail "does not say how it shapes"
left=$(leftovers "${tmp}/out")
[[ -z ${left} ]] || fail "left behind: ${left}"

# As Ctrl-C does: SIGINT to the run's process group (the script, mpirun and what it started), with
# SIGINT's default action restored (a shell starts its background jobs with it ignored).
echo "interrupted (SIGINT to its process group) once its namespaces exist"
setsid env --default-signal=INT "${script}" --hosts 2 --ranks 2 --preset 1g --sizes quick --out "${tmp}/int" \
  >"${tmp}/int.out" 2>&1 &
pid=$!
for _ in $(seq 200); do
  grep -q "^== ours_0" "${tmp}/int.out" && break
  sleep 0.1
done
grep -q "^== ours_0" "${tmp}/int.out" || fail "the interrupted run never started its sweep"
pgid=$(ps -o pgid= "${pid}" | tr -d ' ')
kill -INT -- "-${pgid}"
rc=0
timeout 30 tail --pid="${pid}" -f /dev/null || fail "the interrupted run did not end in 30 s"
wait "${pid}" || rc=$?
cat "${tmp}/int.out"
[[ ${rc} -ne 0 ]] || fail "the interrupted run exited 0"
left=$(leftovers "${tmp}/int.out")
[[ -z ${left} ]] || fail "the interrupted run left behind: ${left}"

if ! tc qdisc add dev lo root netem delay 1us 2>/dev/null; then
  echo "this kernel has no netem: a delay preset is refused"
  rc=0
  "${script}" --hosts 2 --ranks 2 --preset 25us --sizes quick >"${tmp}/netem.out" 2>&1 || rc=$?
  cat "${tmp}/netem.out"
  [[ ${rc} -eq 3 ]] || fail "--preset 25us: exit status ${rc}, expected 3"
  grep -q "refused: --preset 25us .*netem" "${tmp}/netem.out" || fail "--preset 25us: no netem"
  left=$(leftovers "${tmp}/netem.out")
  [[ -z ${left} ]] || fail "--preset 25us left behind: ${left}"
else
  tc qdisc del dev lo root
  echo "this kernel has netem: the delay presets run (not run here)"
fi

if command -v setpriv >/dev/null; then
  echo "as an unprivileged user: refused"
  rc=0
  setpriv --reuid=65534 --regid=65534 --clear-groups "${script}" --sizes quick \
    >"${tmp}/user.out" 2>&1 || rc=$?
  cat "${tmp}/user.out"
  [[ ${rc} -eq 3 ]] || fail "unprivileged: exit status ${rc}, expected 3"
  grep -q "refused: cannot make network namespaces here: needs root" "${tmp}/user.out" ||
    fail "unprivileged: no 'needs root' message"
else
  echo "setpriv is missing: the unprivileged refusal is not checked"
fi
exit "${failed}"
