#!/usr/bin/env bash
# An emulated cluster on one machine: H hosts as network namespaces on a bridge, R ranks per host,
# each host's link shaped with tc, and an all-reduce sweep across them: AUTO, every fixed
# algorithm of ours and Open MPI's all-reduce on the same buffers (--versus, --baseline mpi: one
# job, each size's configurations timed in alternating rounds) and Gloo's (gloo_perf, a job of its
# own), all started by mpirun into the namespaces, on the same links, in one run. Prints a table
# of all-reduce time per size with the ratios AUTO / best(Open MPI, Gloo) and AUTO / best fixed
# algorithm, and writes it under OUT_DIR.
#
# Every column reports, per size, the fastest of its rounds (--stat min): noise on a shared or
# oversubscribed machine only slows a round, and many short rounds interleaved with the other
# configurations' give each configuration the same chances of an undisturbed one, so AUTO and
# the fixed algorithm that runs its plan measure the same.
#
#   scripts/emulated-cluster.sh [--preset 10g|1g|25us|100us] [--hosts H] [--ranks R]
#                               [--sizes quick|full|"B1 B2 ..."] [--stat min|median] [--check]
#                               [--out OUT_DIR] [--docs FILE]
#
# Presets (each host's link, both directions):
#   10g    rate 10 Gbit/s (tbf)
#   1g     rate 1 Gbit/s (tbf)
#   25us   rate 10 Gbit/s and 25 us added one-way delay (netem; refused where the kernel has none)
#   100us  rate 1 Gbit/s and 100 us added one-way delay (netem; likewise)
# The delay is added where a host sends (its namespace's end of the link), so a message between
# two hosts takes it once; the rate limit is applied on both ends of each host's link, so a host
# sends and receives at most the rate.
#
# Options:
#   --hosts H (default 4), --ranks R per host (default 2)
#   --sizes full (default): 8 B to 64 MiB (x8 to 32 KiB, then 256 KiB, 1, 4, 16, 64 MiB); up to
#           32 KiB 21 rounds of 10 calls, to 1 MiB 9 rounds of 2 calls, above it 5 rounds of one
#           call (about 3 minutes at 1 Gbit/s on 2 cores); quick: 8 B and 64 KiB, one round of 3
#           calls, for a smoke test; or a list of byte sizes ("8 1M"), each 7 rounds of 3 calls.
#   --stat min (default) or median: what a column reports of its rounds, every column alike
#   --check  verify every call's result on every rank (collectives_perf and gloo_perf --check)
#   --out OUT_DIR  the CSVs, logs and table.md (default out/emulated-<preset>-<date>-<time>)
#   --docs FILE    also write the table, dated, naming the machine and the command, into FILE's
#                  section "## Emulated clusters" (subsection per preset; FILE: docs/benchmarks.md)
#   --no-gloo      leave Gloo out (it is left out, with a note, when gloo_perf is not built)
#   --perf-args "FLAGS"  more flags for collectives_perf, e.g. "--yield-us 0" (every one of ours)
# Environment: COLLECTIVES_BUILD_DIR (default build).
#
# Needs root (namespaces, veth pairs, a bridge, tc), iproute2's `ip netns` and `tc`, mpirun (Open
# MPI) and an MPI build of build/bench/collectives_perf; refuses with a message naming what is
# missing (exit 3) otherwise. Cleans up its namespaces, bridge and veths on exit, error and
# Ctrl-C. Exit status: 0 success, 1 a run failed, 2 --check found wrong elements, 3 refused.
#
# Every rank of every host runs on this machine's cores: with 8 ranks on 2 cores the 10 Gbit/s
# preset measures the CPUs more than the links (a rank's TCP, copies and reductions compete for a
# core), so its ratios say how the algorithms share the CPUs, not the links.
set -euo pipefail

die() {
  echo "emulated-cluster: $*" >&2
  exit 1
}
refuse() {
  echo "emulated-cluster: refused: $*" >&2
  exit 3
}

