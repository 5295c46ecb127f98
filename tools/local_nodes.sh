#!/usr/bin/env bash
# Several "nodes" on one machine, joined by a switch whose links can be slowed down: each node a
# network namespace with an address of its own (10.213.0.1, .2, ...), its one interface plugged
# into a bridge, and, with --rate, every link limited to that rate in each direction (tc's token
# bucket), as a node's network card would be. replica-launch runs on every node with
# --nnodes/--node-rank, exactly as a user starts it on separate machines, so the rendezvous and
# Gloo cross the links; the ranks of one node share that node's address.
#
#   tools/local_nodes.sh [--nodes N] [--nproc-per-node P] [--rate RATE] [--logs DIR] -- PROGRAM ARGS
#   tools/local_nodes.sh --check          can nodes be made here? (exit 0, else the reason, 77)
#
#   --nodes N            nodes (default 2)
#   --nproc-per-node P   ranks per node (default 1)
#   --rate RATE          each link's rate, tc's units: 10mbit, 100mbit, 1gbit (default: unlimited)
#   --logs DIR           keep every node's output in DIR/nodeK.log (its exit status in nodeK.rc)
#
# Node 0's output is printed as it comes; another node's is printed (prefixed) only when it
# fails. When a node fails, the others get 10 s to end on their own (a DDP job's ranks notice a
# lost peer), then SIGTERM. The exit status is the first failing node's (0: none failed); 1
# when the nodes cannot be made. Needs root and iproute2; without them it says so and exits 77
# (automake's "skipped"). Ctrl-C reaches the launchers as it reaches this script, a SIGTERM to
# this script is passed on to them, and the namespaces are removed at the end. The launcher is
# $REPLICA_LAUNCH, else replica-launch beside PROGRAM, else build/bin's.
set -uo pipefail

nodes=2 nproc=1 rate="" logs="" check=0
die() { echo "local_nodes: $*" >&2; exit 2; }
value() { (($# >= 2)) && [ -n "$2" ] || die "$1 needs a value"; }
while (($#)); do
  case "$1" in
    --nodes) value "$@"; nodes="$2"; shift 2 ;;
    --nproc-per-node) value "$@"; nproc="$2"; shift 2 ;;
    --rate) value "$@"; rate="${2,,}"; shift 2 ;;
    --logs) value "$@"; logs="$2"; shift 2 ;;
    --check) check=1; shift ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] && ((nodes <= 200)) || die "--nodes must be 1 to 200"
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-node must be at least 1"
rate_bytes=0
if [ -n "$rate" ]; then
  [[ "$rate" =~ ^([1-9][0-9]*)(kbit|mbit|gbit)$ ]] ||
    die "--rate '$rate': a number, then kbit, mbit or gbit"
  case "${BASH_REMATCH[2]}" in
    kbit) unit=1000 ;;
    mbit) unit=1000000 ;;
    gbit) unit=1000000000 ;;
  esac
  rate_bytes=$((BASH_REMATCH[1] * unit / 8))
fi

id="$$"
switch="replica-sw-$id"
node_ns() { echo "replica-node$1-$id"; }

# A token bucket of `rate` on interface $2 of namespace $1. The bucket holds 1 ms of traffic, and
# at least 16 KB (below 131 Mbit/s): tbf needs room for a few full frames, or TCP stalls. A
# packet waits up to 100 ms in the queue.
limit_link() {
  local burst=$((rate_bytes / 1000 > 16384 ? rate_bytes / 1000 : 16384))
  tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst "$burst" latency 100ms
}

# Can nodes be made here? Builds what the nodes need (a namespace, a bridge, a veth pair, a token
# bucket) in a namespace of its own; prints the reason when not.
can_make_nodes() {
  local probe="replica-probe-$id" why
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "iproute2 (ip, tc) not found"
    return 1
  fi
  if ! why=$(ip netns add "$probe" 2>&1); then
    echo "ip netns: ${why:-failed} (needs root)"
    return 1
  fi
  why=$( { ip -n "$probe" link add br0 type bridge &&
           ip -n "$probe" link add va type veth peer name vb &&
           tc -n "$probe" qdisc add dev va root tbf rate 1mbit burst 16384 latency 100ms; } 2>&1)
  local ok=$?
  ip netns del "$probe"
  ((ok == 0)) || { echo "a bridge, a veth pair or a token bucket: ${why:-failed}"; return 1; }
}

if ((check)); then
  if why=$(can_make_nodes); then
    echo "local_nodes: nodes can be made here"
    exit 0
  fi
  echo "local_nodes: cannot make nodes here: $why"
  exit 77
