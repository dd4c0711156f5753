#!/usr/bin/env bash
# Simulated cluster on one Linux box: N network namespaces are N "nodes", each with its own
# address on a private network; a bridge in a hub namespace joins them, and `tc tbf` limits
# each node's link, so traffic between nodes is slow while ranks inside a node talk over
# loopback. Nothing is created in the host's network namespace: every interface lives in a
# namespace this script made, and the network has no route out.
#
#   tools/simcluster.sh up N [--inter-node-rate RATE] [--delay TIME]   create nodes 0..N-1
#   tools/simcluster.sh run NODE CMD [ARG ...]    run CMD inside node NODE (as that host)
#   tools/simcluster.sh addr NODE                 print node NODE's address
#   tools/simcluster.sh kill NODE                 crash node NODE: SIGKILL every process in it
#   tools/simcluster.sh status                    the nodes and their link limits
#   tools/simcluster.sh down                      delete everything `up` created
#
# RATE is a tc rate (200mbit, 1gbit; default: unlimited), TIME a tc time (50us, 1ms; needs
# the kernel's sch_netem). Node i has address 10.213.0.(i+1); run CMD sees
# GLOO_SOCKET_IFNAME=eth0 (gloo must use the node's interface) and SIMCLUSTER_NODE_ADDR, and
# its host name is the node's name. Needs root and iproute2 (ip, tc).
#
# Host names: node i is NAME-n<i> (its /etc/hosts lists every node, through iproute2's
# /etc/netns/NAME-n<i>/hosts, so MASTER_ADDR may be a node name as on a cluster).
#
# Environment: SIMCLUSTER_NAME names the cluster (default ptdpsim; it must start with
# "ptdpsim"): several clusters can exist side by side. `up` refuses to start if any namespace
# of that name exists; `down` deletes only the namespaces `up` recorded in
# /run/ptdpsim/NAME.nodes. A failed or interrupted `up` removes what it created.
#
# Example, 2 nodes x 4 ranks of the tiny GPT over a 200 Mbit/s link:
#   tools/simcluster.sh up 2 --inter-node-rate 200mbit
#   for n in 0 1; do
#     tools/simcluster.sh run $n env NNODES=2 NODE_RANK=$n MASTER_ADDR=10.213.0.1 \
#         GPUS_PER_NODE=4 tools/pretrain_gpt.sh configs/gpt_tiny.yaml parallel.pipeline=2 \
#         parallel.tensor=2 &
#   done; wait
#   tools/simcluster.sh down
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"

NAME="${SIMCLUSTER_NAME:-ptdpsim}"
STATE_DIR=/run/ptdpsim
STATE="$STATE_DIR/$NAME.nodes"
SUBNET=10.213.0
IFACE=eth0

die() { echo "simcluster.sh: error: $*" >&2; exit 2; }

[[ "$NAME" =~ ^ptdpsim[A-Za-z0-9_-]{0,20}$ ]] \
    || die "SIMCLUSTER_NAME='$NAME' must start with 'ptdpsim' (letters, digits, - and _ only, 27 characters at most)"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

need_tools() {
    [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces); run with sudo"
    command -v ip >/dev/null || die "needs iproute2 ('ip' not found)"
    command -v tc >/dev/null || die "needs iproute2 ('tc' not found)"
}

hub() { echo "$NAME-hub"; }
node_ns() { echo "$NAME-n$1"; }
addr() { echo "$SUBNET.$(($1 + 1))"; }

nodes_recorded() { [[ -f "$STATE" ]] && grep -v '^#' "$STATE" || true; }

node_count() {
    [[ -f "$STATE" ]] || die "no cluster '$NAME' (run: tools/simcluster.sh up N)"
    grep -c "^$NAME-n" "$STATE"
}

# --- down -----------------------------------------------------------------------------------
# Deletes only namespaces recorded by `up` (deleting a namespace deletes the interfaces in it).
down() {
    local ns
    for ns in $(nodes_recorded); do
        rm -rf "/etc/netns/$ns"
        if ip netns list | awk '{print $1}' | grep -qx -- "$ns"; then
            ip netns pids "$ns" 2>/dev/null | grep -q . \
                && echo "simcluster.sh: warning: processes still run in $ns: $(ip netns pids "$ns" | tr '\n' ' ')" >&2
            ip netns delete "$ns"
        fi
    done
    rm -f "$STATE"
}

# --- up -------------------------------------------------------------------------------------
limit_link() {   # limit_link NAMESPACE DEVICE
    local ns="$1" dev="$2" parent="root"
    if [[ -n "$DELAY" ]]; then
        tc -n "$ns" qdisc add dev "$dev" root handle 1: netem delay "$DELAY" 2>/dev/null \
            || die "--delay $DELAY: tc netem failed (is the sch_netem kernel module available?)"
        parent="parent 1:"
    fi
    if [[ -n "$RATE" ]]; then
        # burst: at least one 64 KiB segment, so tbf never drops a whole GSO packet;
        # latency bounds the queue (a deeper one only adds delay under TCP).
        # shellcheck disable=SC2086
        tc -n "$ns" qdisc add dev "$dev" $parent handle 2: tbf rate "$RATE" burst 256kb latency 20ms \
            || die "--inter-node-rate $RATE: tc tbf refused it (give a tc rate such as 200mbit)"
    fi
}

write_hosts() {   # `ip netns exec NS` shows /etc/netns/NS/hosts as the node's /etc/hosts
    local n="$1" i ns
    for i in $(seq 0 $((n - 1))); do
        ns="$(node_ns "$i")"
        mkdir -p "/etc/netns/$ns"
        { echo "127.0.0.1 localhost"
          for j in $(seq 0 $((n - 1))); do echo "$(addr "$j") $(node_ns "$j")"; done
        } > "/etc/netns/$ns/hosts"
    done
}