HOSTS=4
RANKS=2
PRESET=10g
SIZES_MODE=full
CHECK=0
OUT=""
DOCS=""
GLOO=1
PERF_ARGS=""
STAT=min
COMMAND_LINE="scripts/emulated-cluster.sh $*"
while [[ $# -gt 0 ]]; do
  case $1 in
    --hosts) HOSTS=${2:?--hosts needs a count}; shift 2 ;;
    --ranks) RANKS=${2:?--ranks needs a count}; shift 2 ;;
    --preset) PRESET=${2:?--preset needs a name}; shift 2 ;;
    --sizes) SIZES_MODE=${2:?--sizes needs quick, full or a list}; shift 2 ;;
    --check) CHECK=1; shift ;;
    --out) OUT=$(realpath -m -- "${2:?--out needs a folder}"); shift 2 ;;
    --docs) DOCS=$(realpath -m -- "${2:?--docs needs a file}"); shift 2 ;;
    --no-gloo) GLOO=0; shift ;;
    --perf-args) PERF_ARGS=${2?--perf-args needs flags}; shift 2 ;;
    --stat) STAT=${2:?--stat needs min or median}; shift 2 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
      exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ ${HOSTS} =~ ^[0-9]+$ && ${HOSTS} -ge 2 && ${HOSTS} -le 64 ]] ||
  die "--hosts ${HOSTS}: give 2 to 64 hosts"
[[ ${RANKS} =~ ^[0-9]+$ && ${RANKS} -ge 1 && ${RANKS} -le 64 ]] ||
  die "--ranks ${RANKS}: give 1 to 64 ranks per host"
[[ ${STAT} == min || ${STAT} == median ]] || die "--stat ${STAT}: give min or median"

case ${PRESET} in
  10g) RATE=10gbit; DELAY="" ; PRESET_TEXT="10 Gbit/s" ;;
  1g) RATE=1gbit; DELAY="" ; PRESET_TEXT="1 Gbit/s" ;;
  25us) RATE=10gbit; DELAY=25us ; PRESET_TEXT="10 Gbit/s, 25 us" ;;
  100us) RATE=1gbit; DELAY=100us ; PRESET_TEXT="1 Gbit/s, 100 us" ;;
  *) die "--preset ${PRESET}: unknown (10g, 1g, 25us, 100us)" ;;
esac
# tbf's bucket: enough for a 64 KiB TSO segment at either rate, so the rate holds without drops.
case ${RATE} in
  10gbit) BURST=512kb ;;
  *) BURST=128kb ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR=${COLLECTIVES_BUILD_DIR:-build}
PERF=$(realpath -m "${BUILD_DIR}/bench/collectives_perf")
GLOO_PERF=$(realpath -m "${BUILD_DIR}/bench/gloo_perf")
PYTHON=/usr/bin/python3

# --- What the machine must allow -----------------------------------------------------------------
if [[ $(id -u) -ne 0 ]]; then
  refuse "cannot make network namespaces here: needs root (namespaces, veth pairs, a bridge and" \
    "tc need CAP_NET_ADMIN); run it as root, or on a machine that allows it"
fi
command -v ip >/dev/null || refuse "cannot make network namespaces here: 'ip' (iproute2) is missing"
command -v tc >/dev/null || refuse "cannot shape links here: 'tc' (iproute2) is missing"
command -v mpirun >/dev/null || refuse "mpirun (Open MPI) is missing"
[[ -x ${PYTHON} ]] || refuse "${PYTHON} is missing (Debian's python3 prints the table)"
[[ -x ${PERF} ]] ||
  refuse "${PERF} is not built (cmake --build ${BUILD_DIR} --target collectives_perf)"
grep -q '^COLLECTIVES_WITH_MPI:BOOL=ON' "${BUILD_DIR}/CMakeCache.txt" 2>/dev/null ||
  refuse "${PERF} was built without MPI: the ranks start under mpirun"
if [[ ${GLOO} == 1 && ! -x ${GLOO_PERF} ]]; then
  echo "emulated-cluster: ${GLOO_PERF} is not built (libgloo-dev missing?): no Gloo column" >&2
  GLOO=0
fi

# Names: short (interface names have 15 characters at most) and this run's own, so that runs
# side by side do not meet; the subnet likewise.
TAG="ec$$"
BRIDGE="${TAG}br"
NET="10.$((100 + $$ % 100)).$((($$ / 100) % 250))"
BRIDGE_ADDR="${NET}.254"
ns_of() { echo "${TAG}h$1"; }
addr_of() { echo "${NET}.$(($1 + 1))"; }

echo "emulated-cluster: hosts $(ns_of 0)..$(ns_of $((HOSTS - 1))) (network namespaces) on bridge" \
  "${BRIDGE}, ${NET}.0/24"
