#!/usr/bin/env bash
# A cluster of nodes on this machine, for what crosses a network: each node a Linux network
# namespace with its own address on a bridge (a veth pair each), its own drive (a directory
# bind-mounted at the same path on every node, as /nvme would be), links shaped by tc's tbf
# (bandwidth, both directions) and nftables (a share of packets dropped), and Open MPI set to
# start ranks in the node owning each hostfile address through plm_rsh_agent (no ssh) over TCP.
# Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and nftables.
#
#   tools/cluster.sh up --nodes N [--slots S] [--bandwidth RATE] [--loss PCT] [--latency MS]
#                       [--mtu BYTES] [--tcp tuned|default]
#   tools/cluster.sh run CMD...        CMD with Open MPI's settings for the cluster in its
#                                       environment (mpirun --hostfile "$STRATA_CLUSTER_HOSTFILE")
#   tools/cluster.sh exec K CMD...     CMD inside node K (its network and its drive)
#   tools/cluster.sh link K up|down    K's cable plugged in or pulled
#   tools/cluster.sh kill K            every process of node K killed (the node lost)
#   tools/cluster.sh bytes             bytes each node has sent and received on its link (and the
#                                       packets --loss dropped)
#   tools/cluster.sh measure A B [MB]  TCP throughput from node A to node B
#   tools/cluster.sh check             whether this machine can make a cluster (exit 0) or why not
#   tools/cluster.sh down              everything up made, removed (also after a failed run)
#
# RATE as tc writes it (1gbit, 100mbit); PCT a share of packets each node drops on the way out
# (0.01 steps); MTU default 9000; --tcp tuned (default) gives each node a cluster's TCP (no slow
# start after idle, Reno), default keeps this machine's. Settings: STRATA_CLUSTER_NAME (default strata: names the namespaces
# NAME-n0..., the bridge NAME-br and the host-side links NAME-v0...), STRATA_CLUSTER_DIR (default
# /tmp/NAME-cluster: hostfile, agent, the nodes' drives), STRATA_CLUSTER_SUBNET (the first three
# octets, default 10.213.0: nodes at .1, .2..., this machine's side of the bridge at .254).
set -euo pipefail

name=${STRATA_CLUSTER_NAME:-strata}
dir=${STRATA_CLUSTER_DIR:-/tmp/$name-cluster}
subnet=${STRATA_CLUSTER_SUBNET:-10.213.0}
bridge=$name-br

die() {
  echo "cluster.sh: $*" >&2
  exit 2
}
node_ns() { echo "$name-n$1"; }
node_link() { echo "$name-v$1"; }
node_addr() { echo "$subnet.$(($1 + 1))"; }
nodes_up() {
  [[ -f $dir/nodes ]] || die "no cluster is up (tools/cluster.sh up --nodes N first)"
  cat "$dir/nodes"
}
check_node() {
  local n
  n=$(nodes_up)
  [[ $1 =~ ^[0-9]+$ ]] && (($1 < n)) || die "node '$1': expected 0..$((n - 1))"
}

# Why this machine cannot make a cluster, or nothing.
why_not() {
  [[ $(id -u) -eq 0 ]] || {
    echo "needs root (network namespaces, veth pairs and a bridge)"
    return
  }
  command -v ip >/dev/null || {
    echo "needs iproute2's ip"
    return
  }
  command -v tc >/dev/null || {
    echo "needs iproute2's tc"
    return
  }
  local probe=$name-probe$$
  if ! ip netns add "$probe" 2>/dev/null; then
    echo "this machine refuses network namespaces (ip netns add failed)"
    return
  fi
  ip netns del "$probe"
}

down() {
  # Processes first (a rank still holding a socket keeps nothing alive, but a daemon in a
  # namespace would outlive it), then the namespaces with their links, then the bridge.
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$name-n[0-9]+$" || true); do
    local pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -n $pids ]] && kill -9 $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  local l
  for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
    grep -E "^$name-v[0-9]+$" || true); do
    ip link del "$l" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  if [[ -d $dir ]]; then
    umount "$dir/drive" 2>/dev/null || true
    rm -rf "$dir"
  fi
}