up() {
    local n="$1" i ns
    [[ "$n" =~ ^[1-9][0-9]*$ && "$n" -le 250 ]] || die "up N: N must be 1..250, got '$n'"
    [[ -e "$STATE" ]] && die "cluster '$NAME' is up already ($STATE); run: tools/simcluster.sh down"
    for ns in "$(hub)" $(for i in $(seq 0 $((n - 1))); do node_ns "$i"; done); do
        ip netns list | awk '{print $1}' | grep -qx -- "$ns" \
            && die "namespace $ns exists but was not made by this cluster; not touching it"
        [[ -e "/etc/netns/$ns" ]] && die "/etc/netns/$ns exists but was not made by this cluster; not touching it"
    done
    mkdir -p "$STATE_DIR"
    echo "# made by tools/simcluster.sh up $n${RATE:+ --inter-node-rate $RATE}${DELAY:+ --delay $DELAY}" > "$STATE"
    # Whatever ends `up` early (a failing command, die, Ctrl-C) removes what it made.
    trap 'echo "simcluster.sh: up failed or was interrupted; removing what it made" >&2; down' EXIT
    trap 'exit 130' INT TERM

    ip netns add "$(hub)" && echo "$(hub)" >> "$STATE"
    ip -n "$(hub)" link add br0 type bridge
    ip -n "$(hub)" link set br0 up
    for i in $(seq 0 $((n - 1))); do
        ns="$(node_ns "$i")"
        ip netns add "$ns" && echo "$ns" >> "$STATE"
        ip -n "$ns" link set lo up
        # The pair is born in the hub and its node end moved straight into the node.
        ip -n "$(hub)" link add "n$i" type veth peer name "$IFACE" netns "$ns"
        ip -n "$(hub)" link set "n$i" master br0
        ip -n "$(hub)" link set "n$i" up
        ip -n "$ns" addr add "$(addr "$i")/24" dev "$IFACE"
        ip -n "$ns" link set "$IFACE" up
        limit_link "$ns" "$IFACE"          # what the node sends
        limit_link "$(hub)" "n$i"          # what the node receives
    done
    write_hosts "$n"
    trap - EXIT INT TERM
    echo "simcluster.sh: cluster '$NAME' up: $n node(s) at $(addr 0)..$(addr $((n - 1))), link ${RATE:-unlimited}${DELAY:+, delay $DELAY}" >&2
}

status() {
    [[ -f "$STATE" ]] || { echo "no cluster '$NAME'"; return 0; }
    head -1 "$STATE" | sed 's/^# //'
    local i
    for i in $(seq 0 $(($(node_count) - 1))); do
        echo "node $i: $(node_ns "$i") $(addr "$i") $(tc -n "$(node_ns "$i")" qdisc show dev "$IFACE" | tr '\n' ';')"
    done
}

check_node() {
    local n; n="$(node_count)"
    [[ "$1" =~ ^[0-9]+$ && "$1" -lt "$n" ]] || die "NODE must be 0..$((n - 1)), got '$1'"
}

kill_node() {   # a node that dies at once: its processes get no chance to say goodbye
    check_node "$1"
    local pids; pids="$(ip netns pids "$(node_ns "$1")" | tr '\n' ' ')"
    [[ -n "${pids// /}" ]] && kill -KILL $pids 2>/dev/null || true
    echo "simcluster.sh: killed node $1 (pids ${pids:-none})" >&2
}

run() {
    local i="$1"; shift
    [[ $# -gt 0 ]] || die "run NODE CMD...: no command"
    check_node "$i"
    local env=(env "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$IFACE}" "SIMCLUSTER_NODE_ADDR=$(addr "$i")")
    if command -v unshare >/dev/null; then   # the node's own host name, as on a cluster
        exec ip netns exec "$(node_ns "$i")" unshare --uts "${env[@]}" \
            sh -c 'hostname "$0" && exec "$@"' "$(node_ns "$i")" "$@"
    fi
    exec ip netns exec "$(node_ns "$i")" "${env[@]}" "$@"
}

# --- arguments ------------------------------------------------------------------------------
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
cmd="$1"; shift
case "$cmd" in
    -h|--help|help) usage ;;
    up)
        [[ $# -ge 1 ]] || die "usage: tools/simcluster.sh up N [--inter-node-rate RATE] [--delay TIME]"
        count="$1"; shift
        RATE="" DELAY=""
        while [[ $# -gt 0 ]]; do
            case "$1" in
                --inter-node-rate) [[ $# -ge 2 ]] || die "--inter-node-rate needs a value"; RATE="$2"; shift 2 ;;
                --delay) [[ $# -ge 2 ]] || die "--delay needs a value"; DELAY="$2"; shift 2 ;;
                *) die "up: unknown argument '$1'" ;;
            esac
        done
        need_tools
        up "$count" ;;
    down) need_tools; down ;;
    run) [[ $# -ge 1 ]] || die "usage: tools/simcluster.sh run NODE CMD..."; need_tools; run "$@" ;;
    kill) [[ $# -eq 1 ]] || die "usage: tools/simcluster.sh kill NODE"; need_tools; kill_node "$1" ;;
    addr) [[ $# -eq 1 && "$1" =~ ^[0-9]+$ ]] || die "usage: tools/simcluster.sh addr NODE"; addr "$1" ;;
    status) status ;;
    *) die "unknown command '$cmd' (up, run, kill, addr, status, down)" ;;
esac