WORK=$(mktemp -d /tmp/emulated-cluster.XXXXXX)
made_bridge=0
made_ns=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM HUP
  # Whatever still runs in a namespace was started by this run (mpirun's daemons and ranks).
  for ns in "${made_ns[@]}"; do
    local pids
    pids=$(ip netns pids "${ns}" 2>/dev/null || true)
    if [[ -n ${pids} ]]; then
      # shellcheck disable=SC2086
      kill -KILL ${pids} 2>/dev/null || true
    fi
    ip netns del "${ns}" 2>/dev/null || true  # takes its veth pair with it
  done
  if [[ ${made_bridge} == 1 ]]; then ip link del "${BRIDGE}" 2>/dev/null || true; fi
  rm -rf "${WORK}"
  exit "${status}"
}
trap cleanup EXIT
trap 'echo "emulated-cluster: interrupted; cleaning up" >&2; exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# A probe namespace: `ip netns` may exist and still be refused (no CAP_SYS_ADMIN in a container,
# no /run/netns).
probe="${TAG}probe"
if ! why=$(ip netns add "${probe}" 2>&1); then
  refuse "cannot make network namespaces here: 'ip netns add' failed: ${why}"
fi
made_ns+=("${probe}")
if ! why=$(ip link add "${BRIDGE}" type bridge 2>&1); then
  refuse "cannot make a bridge here: ${why}"
fi
made_bridge=1
ip netns del "${probe}"
made_ns=()

# Whether the kernel has netem: the delay presets need it.
HAVE_NETEM=0
if why=$(tc qdisc add dev "${BRIDGE}" root netem delay 1us 2>&1); then
  HAVE_NETEM=1
  tc qdisc del dev "${BRIDGE}" root
fi
if [[ -n ${DELAY} && ${HAVE_NETEM} == 0 ]]; then
  refuse "--preset ${PRESET} adds ${DELAY} of delay, which needs the kernel's netem qdisc," \
    "and this kernel has none (tc: ${why}); the rate presets 10g and 1g run here"
fi

# --- The cluster -------------------------------------------------------------------------------
ip addr add "${BRIDGE_ADDR}/24" dev "${BRIDGE}"
ip link set "${BRIDGE}" up
# shape DEV [NS]: the preset's rate (and delay, on a host's own end) on DEV's egress.
shape() {
  local dev=$1 ns=${2:-}
  local in=()
  if [[ -n ${ns} ]]; then in=(ip netns exec "${ns}"); fi
  if [[ -n ${ns} && -n ${DELAY} ]]; then
    "${in[@]}" tc qdisc add dev "${dev}" root handle 1: netem delay "${DELAY}" limit 100000
    "${in[@]}" tc qdisc add dev "${dev}" parent 1:1 handle 10: tbf rate "${RATE}" \
      burst "${BURST}" latency 50ms
  else
    "${in[@]}" tc qdisc add dev "${dev}" root tbf rate "${RATE}" burst "${BURST}" latency 50ms
  fi
}
for ((h = 0; h < HOSTS; ++h)); do
  ns=$(ns_of "${h}")
  ip netns add "${ns}"
  made_ns+=("${ns}")
  ip link add "${TAG}v${h}" type veth peer name ec0 netns "${ns}"
  ip link set "${TAG}v${h}" master "${BRIDGE}" up
  ip netns exec "${ns}" ip addr add "$(addr_of "${h}")/24" dev ec0
  ip netns exec "${ns}" ip link set ec0 up
  ip netns exec "${ns}" ip link set lo up
  shape "${TAG}v${h}"
  shape ec0 "${ns}"
done

# mpirun's launch agent: "AGENT [options] HOST COMMAND...", HOST one of the hosts' addresses; runs
# the daemon's command line (a shell's, as ssh would) in that host's namespace, as that host
# (COLLECTIVES_HOST_ID: every namespace shares this machine's host name and /dev/shm, and AUTO
# must plan by the emulated hosts), with a session folder of its own (Open MPI names it by the
# host name, which every namespace shares, and keeps its shared-memory files there, named by host
# name and local rank).
AGENT=${WORK}/agent.sh
{
  echo '#!/bin/sh'
  echo 'while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done'
  echo 'host=$1'
  echo 'shift'
  echo 'case $host in'
  for ((h = 0; h < HOSTS; ++h)); do echo "  $(addr_of "${h}")) ns=$(ns_of "${h}") ;;"; done
  echo '  *) echo "emulated-cluster agent: unknown host $host" >&2; exit 1 ;;'
  echo 'esac'
  echo "session=${WORK}/session/\$ns"
  echo 'mkdir -p "$session"'
  echo 'exec ip netns exec "$ns" env COLLECTIVES_HOST_ID="$host" \'
  echo '  OMPI_MCA_orte_tmpdir_base="$session" OMPI_MCA_btl_vader_backing_directory="$session" \'
  echo '  /bin/sh -c "$*"'
} >"${AGENT}"
chmod +x "${AGENT}"