# tbf on a link: RATE, with a bucket of 10 ms at that rate (at least 64 KiB, so a 64 KiB
# segmentation-offload packet passes) and packets queued up to 100 ms.
shape() {
  local ns=$1 dev=$2 rate=$3
  local in=()
  [[ -n $ns ]] && in=(ip netns exec "$ns")
  local bits
  bits=$(rate_bits "$rate")
  local burst=$((bits / 8 / 100))
  ((burst < 65536)) && burst=65536
  "${in[@]}" tc qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms
}

# A tc rate (1gbit, 100mbit, 500kbit, 10gbit, 125mbps...) in bits per second.
rate_bits() {
  local r=${1,,}
  [[ $r =~ ^([0-9]+)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$ ]] ||
    die "--bandwidth '$1': expected a number and one of bit, kbit, mbit, gbit (or bps, kbps, mbps, gbps: bytes)"
  local n=${BASH_REMATCH[1]}
  case ${BASH_REMATCH[2]} in
  bit) echo "$n" ;; kbit) echo $((n * 1000)) ;; mbit) echo $((n * 1000000)) ;;
  gbit) echo $((n * 1000000000)) ;; tbit) echo $((n * 1000000000000)) ;;
  bps) echo $((n * 8)) ;; kbps) echo $((n * 8000)) ;; mbps) echo $((n * 8000000)) ;;
  gbps) echo $((n * 8000000000)) ;;
  esac
}