fi
(($#)) || die "no program given (tools/local_nodes.sh [options] -- PROGRAM ARGS)"
launcher="${REPLICA_LAUNCH:-}"
for candidate in "$(dirname "$1")/replica-launch" "$(dirname "$0")/../build/bin/replica-launch"; do
  [ -z "$launcher" ] && [ -x "$candidate" ] && launcher="$candidate"
done
[ -x "$launcher" ] || die "no replica-launch beside $1 or in build/bin (or set REPLICA_LAUNCH)"
if ! why=$(can_make_nodes); then
  echo "local_nodes: cannot make nodes here: $why" >&2
  exit 77
fi

# Namespaces of runs whose script is gone (killed with SIGKILL: no cleanup ran).
for ns in $(ip netns list | awk '{print $1}' | grep -E '^replica-(node[0-9]+|sw)-[0-9]+$'); do
  kill -0 "${ns##*-}" 2>/dev/null || ip netns del "$ns" 2>/dev/null
done

# Everything this run made: processes left in its namespaces, the namespaces (and with them
# their ends of the veth pairs), a pair not yet moved out of this namespace, the scratch folder.
cleanup() {
  # A child forked for a background command and killed before its exec runs this trap too.
  [ "$BASHPID" = "$id" ] || return 0
  for ((k = 0; k < nodes; ++k)); do
    local ns
    ns=$(node_ns "$k")
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
    ip netns del "$ns" 2>/dev/null
    ip link del "n$k-$id" 2>/dev/null
  done
  ip netns del "$switch" 2>/dev/null
  rm -rf "$scratch"
  return 0
}
scratch=$(mktemp -d)
trap cleanup EXIT
dir="${logs:-$scratch}"
mkdir -p "$dir" 2>/dev/null && [ -w "$dir" ] || die "cannot write --logs $dir"

make_nodes() {
  ip netns add "$switch" && ip -n "$switch" link add br0 type bridge &&
    ip -n "$switch" link set br0 up || return 1
  for ((k = 0; k < nodes; ++k)); do
    local ns port="s$k-$id" nic="n$k-$id"
    ns=$(node_ns "$k")
    ip netns add "$ns" && ip link add "$nic" type veth peer name "$port" &&
      ip link set "$nic" netns "$ns" && ip link set "$port" netns "$switch" &&
      ip -n "$ns" link set "$nic" name eth0 &&
      ip -n "$ns" addr add "10.213.0.$((k + 1))/24" dev eth0 &&
      ip -n "$ns" link set eth0 up && ip -n "$ns" link set lo up &&
      ip -n "$switch" link set "$port" master br0 && ip -n "$switch" link set "$port" up || return 1
    if [ -n "$rate" ]; then
      limit_link "$ns" eth0 && limit_link "$switch" "$port" || return 1
    fi
  done
}
if ! why=$(make_nodes 2>&1); then
  echo "local_nodes: could not make the nodes: $why" >&2
  exit 1
fi

declare -A node_of  # launcher pid -> node
for ((k = 0; k < nodes; ++k)); do
  : > "$dir/node$k.log"  # there before tail follows it
  ip netns exec "$(node_ns "$k")" "$launcher" --nnodes "$nodes" --node-rank "$k" \
    --nproc-per-node "$nproc" --master-addr 10.213.0.1 -- "$@" > "$dir/node$k.log" 2>&1 &
  node_of[$!]=$k
  ((k == 0)) && node0=$!
done
tail -s 0.2 -n +1 -f --pid="$node0" "$dir/node0.log" &
follower=$!
# A terminal's Ctrl-C reaches the launchers itself (they share this script's process group), and
# a second SIGINT would make them kill their ranks at once: it is not passed on. A SIGTERM sent
# to this script alone is.
trap ':' INT
trap 'kill -TERM "${!node_of[@]}" 2>/dev/null' TERM

# The nodes' ends, polled (a timer process killed between its fork and its exec would run this
# script's traps). After the first failure the others have 10 s to end, then get SIGTERM.
status=0 deadline=""
while ((${#node_of[@]})); do
  for pid in "${!node_of[@]}"; do
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid"
    rc=$?
    k=${node_of[$pid]}
    unset "node_of[$pid]"
    echo "$rc" > "$dir/node$k.rc"
    if ((rc != 0 && status == 0)); then
      status=$rc
      deadline=$((SECONDS + 10))
    fi
  done
  if [ -n "$deadline" ] && ((SECONDS >= deadline && ${#node_of[@]})); then
    kill -TERM "${!node_of[@]}" 2>/dev/null
    deadline=""
  fi
  ((${#node_of[@]})) && sleep 0.2
done
wait "$follower"
for ((k = 1; k < nodes; ++k)); do
  if [ "$(cat "$dir/node$k.rc")" != 0 ]; then
    tail -n 20 "$dir/node$k.log" | sed "s/^/node $k: /" >&2
  fi
done
exit "$status"
