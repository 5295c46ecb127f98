#!/usr/bin/env bash
# Several "nodes" on one machine, joined by a switch whose links can be slowed down: each node a
# network namespace with an address of its own (10.213.0.1, .2, ...), its one interface plugged
# into a bridge, and, with --rate, every link limited to that rate in each direction (tc's token
# bucket), as a node's network card would be. replica-launch runs on every node with
# --nnodes/--node-rank, exactly as a user starts it on separate machines, so the rendezvous and
# Gloo cross the links; the ranks of one node share that node's address.
#
#   tools/local_nodes.sh [--nodes N] [--nproc-per-node P] [--rate RATE] [--logs DIR] -- PROGRAM ARGS
#   tools/local_nodes.sh --check          can namespaces be made here? (exit 0, else the reason)
#
#   --nodes N            nodes (default 2)
#   --nproc-per-node P   ranks per node (default 1)
#   --rate RATE          each link's rate, tc's units: 10mbit, 100mbit, 1gbit (default: unlimited)
#   --logs DIR           keep every node's output in DIR/nodeK.log (its exit status in nodeK.rc)
#
# Node 0's output is printed as it comes; another node's is printed (prefixed) only when it
# fails. The exit status is node 0's, else the first failing node's. Needs root and iproute2;
# without them it says so and exits 77 (automake's "skipped"). The namespaces are removed at the
# end, on Ctrl-C too. The launcher is $REPLICA_LAUNCH, else replica-launch beside PROGRAM, else
# build/bin's.
set -uo pipefail

nodes=2 nproc=1 rate="" logs="" check=0
die() { echo "local_nodes: $*" >&2; exit 2; }
value() { (($# >= 2)) || die "$1 needs a value"; }
while (($#)); do
  case "$1" in
    --nodes) value "$@"; nodes="$2"; shift 2 ;;
    --nproc-per-node) value "$@"; nproc="$2"; shift 2 ;;
    --rate) value "$@"; rate="$2"; shift 2 ;;
    --logs) value "$@"; logs="$2"; shift 2 ;;
    --check) check=1; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$nodes" =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 200)) || die "--nodes must be 1 to 200"
[[ "$nproc" =~ ^[0-9]+$ ]] && ((nproc >= 1)) || die "--nproc-per-node must be at least 1"
rate_bytes=0
if [ -n "$rate" ]; then
  [[ "$rate" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || die "--rate '$rate': a number, then kbit|mbit|gbit"
  case "${BASH_REMATCH[2]}" in
    kbit) unit=1000 ;;
    mbit) unit=1000000 ;;
    gbit) unit=1000000000 ;;
  esac
  rate_bytes=$((BASH_REMATCH[1] * unit / 8))
  ((rate_bytes > 0)) || die "--rate must be above 0"
fi

id="$$"
switch="replica-sw-$id"
node_ns() { echo "replica-node$1-$id"; }

cleanup() {
  for ((k = 0; k < nodes; ++k)); do ip netns del "$(node_ns "$k")" 2>/dev/null; done
  ip netns del "$switch" 2>/dev/null
  [ -n "${scratch:-}" ] && rm -rf "$scratch"
  return 0
}

# Can namespaces be made here? Prints the reason when not.
can_make_namespaces() {
  local why
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "iproute2 (ip, tc) not found"
    return 1
  fi
  if ! why=$(ip netns add "replica-probe-$id" 2>&1); then
    echo "ip netns: ${why:-failed} (needs root)"
    return 1
  fi
  ip netns del "replica-probe-$id"
}

if ((check)); then
  if why=$(can_make_namespaces); then
    echo "local_nodes: network namespaces can be made here"
    exit 0
  fi
  echo "local_nodes: cannot make network namespaces here: $why"
  exit 77
fi
(($#)) || die "no program given (tools/local_nodes.sh [options] -- PROGRAM ARGS)"
launcher="${REPLICA_LAUNCH:-}"
for candidate in "$(dirname "$1")/replica-launch" "$(dirname "$0")/../build/bin/replica-launch"; do
  [ -z "$launcher" ] && [ -x "$candidate" ] && launcher="$candidate"
done
[ -x "$launcher" ] || die "no replica-launch beside $1 or in build/bin (or set REPLICA_LAUNCH)"
if ! why=$(can_make_namespaces); then
  echo "local_nodes: cannot make network namespaces here: $why" >&2
  exit 77
fi

trap cleanup EXIT

# A token bucket of `rate` on interface $2 of namespace $1. The bucket holds 1 ms of traffic (at
# least 16 KB, the kernel's floor at high rates); packets wait up to 100 ms in the queue.
limit_link() {
  local burst=$((rate_bytes / 1000 > 16384 ? rate_bytes / 1000 : 16384))
  tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst "$burst" latency 100ms
}

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
make_nodes || die "could not make the nodes' namespaces and links"

scratch=$(mktemp -d)
dir="${logs:-$scratch}"
mkdir -p "$dir" || die "cannot write --logs $dir"
pids=()
for ((k = 0; k < nodes; ++k)); do
  : > "$dir/node$k.log"  # there before tail follows it
  ip netns exec "$(node_ns "$k")" "$launcher" --nnodes "$nodes" --node-rank "$k" \
    --nproc-per-node "$nproc" --master-addr 10.213.0.1 -- "$@" > "$dir/node$k.log" 2>&1 &
  pids+=($!)
done
tail -s 0.2 -n +1 -f --pid="${pids[0]}" "$dir/node0.log" &
follower=$!
# Ctrl-C reaches the launchers from the terminal itself (a second one would make them kill
# their ranks at once); a TERM sent to this script alone is passed on.
trap ':' INT
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM

# A node's exit status, waited for through any signal this script traps.
wait_node() {
  while kill -0 "$1" 2>/dev/null; do wait "$1"; done
  wait "$1"
}
status=0
for ((k = 0; k < nodes; ++k)); do
  wait_node "${pids[k]}"
  rc=$?
  echo "$rc" > "$dir/node$k.rc"
  if ((rc != 0)); then
    ((status == 0)) && status=$rc
  fi
done
wait "$follower"
for ((k = 1; k < nodes; ++k)); do
  if [ "$(cat "$dir/node$k.rc")" != 0 ]; then
    tail -n 20 "$dir/node$k.log" | sed "s/^/node $k: /" >&2
  fi
done
exit "$status"