host_list=""
for ((h = 0; h < HOSTS; ++h)); do host_list+="${host_list:+,}$(addr_of "${h}"):${RANKS}"; done
NP=$((HOSTS * RANKS))
# shellcheck disable=SC2054  # the host list is one argument, commas and all
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np "${NP}" --host "${host_list}"
  --mca plm_rsh_agent "${AGENT}" --mca plm_rsh_no_tree_spawn 1
  --mca oob_tcp_if_include "${NET}.0/24" --mca pml ob1 --mca btl self,vader,tcp
  --mca btl_tcp_if_include "${NET}.0/24" -x MASTER_ADDR="$(addr_of 0)")

# Sizes: separate sweeps so the large sizes take few calls. Many short rounds rather than a few
# long ones: a configuration's rounds are spread over the run, between the others', so a burst of
# noise falls on some rounds of each rather than on all of one.
SWEEPS=()
case ${SIZES_MODE} in
  full)
    SWEEPS+=("-b 8 -e 32K -f 8 -n 10 -w 5 -r 21")
    SWEEPS+=("-b 256K -e 1M -f 4 -n 2 -w 2 -r 9")
    SWEEPS+=("-b 4M -e 64M -f 4 -n 1 -w 1 -r 5") ;;
  quick) SWEEPS+=("-b 8 -e 64K -f 8192 -n 3 -w 1") ;;
  *)
    for size in ${SIZES_MODE}; do SWEEPS+=("-b ${size} -e ${size} -n 3 -w 2 -r 7"); done ;;
esac
CHECK_FLAG=()
if [[ ${CHECK} == 1 ]]; then CHECK_FLAG=(--check); fi
FIXED=ring:ring,ring:recursive_doubling,auto:two_level
if ((NP >= 4 && (NP & (NP - 1)) == 0)); then
  FIXED=ring:ring,ring:recursive_doubling,ring:halving_doubling,auto:two_level
fi
if ((RANKS == 1)); then FIXED=${FIXED%,auto:two_level}; fi  # one rank per host: no two levels

OUT=${OUT:-out/emulated-${PRESET}-$(date +%Y%m%d-%H%M%S)}
mkdir -p "${OUT}"
rm -f "${OUT}"/ours_*.csv "${OUT}"/gloo_*.csv "${OUT}"/ours_*.log "${OUT}"/gloo_*.log  # a rerun's
echo "emulated-cluster: ${HOSTS} hosts x ${RANKS} ranks, links ${PRESET_TEXT} (tc tbf" \
  "${RATE}${DELAY:+, netem delay ${DELAY}}), on $(nproc) cores"
if [[ ${HAVE_NETEM} == 0 ]]; then
  echo "emulated-cluster: this kernel has no netem: links are shaped in rate only, with no" \
    "added delay (a round trip between hosts is the veths' and the bridge's, a few us)"
fi
if ((NP > $(nproc))); then
  echo "emulated-cluster: ${NP} ranks on $(nproc) cores: the ranks compete for the CPUs; at high" \
    "rates the figures measure the cores more than the links"
fi
echo "emulated-cluster: machine load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
uptime_load=$(cut -d' ' -f1-3 /proc/loadavg)

status=0
run() {
  local name=$1
  shift
  echo "== ${name}"
  local rc=0
  "$@" >"${OUT}/${name}.log" 2>&1 || rc=$?
  if ((rc != 0)); then
    echo "emulated-cluster: ${name} failed (exit ${rc}); its log, ${OUT}/${name}.log, ends:" >&2
    tail -n 15 "${OUT}/${name}.log" >&2
    if ((rc == 2 && status == 0)); then status=2; else status=1; fi
  fi
}

