#!/usr/bin/env bash
# A cluster of N "machines" on this one, for the multi-machine tests and for trying
# `ivme launch --hostfile` without real machines.
#
# Each machine is a Linux network namespace with its own address on a private network
# (10.213.0.0/24, which exists only inside these namespaces: nothing is routed to or from the
# host), its own hostname (a UTS namespace) and its own /dev/shm (a mount namespace with a
# fresh tmpfs), as real machines have, and an sshd that accepts the cluster's own key. The
# machines are joined by a bridge that lives in a namespace of its own. Files are shared (the
# same root file system), so a program built here is at the same path on every machine.
#
#   scripts/cluster.sh up N [NETEM...]   build N machines (2..8); NETEM shapes every machine's
#                                        link with `tc netem`, e.g. `rate 1gbit delay 1ms`
#   scripts/cluster.sh exec I CMD...     run CMD on machine I (0 is the main machine), with the
#                                        cluster's ssh settings for mpirun in its environment
#   scripts/cluster.sh link I up|down    bring machine I's link up or down
#   scripts/cluster.sh down              stop every process of every machine and remove them
#
# `up` writes $IVME_CLUSTER_DIR (default /tmp/ivme-cluster): `hostfile` (one `ADDRESS
# slots=2` line per machine) and `ssh_config`. It is idempotent (it takes down what an earlier
# run left first). Where namespaces cannot be made (not root, no sshd, a sandbox that forbids
# them) it exits with 77 and says why, so a test can skip.
set -euo pipefail

DIR="${IVME_CLUSTER_DIR:-/tmp/ivme-cluster}"
NET=10.213.0
BRIDGE_NS=ivme-cbr
PREFIX=ivme-c

skip() {
  echo "cluster: cannot build a cluster here: $*" >&2
  exit 77
}

machines() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" || true
}

check() {
  [ "$(id -u)" -eq 0 ] || skip "making network namespaces needs root"
  for tool in ip unshare nsenter ssh ssh-keygen; do
    command -v "$tool" >/dev/null || skip "$tool is missing (scripts/setup.sh installs it)"
  done
  [ -x /usr/sbin/sshd ] || skip "/usr/sbin/sshd is missing (scripts/setup.sh installs openssh-server)"
  ip netns add "${PREFIX}probe" 2>/dev/null || skip "this system does not allow network namespaces"
  ip netns del "${PREFIX}probe"
}

down() {
  for m in $(machines) "$BRIDGE_NS"; do
    if ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$m"; then
      # Every process of the machine: its sshd, and whatever ssh sessions started.
      for pid in $(ip netns pids "$m" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$m" 2>/dev/null || true
    fi
  done
  rm -rf "$DIR"
}

up() {
  local n=$1
  shift
  local netem="$*"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le 8 ] || {
    echo "cluster: up takes 2 to 8 machines, not '$n'" >&2
    exit 2
  }
  check
  down
  mkdir -p "$DIR" /run/sshd
  ssh-keygen -q -t ed25519 -N '' -C ivme-cluster -f "$DIR/id"
  ssh-keygen -q -t ed25519 -N '' -C ivme-cluster-host -f "$DIR/host_key"
  cp "$DIR/id.pub" "$DIR/authorized_keys"
  cat >"$DIR/ssh_config" <<EOF
Host *
  User root
  IdentityFile $DIR/id
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
  ConnectTimeout 5
EOF
  ip netns add "$BRIDGE_NS"
  ip -n "$BRIDGE_NS" link set lo up
  ip -n "$BRIDGE_NS" link add br0 type bridge
  ip -n "$BRIDGE_NS" link set br0 up
  : >"$DIR/hostfile"
  for i in $(seq 0 $((n - 1))); do
    local m="$PREFIX$i" addr="$NET.$((i + 1))"
    ip netns add "$m"
    ip link add "v$i" netns "$m" type veth peer name "p$i" netns "$BRIDGE_NS"
    ip -n "$BRIDGE_NS" link set "p$i" master br0
    ip -n "$BRIDGE_NS" link set "p$i" up
    ip -n "$m" link set lo up
    ip -n "$m" addr add "$addr/24" dev "v$i"
    ip -n "$m" link set "v$i" up
    if [ -n "$netem" ]; then
      # shellcheck disable=SC2086
      if ! ip netns exec "$m" tc qdisc add dev "v$i" root netem $netem 2>"$DIR/tc.err"; then
        local why
        why=$(cat "$DIR/tc.err")
        down
        skip "tc netem $netem: $why (this kernel may lack the sch_netem module)"
      fi
    fi
    cat >"$DIR/sshd_$i.conf" <<EOF
ListenAddress $addr
HostKey $DIR/host_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
AuthorizedKeysFile $DIR/authorized_keys
StrictModes no
UsePAM no
PidFile none
EOF
    # `ip netns exec`, `unshare` and `sh` each exec the next, so $! is sshd's own pid: the
    # process whose namespaces `exec` enters.
    ip netns exec "$m" unshare --uts --mount --propagation private sh -c \
      "hostname $m && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec /usr/sbin/sshd -D -e -f $DIR/sshd_$i.conf" \
      >"$DIR/sshd_$i.log" 2>&1 &
    echo $! >"$DIR/machine_$i.pid"
    echo "$addr slots=2" >>"$DIR/hostfile"
  done
  echo "$n" >"$DIR/size"
  # Each sshd answers from the main machine before `up` returns.
  for i in $(seq 0 $((n - 1))); do
    local ok=""
    for _ in $(seq 50); do
      if in_machine 0 ssh -F "$DIR/ssh_config" "$NET.$((i + 1))" hostname >/dev/null 2>&1; then
        ok=1
        break
      fi
      sleep 0.1
    done
    [ -n "$ok" ] || {
      echo "cluster: machine $i's sshd does not answer; its log:" >&2
      cat "$DIR/sshd_$i.log" >&2
      down
      exit 1
    }
  done
  echo "cluster: $n machines up; hostfile $DIR/hostfile"
}

in_machine() {
  local i=$1
  shift
  local pid
  pid=$(cat "$DIR/machine_$i.pid" 2>/dev/null) || {
    echo "cluster: there is no machine $i (run scripts/cluster.sh up N first)" >&2
    exit 2
  }
  # mpirun starts the other machines' daemons with this ssh.
  OMPI_MCA_plm_rsh_agent="ssh -F $DIR/ssh_config" \
    nsenter --target "$pid" --net --uts --mount -- "$@"
}

link() {
  local i=$1 state=$2
  ip -n "$PREFIX$i" link set "v$i" "$state"
}

case "${1:-}" in
up) shift && up "$@" ;;
down) down ;;
exec) shift && in_machine "$@" ;;
link) shift && link "$@" ;;
*)
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
  ;;
esac