up() {
  local nodes=0 slots=1 bandwidth="" loss="" latency="" mtu=9000 tcp=tuned
  while (($#)); do
    case $1 in
    --nodes) nodes=$2 ;;
    --slots) slots=$2 ;;
    --bandwidth) bandwidth=$2 ;;
    --loss) loss=$2 ;;
    --latency) latency=$2 ;;
    --mtu) mtu=$2 ;;
    --tcp) tcp=$2 ;;
    *) die "up: unknown option '$1' (expected --nodes, --slots, --bandwidth, --loss, --latency, --mtu, --tcp)" ;;
    esac
    shift 2 || die "up: $1 needs a value"
  done
  [[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 200)) || die "--nodes '$nodes': expected 1..200"
  [[ $slots =~ ^[0-9]+$ ]] && ((slots >= 1)) || die "--slots '$slots': expected a count >= 1"
  [[ $mtu =~ ^[0-9]+$ ]] && ((mtu >= 576 && mtu <= 65535)) || die "--mtu '$mtu': expected 576..65535"
  [[ $tcp == tuned || $tcp == default ]] || die "--tcp '$tcp': expected tuned or default"
  [[ -z $bandwidth ]] || rate_bits "$bandwidth" >/dev/null
  local loss_per_10000=0
  if [[ -n $loss ]]; then
    [[ $loss =~ ^([0-9]+)(\.([0-9]{1,2}))?$ ]] || die "--loss '$loss': expected a percentage, 0 to 100 in steps of 0.01"
    local frac=${BASH_REMATCH[3]:-0}
    ((${#frac} == 1)) && frac=${frac}0
    loss_per_10000=$((10#${BASH_REMATCH[1]} * 100 + 10#$frac))
    ((loss_per_10000 <= 10000)) || die "--loss '$loss': expected at most 100"
    ((loss_per_10000 == 0)) || command -v nft >/dev/null ||
      die "--loss needs nftables' nft (apt-get install nftables)"
  fi
  local why
  why=$(why_not)
  [[ -z $why ]] || die "cannot make a cluster here: $why"
  if [[ -n $latency ]]; then
    # netem is a module some kernels lack; say so rather than run without the latency asked for.
    local out
    ip link add "$name-lt0" type veth peer name "$name-lt1"
    if ! out=$(tc qdisc add dev "$name-lt0" root netem delay "${latency}ms" 2>&1); then
      ip link del "$name-lt0"
      die "--latency $latency: this kernel ($(uname -r)) has no netem qdisc (tc said: $out); tbf shapes bandwidth only, so run without --latency"
    fi
    ip link del "$name-lt0"
  fi

  down
  mkdir -p "$dir/drive"
  ip link add "$bridge" type bridge
  ip link set "$bridge" mtu "$mtu"
  ip addr add "$subnet.254/24" dev "$bridge"
  ip link set "$bridge" up
  : >"$dir/hostfile"
  local k
  for ((k = 0; k < nodes; k++)); do
    local ns link addr
    ns=$(node_ns "$k")
    link=$(node_link "$k")
    addr=$(node_addr "$k")
    ip netns add "$ns"
    ip link add "$link" mtu "$mtu" type veth peer name eth0 netns "$ns"
    ip link set "$link" master "$bridge"
    ip link set "$link" up
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 mtu "$mtu"
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    if [[ $tcp == tuned ]]; then
      # A cluster's TCP: no slow start again after each pause between collectives, and Reno's
      # congestion control (this machine's BBR, probing a tbf-shaped link, and the restarts
      # after idle left it idle a third of a ZeRO-3 step at 300 Mbit/s, measured).
      ip netns exec "$ns" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0 \
        net.ipv4.tcp_congestion_control=reno
    fi
    if [[ -n $bandwidth ]]; then
      shape "$ns" eth0 "$bandwidth" # what the node sends
      shape "" "$link" "$bandwidth" # what it receives
    fi
    if ((loss_per_10000 > 0)); then
      # One packet a wire frame, as a real link loses them (not a 64 KiB segmentation-offload
      # packet at once).
      ip -n "$ns" link set eth0 gso_max_segs 1
      ip link set "$link" gso_max_segs 1
      ip netns exec "$ns" nft -f - <<EOF
table inet strata_loss {
  chain out {
    type filter hook output priority 0; policy accept;
    oifname "eth0" numgen random mod 10000 < $loss_per_10000 counter drop
  }
}
EOF
    fi
    mkdir -p "$dir/node$k/drive"
    echo "$addr slots=$slots" >>"$dir/hostfile"
  done

  # The rsh agent mpirun runs as `agent HOST COMMAND...`: COMMAND in the namespace that owns
  # HOST, under the node's own host name (its own UTS namespace: Open MPI names its shared-memory
  # files by host name, and nodes sharing one would share those files), with the node's drive
  # mounted at $dir/drive (ip netns exec gives each command its own mount namespace, so the
  # mount is seen there only).
  cat >"$dir/agent" <<EOF
#!/usr/bin/env bash
set -euo pipefail
host=\$1; shift
[[ \$host == *@* ]] && host=\${host#*@}
case \$host in
  $subnet.*) node=\$((\${host##*.} - 1)) ;;
  *) echo "cluster agent: \$host is no node of $dir/hostfile" >&2; exit 255 ;;
esac
ns=$name-n\$node
exec ip netns exec "\$ns" unshare --uts env STRATA_CLUSTER_NODE=\$node /bin/sh -c \\
  'hostname "\$1" && mount --bind "\$2" "\$3" && exec /bin/sh -c "\$4"' \\
  cluster-agent "\$ns" "$dir/node\$node/drive" "$dir/drive" "\$*"
EOF
  chmod +x "$dir/agent"
  # Open MPI's settings for the cluster: ranks started through the agent (all at once, not in a
  # tree through each other), TCP between nodes over the bridge's subnet (shared memory only
  # between a node's own ranks), as root.
  cat >"$dir/env" <<EOF
export OMPI_MCA_plm_rsh_agent=$dir/agent
export OMPI_MCA_plm_rsh_no_tree_spawn=1
export OMPI_MCA_btl=self,vader,tcp
export OMPI_MCA_btl_tcp_if_include=$subnet.0/24
export OMPI_MCA_oob_tcp_if_include=$subnet.0/24
export OMPI_MCA_orte_keep_fqdn_hostnames=1
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export STRATA_CLUSTER_HOSTFILE=$dir/hostfile
export STRATA_CLUSTER_DRIVE=$dir/drive
EOF
  echo "$nodes" >"$dir/nodes"
  echo "cluster.sh: $nodes node(s) up on $bridge ($subnet.1-$subnet.$nodes, $slots slot(s) each${bandwidth:+, $bandwidth links}${loss:+, $loss% loss}, mtu $mtu); hostfile $dir/hostfile;" \
    "each node's drive at $dir/drive"
}

run() {
  nodes_up >/dev/null
  # shellcheck disable=SC1091
  source "$dir/env"
  exec "$@"
}

exec_in() {
  check_node "$1"
  local k=$1
  shift
  exec ip netns exec "$(node_ns "$k")" unshare --uts env STRATA_CLUSTER_NODE="$k" /bin/sh -c \
    'hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@"' cluster-exec \
    "$(node_ns "$k")" "$dir/node$k/drive" "$dir/drive" "$@"
}

bytes() {
  local n k
  n=$(nodes_up)
  for ((k = 0; k < n; k++)); do
    local s=/sys/class/net/$(node_link "$k")/statistics
    # The host side's receive is what the node sent.
    local dropped
    dropped=$(ip netns exec "$(node_ns "$k")" nft list table inet strata_loss 2>/dev/null |
      sed -n 's/.*counter packets \([0-9]*\).*/\1/p' || true)
    echo "node $k $(node_addr "$k") sent $(cat "$s/rx_bytes") received $(cat "$s/tx_bytes")${dropped:+ dropped $dropped packets}"
  done
}

measure() {
  check_node "$1"
  check_node "$2"
  local mb=${3:-32}
  [[ $mb =~ ^[0-9]+$ ]] && ((mb >= 1)) || die "measure: '$mb' MB: expected a count >= 1"
  local port=$((20000 + RANDOM % 20000))
  local py=/usr/bin/python3
  [[ -x $py ]] || py=python3
  local out
  out=$(mktemp)
  ip netns exec "$(node_ns "$2")" "$py" -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(60)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    n += len(b)
t = time.monotonic() - t0
print(n, t)' "$port" >"$out" &
  local server=$!
  local tries
  for tries in $(seq 50); do
    ip netns exec "$(node_ns "$2")" ss -ltn 2>/dev/null | grep -q ":$port " && break
    sleep 0.1
  done
  ip netns exec "$(node_ns "$1")" "$py" -c '
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
chunk = b"\0" * (1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(chunk)
c.close()' "$(node_addr "$2")" "$port" "$mb"
  wait "$server"
  read -r n t <"$out"
  rm -f "$out"
  awk -v n="$n" -v t="$t" -v a="$1" -v b="$2" \
    'BEGIN { printf "node %s -> node %s: %d bytes in %.3f s: %.1f Mbit/s\n", a, b, n, t, n * 8 / t / 1e6 }'
}

cmd=${1:-}
[[ -n $cmd ]] && shift
case $cmd in
up) up "$@" ;;
down) down ;;
run) (($#)) || die "run: expected a command"; run "$@" ;;
exec) (($# >= 2)) || die "exec: expected a node and a command"; exec_in "$@" ;;
link)
  (($# == 2)) || die "link: expected a node and up|down"
  check_node "$1"
  [[ $2 == up || $2 == down ]] || die "link $1 '$2': expected up or down"
  ip link set "$(node_link "$1")" "$2"
  ;;
kill)
  (($# == 1)) || die "kill: expected a node"
  check_node "$1"
  pids=$(ip netns pids "$(node_ns "$1")")
  [[ -z $pids ]] || kill -9 $pids
  ;;
bytes) bytes ;;
measure) (($# >= 2)) || die "measure: expected two nodes"; measure "$@" ;;
check)
  why=$(why_not)
  [[ -z $why ]] || {
    echo "$why"
    exit 1
  }
  ;;
*) die "expected up, down, run, exec, link, kill, bytes, measure or check (see the top of $0)" ;;
esac