# gloo_perf's ranks: RANK and WORLD_SIZE from mpirun, the store in a folder every namespace sees
# (one machine), the device on this host's address.
GLOO_RANK=${WORK}/gloo-rank.sh
cat >"${GLOO_RANK}" <<EOF
#!/bin/sh
addr=\$(ip -4 -o addr show dev ec0 | awk '{ sub("/.*", "", \$4); print \$4 }')
RANK=\${OMPI_COMM_WORLD_RANK} WORLD_SIZE=\${OMPI_COMM_WORLD_SIZE} exec "${GLOO_PERF}" \\
  --hostname "\${addr}" "\$@"
EOF
chmod +x "${GLOO_RANK}"

for i in "${!SWEEPS[@]}"; do
  # shellcheck disable=SC2206
  sweep=(${SWEEPS[$i]})
  # shellcheck disable=SC2086  # PERF_ARGS: flags, split at spaces
  run "ours_${i}" "${MPIRUN[@]}" "${PERF}" --impl auto -c all_reduce "${sweep[@]}" ${PERF_ARGS} \
    --stat "${STAT}" "${CHECK_FLAG[@]}" --baseline mpi --versus "${FIXED}" --timeout 300 \
    --csv "${OUT}/ours_${i}.csv"
  if [[ ${GLOO} == 1 ]]; then
    # Gloo's job has the same rounds and statistic, after ours.
    store=${WORK}/gloo_store_${i}
    mkdir -p "${store}"
    run "gloo_${i}" "${MPIRUN[@]}" "${GLOO_RANK}" --store "${store}" -c all_reduce \
      "${sweep[@]}" --stat "${STAT}" \
      "${CHECK_FLAG[@]}" --timeout 300 --csv "${OUT}/gloo_${i}.csv"
  fi
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

"${PYTHON}" - "${OUT}" "${PRESET_TEXT}" "${HOSTS}" "${RANKS}" "${HAVE_NETEM}" \
  "${uptime_load}" "${load_after}" "${COMMAND_LINE}" "${DOCS}" "${PRESET}" "${PERF_ARGS}" \
  "${STAT}" <<'PY'
import csv, datetime, glob, os, platform, re, subprocess, sys

out, preset_text, hosts, ranks, netem, load0, load1, command, docs, preset, perf_args, stat = \
    sys.argv[1:13]
round_text = "fastest round" if stat == "min" else "median round"
ours, gloo = {}, {}
names = []
for path in sorted(glob.glob(os.path.join(out, "ours_*.csv"))):
    with open(path) as f:
        for row in csv.DictReader(f):
            if not row["time_us"]:
                continue
            size = int(row["size_bytes"])
            entry = {"AUTO": float(row["time_us"]), "algorithm": row.get("algorithm", "")}
            if row.get("mpi_time_us"):
                entry["Open MPI"] = float(row["mpi_time_us"])
            for key, value in row.items():
                m = re.fullmatch(r"(.+)_time_us", key)
                if m and m.group(1) not in ("", "mpi") and value:
                    entry[m.group(1)] = float(value)
                    if m.group(1) not in names:
                        names.append(m.group(1))
            ours[size] = entry
for path in sorted(glob.glob(os.path.join(out, "gloo_*.csv"))):
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["time_us"]:
                gloo[int(row["size_bytes"])] = float(row["time_us"])

def size_text(b):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale} {unit}"
    return f"{b} B"

labels = {"ring:ring": "ring", "ring:recursive_doubling": "rec. doubling",
          "ring:halving_doubling": "halving-doubling", "auto:two_level": "two levels"}
head = ["size", "AUTO", "AUTO ran"] + [labels.get(n, n) for n in names] + \
       ["Open MPI", "Gloo", "AUTO / best(MPI, Gloo)", "AUTO / best fixed"]
lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
worst_base, worst_fixed = (0.0, None), (0.0, None)
for size in sorted(ours):
    e = ours[size]
    fixed = [e[n] for n in names if n in e]
    base = [t for t in (e.get("Open MPI"), gloo.get(size)) if t]
    rb = e["AUTO"] / min(base) if base else None
    rf = e["AUTO"] / min(fixed) if fixed else None
    if rb is not None and rb > worst_base[0]:
        worst_base = (rb, size)
    if rf is not None and rf > worst_fixed[0]:
        worst_fixed = (rf, size)
    cell = lambda t: f"{t:.1f}" if t else "-"
    lines.append("| " + " | ".join(
        [size_text(size), cell(e["AUTO"]), e["algorithm"] or "-"] +
        [cell(e.get(n)) for n in names] +
        [cell(e.get("Open MPI")), cell(gloo.get(size)),
         f"{rb:.2f}" if rb else "-", f"{rf:.2f}" if rf else "-"]) + " |")
