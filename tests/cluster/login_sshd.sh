#!/bin/bash
# login_sshd.sh — a login node with a real OpenSSH server (Debian's openssh-server) for the remote tests.
#
#   The login node is its own network namespace (hpctrain-login, 10.77.0.200 on the lab bridge of slurm.sh):
#   sbatch/sacct there reach slurmctld at 10.77.0.254 like the root namespace does, and the root namespace is
#   the "laptop" that reaches it only through sshd. Key-only auth (no passwords, no PAM), root login by key.
#
# usage: login_sshd.sh install | up DIR | down DIR | restart DIR
#   install  apt-get openssh-server and rsync (skipped when both are present; apt starts no daemon: policy-rc.d)
#   up       create DIR/{host_ed25519,client_ed25519,authorized_keys,sshd_config,known_hosts,ssh_config} once,
#            create the namespace if missing and start sshd (PID in DIR/sshd.pid); waits <= 20 s for port 22
#   down     stop that sshd (only the PID it recorded) and every sshd session process of the namespace;
#            remove the namespace
#   restart  down without removing the namespace, then up (after the host key was changed, say)
#
# Needs: the lab bridge (slurm.sh up), openssh-server (slurm.sh install or `apt-get install openssh-server`).
set -euo pipefail

NS=${LOGIN_NS:-hpctrain-login}  # another name, VETH and LOGIN_IP: a second login node beside the tests' one
VETH=${LOGIN_VETH:-vhpclogin0}
BR=hpcslrmbr0
IP=${LOGIN_IP:-10.77.0.200}
CMD=${1:-}
DIR=${2:-}
[ "$CMD" = install ] || [ -n "$DIR" ] || {
  echo "usage: $0 install | up|down|restart DIR" >&2
  exit 2
}
SSHD=/usr/sbin/sshd

die() {
  echo "login_sshd.sh: ERROR: $*" >&2
  exit 1
}

keys() {
  mkdir -p "$DIR"
  chmod 700 "$DIR"
  [ -f "$DIR/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C login-host -f "$DIR/host_ed25519"
  [ -f "$DIR/client_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C laptop -f "$DIR/client_ed25519"
  cp "$DIR/client_ed25519.pub" "$DIR/authorized_keys"
  chmod 600 "$DIR/authorized_keys"
  printf '%s %s\n' "$IP" "$(cut -d' ' -f1,2 "$DIR/host_ed25519.pub")" >"$DIR/known_hosts"
  cat >"$DIR/sshd_config" <<EOF
ListenAddress $IP
Port 22
HostKey $DIR/host_ed25519
PidFile $DIR/sshd.pid
AuthorizedKeysFile $DIR/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
MaxSessions 50
MaxStartups 50
LogLevel VERBOSE
Subsystem sftp internal-sftp
EOF
  cat >"$DIR/ssh_config" <<EOF
Host login
  HostName $IP
  User root
  IdentityFile $DIR/client_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $DIR/known_hosts
  StrictHostKeyChecking yes
  LogLevel ERROR
EOF
}

net_up() {
  ip link show "$BR" >/dev/null 2>&1 || die "no lab bridge $BR: run tests/cluster/slurm.sh up first"
  [ -e "/run/netns/$NS" ] || ip netns add "$NS"
  if ! ip -n "$NS" link show eth0 >/dev/null 2>&1; then
    ip link del "$VETH" 2>/dev/null || true
    ip link add "$VETH" type veth peer name eth0 netns "$NS"
  fi
  ip link set "$VETH" master "$BR" up
  ip -n "$NS" addr replace "$IP/24" dev eth0
  ip -n "$NS" link set eth0 up
  ip -n "$NS" link set lo up
}

stop() {
  local p
  if [ -s "$DIR/sshd.pid" ]; then
    p=$(tr -dc 0-9 <"$DIR/sshd.pid")
    if [ -n "$p" ] && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = sshd ]; then kill -KILL "$p" 2>/dev/null || true; fi
    rm -f "$DIR/sshd.pid"
  fi
  # the per-connection sshd processes of this namespace (never the jobs or submits they started)
  for p in $(ip netns pids "$NS" 2>/dev/null || true); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = sshd ] && kill -KILL "$p" 2>/dev/null || true
  done
}

start() {
  [ -x "$SSHD" ] || die "no $SSHD: apt-get install openssh-server (tests/cluster/slurm.sh install does)"
  mkdir -p /run/sshd
  "$SSHD" -t -f "$DIR/sshd_config" || die "sshd rejects $DIR/sshd_config"
  nsenter --net="/run/netns/$NS" "$SSHD" -f "$DIR/sshd_config" -E "$DIR/sshd.log"
  local _
  for _ in $(seq 200); do
    if [ -s "$DIR/sshd.pid" ] && timeout 1 bash -c "exec 3<>/dev/tcp/$IP/22" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  die "sshd did not listen on $IP:22 within 20 s; log: $DIR/sshd.log"
}

install() {
  [ -x "$SSHD" ] && command -v rsync >/dev/null && return 0
  local made=0 rc=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then # apt must not start sshd by itself
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    made=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get -o Acquire::Retries=3 install -y -qq --no-install-recommends \
    openssh-server openssh-client rsync </dev/null >/tmp/hpctrain-sshd-apt.log 2>&1 || rc=$?
  if [ $made = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  [ $rc = 0 ] || die "apt-get failed (rc $rc); log: /tmp/hpctrain-sshd-apt.log"
}

case "$CMD" in
install) install ;;
up)
  keys
  net_up
  stop
  start
  ;;
restart)
  stop
  start
  ;;
down)
  stop
  ip link del "$VETH" 2>/dev/null || true
  ip netns del "$NS" 2>/dev/null || true
  ;;
*) die "unknown command $CMD" ;;
esac