summary = []
if worst_base[1] is not None:
    summary.append(f"AUTO / best(Open MPI, Gloo): at most {worst_base[0]:.2f} "
                   f"(at {size_text(worst_base[1])}); "
                   + ("holds 1.0x at every size" if worst_base[0] <= 1.0 else "above 1.0x"))
if worst_fixed[1] is not None:
    summary.append(f"AUTO / best fixed algorithm: at most {worst_fixed[0]:.2f} "
                   f"(at {size_text(worst_fixed[1])}); "
                   + ("within 10% at every size" if worst_fixed[0] <= 1.10
                      else "more than 10% off"))
# Where AUTO ran a plan that a fixed column also ran, the two timed the same code in alternating
# rounds: their ratio is the run's noise, the yardstick for the ratios above.
same = []
for size, e in ours.items():
    twin = {"two_level": "auto:two_level"}.get(e["algorithm"], "ring:" + e["algorithm"])
    if e.get(twin):
        same.append(e["AUTO"] / e[twin])
if same:
    summary.append(f"AUTO against the fixed column of the plan it ran (the same code, timed "
                   f"in alternating rounds: the run's noise): {min(same):.2f} to "
                   f"{max(same):.2f} over {len(same)} sizes")
table = "\n".join(lines)
print()
print(f"All-reduce, f32 sum, time per call in us (slowest rank, {round_text}), {hosts} hosts x "
      f"{ranks} ranks, links {preset_text}:")
print(table)
for line in summary:
    print(line)

cpu = "unknown"
try:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
except OSError:
    pass
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
except OSError:
    commit = "unknown"
heading = f"### {preset_text}: {hosts} hosts x {ranks} ranks" + \
    (f", ours with `{perf_args}`" if perf_args else "")
section = [heading, "",
           f"{date}, commit {commit}, on {os.cpu_count()} cores ({cpu}), load average "
           f"{load0} before and {load1} after. Command: `{command}`.",
           "Links: " + ("rate only (this kernel has no netem: no added delay)"
                        if netem == "0" else "rate and added delay (netem)") +
           f"; {int(hosts) * int(ranks)} ranks share the machine's cores.", "",
           f"All-reduce, f32 sum, microseconds per call (the slowest rank's, {round_text}; "
           "AUTO, the fixed algorithms and Open MPI in alternating rounds of one job, Gloo in "
           "a job of its own); \"AUTO ran\" is the plan AUTO chose.", "", table, ""] + \
          [f"- {line}" for line in summary] + [""]
with open(os.path.join(out, "table.md"), "w") as f:
    f.write("\n".join(section))
if docs:
    title = "## Emulated clusters"
    intro = [title, "",
             "Generated by `scripts/emulated-cluster.sh` "
             "([emulated-cluster.md](emulated-cluster.md)): hosts as network namespaces on a "
             "bridge, each host's link shaped with tc, every rank on this machine; AUTO, our fixed "
             "algorithms, Open MPI and Gloo on the same links in one run.",
             ""]
    text = open(docs).read() if os.path.exists(docs) else "# Benchmarks\n"
    start = text.find("\n" + title + "\n")
    if start < 0:
        body = intro
        before, after = text.rstrip("\n") + "\n\n", ""
    else:
        end = text.find("\n## ", start + 1)
        body = text[start + 1:end if end >= 0 else len(text)].rstrip("\n").split("\n")
        before, after = text[:start + 1], text[end:] if end >= 0 else ""
    # Replace this preset's subsection (of this layout and flags), or append it.
    joined = "\n".join(body)
    own = re.compile(r"^" + re.escape(heading) + r"\n.*?(?=^### |\Z)", re.S | re.M)
    new = "\n".join(section).rstrip("\n") + "\n\n"
    joined = own.sub(lambda _: new, joined) if own.search(joined) else \
        joined.rstrip("\n") + "\n\n" + new
    with open(docs, "w") as f:
        f.write(before + joined.rstrip("\n") + "\n" + after)
    print(f"emulated-cluster: wrote the table into {docs}")
PY
echo "emulated-cluster: CSVs and logs in ${OUT}"
exit "${status}"
