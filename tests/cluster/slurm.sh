#!/bin/bash
# slurm.sh — a real 4-node SLURM cluster on one Debian 12 machine, for hpctrain's tests and demos.
#
#   munged, a private MariaDB (127.0.0.1:3307), slurmdbd (:6819) and slurmctld (:6817) run in the root
#   network namespace (bridge IP 10.77.0.254); each slurmd runs in its own network + UTS namespace
#   (hostname nodeN, IP 10.77.0.N), all sharing the filesystem like NFS on a real cluster.
#   State, configs, logs and PID files live under $LAB (default /tmp/hpctrain-slurm);
#   /etc/slurm/*.conf are symlinks into $LAB/etc so plain sbatch/sacct/submitit need no SLURM_CONF.
#
# usage: slurm.sh install | up | down | wipe | status | kill-node N | restart-node N | slow-net N RATE|off
#
#   install        apt-get the packages (skipped when every binary is already present)
#   up [--keep|--no-keep]  start everything (idempotent; recovers a broken or half-started lab). --keep
#                  marks the lab as shared ($LAB/keep, survives down; wipe or --no-keep clear it): a pytest
#                  session that (re)starts the cluster then leaves it running at its end
#   down           stop the daemons this script started, kill job processes left in the node namespaces,
#                  remove namespaces, bridge and the /etc/hosts block. Keeps DB + state (job ids continue).
#   wipe           down, then delete state, DB, logs and configs
#   status         print daemons and node states; exit 0 if the cluster is healthy, 3 if the only fault is
#                  nodes stopped on purpose with kill-node (a test is exercising node failure), else 1
#   kill-node N    kill -9 every process in nodeN's namespace (a powered-off node)
#   restart-node N start nodeN's slurmd again
#   slow-net N RATE   limit nodeN's link both ways to RATE (tc's units: 40mbit) with a token bucket: a bad cable
#                  or a degraded port, for the health check's tests; `slow-net N off` restores it
#
# Environment: LAB, NNODES (4), NODE_CPUS (2), NODE_MEM (8000 MB), SLURMD_TIMEOUT (30), FAKE_GPUS (0: off;
#   N>0 advertises N fake GPUs per node as GRES, backed by /dev/tty0..N-1), UP_TIMEOUT (120 s),
#   LAB_CPU_SHARES (4096; 0: off): the CPU weight of the lab's daemons and so of every job they start (see
#   cpu_group_enter), against 1024 for each of the machine's other sessions.
#
# Only PIDs recorded in $LAB/run (and checked by process name) or processes inside the lab's own namespaces
# are ever signalled.
set -euo pipefail

LAB=${LAB:-/tmp/hpctrain-slurm}
NNODES=${NNODES:-4}
NET=${NET_PREFIX:-10.77.0}
CTL_IP=$NET.254
BR=hpcslrmbr0
NS=hpctrain-node
VETH=vhpcn
CPUS=${NODE_CPUS:-2}
MEM=${NODE_MEM:-8000}
GPUS=${FAKE_GPUS:-0}
SLURMD_TIMEOUT=${SLURMD_TIMEOUT:-30}
UP_TIMEOUT=${UP_TIMEOUT:-120}
DB=$LAB/mysql
RUN=$LAB/run
LOG=$LAB/logs
ST=$LAB/state
ETC=$LAB/etc
LOCK=${LAB%/}.lock
KEEP_FLAG=$LAB/keep
HOSTS_BEGIN="# hpctrain-slurm-begin"
HOSTS_END="# hpctrain-slurm-end"
CONF_FILES=(slurm.conf slurmdbd.conf cgroup.conf gres.conf)
BINARIES=(slurmctld slurmd slurmdbd sbatch srun sacct sacctmgr scontrol sinfo squeue scancel munged munge
  unmunge mariadbd mariadb mariadb-install-db ip nsenter unshare runuser ss flock hostname)

say() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() {
  echo "slurm.sh: ERROR: $*" >&2
  exit 1
}
usage() {
  echo "usage: $0 install|up [--keep|--no-keep]|down|wipe|status|kill-node N|restart-node N|slow-net N RATE|off" >&2
  exit 2
}

# --- processes ------------------------------------------------------------------------------------------
alive() { # PID $1 exists and is not a zombie (init reaps re-parented daemons late)
  local s
  s=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) && [ -n "$s" ] && [ "$s" != Z ]
}
comm_of() { cat "/proc/$1/comm" 2>/dev/null || true; }
# ours PIDFILE COMM: the PID file names a live process called COMM (guards against PID reuse)
ours() {
  local f=$1 c=$2 p
  [ -s "$f" ] || return 1
  p=$(tr -dc 0-9 <"$f")
  [ -n "$p" ] && alive "$p" && [ "$(comm_of "$p")" = "$c" ]
}
stop_pid() { # stop_pid PIDFILE COMM: SIGTERM, wait <= 15 s, SIGKILL; only if the PID is still ours
  local f=$1 c=$2 p
  if ours "$f" "$c"; then
    p=$(tr -dc 0-9 <"$f")
    kill -TERM "$p" 2>/dev/null || true
    for _ in $(seq 150); do alive "$p" || break; sleep 0.1; done
    if alive "$p"; then kill -KILL "$p" 2>/dev/null || true; fi
  fi
  rm -f "$f"
}
ns_pids() { ip netns pids "$NS$1" 2>/dev/null || true; }
kill_ns() { # kill -9 every process in node $1's network namespace (slurmd, slurmstepd, job tasks)
  local p
  p=$(ns_pids "$1")
  if [ -n "$p" ]; then
    # shellcheck disable=SC2086 # word splitting of the PID list is intended
    kill -KILL $p 2>/dev/null || true
  fi
}

# --- checks ---------------------------------------------------------------------------------------------
need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it creates network namespaces and edits /etc/hosts); try: sudo $0 ${CMD:-}"; }
need_bins() {
  local b missing=()
  for b in "${BINARIES[@]}"; do command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b"); done
  [ ${#missing[@]} = 0 ] || die "missing programs: ${missing[*]}; run: bash $0 install"
}
need_netns() {
  local probe=hpctrain-probe-$$
  ip netns list >/dev/null 2>&1 || die "no 'ip netns' support (iproute2 too old or /run/netns unusable)"
  [ -e "/run/netns/${NS}1" ] && return 0
  ip netns add "$probe" 2>/dev/null || die "cannot create a network namespace ('ip netns add' failed): this machine or container forbids it (needs CAP_SYS_ADMIN and CONFIG_NET_NS)"
  if ! ip link add hpcprobe0 type veth peer name hpcprobe1 netns "$probe" 2>/dev/null; then
    ip netns del "$probe" 2>/dev/null || true
    die "cannot create veth pairs into a network namespace (kernel lacks veth support?)"
  fi
  ip link del hpcprobe0 2>/dev/null || true
  ip netns del "$probe" 2>/dev/null || true
}
# check_port PORT PIDFILE COMM: refuse when something that is not our daemon listens on PORT (root netns)
check_port() {
  local port=$1 f=$2 c=$3 line pids p mine=""
  line=$(ss -Hltnp "sport = :$port" 2>/dev/null || true)
  [ -n "$line" ] || return 0
  if [ -n "$f" ] && ours "$f" "$c"; then mine=$(tr -dc 0-9 <"$f"); fi
  pids=$(grep -o 'pid=[0-9]*' <<<"$line" | cut -d= -f2 | sort -u || true)
  for p in $pids; do
    [ "$p" = "$mine" ] && continue
    die "port $port is taken by PID $p ($(comm_of "$p"): $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-120)), which this lab did not start (no PID file under $RUN names it); stop it or free the port. If it is a leftover of this lab whose PID files were deleted: kill $p"
  done
  [ -n "$pids" ] || [ -n "$mine" ] || die "port $port is in use by a process this lab did not start (ss: $line)"
}
check_ports() {
  check_port 6817 "$RUN/slurmctld.pid" slurmctld
  check_port 6818 "" ""
  check_port 6819 "$RUN/slurmdbd.pid" slurmdbd
  check_port 3307 "$RUN/mariadb.pid" mariadbd
}

# --- install --------------------------------------------------------------------------------------------
install_pkgs() {
  need_root
  local b missing=() made=0 t0=$SECONDS
  for b in "${BINARIES[@]}"; do command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b"); done
  if [ ${#missing[@]} = 0 ]; then
    say "install: all programs present, nothing to do"
    return 0
  fi
  say "install: missing ${missing[*]}; installing Debian packages"
  export DEBIAN_FRONTEND=noninteractive
  # apt must not start munge/mariadb/slurm by itself (no systemd here; this script tracks its own PIDs)
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    made=1
  fi
  local rc=0
  {
    apt-get -o Acquire::Retries=3 update -qq &&
      apt-get -o Acquire::Retries=3 install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confdef \
        -o Dpkg::Options::=--force-confold slurm-wlm slurmctld slurmd slurm-client slurmdbd munge \
        mariadb-server iproute2 util-linux hostname </dev/null >"/tmp/hpctrain-slurm-apt.log" 2>&1
  } || rc=$?
  if [ $made = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  if [ $rc != 0 ]; then
    tail -n 30 /tmp/hpctrain-slurm-apt.log >&2 || true
    die "apt-get failed (rc $rc); full log: /tmp/hpctrain-slurm-apt.log"
  fi
  say "install: done in $((SECONDS - t0)) s"
}

# --- network --------------------------------------------------------------------------------------------
hosts_block_remove() {
  if grep -qF "$HOSTS_BEGIN" /etc/hosts 2>/dev/null; then
    # /etc/hosts may be a bind mount (containers): rewrite in place, never replace the inode
    local tmp
    tmp=$(sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" /etc/hosts)
    printf '%s\n' "$tmp" >/etc/hosts
  fi
}
net_up() {
  ip link show "$BR" >/dev/null 2>&1 || ip link add "$BR" type bridge
  ip addr replace "$CTL_IP/24" dev "$BR"
  ip link set "$BR" up
  local i
  for i in $(seq "$NNODES"); do
    [ -e "/run/netns/$NS$i" ] || ip netns add "$NS$i"
    if ! ip -n "$NS$i" link show eth0 >/dev/null 2>&1; then
      ip link del "$VETH$i" 2>/dev/null || true
      ip link add "$VETH$i" type veth peer name eth0 netns "$NS$i"
    fi
    ip link set "$VETH$i" master "$BR" up
    ip -n "$NS$i" addr replace "$NET.$i/24" dev eth0
    ip -n "$NS$i" link set eth0 up
    ip -n "$NS$i" link set lo up
  done
  hosts_block_remove
  {
    echo "$HOSTS_BEGIN"
    for i in $(seq "$NNODES"); do echo "$NET.$i node$i"; done
    echo "$HOSTS_END"
  } >>/etc/hosts
}
net_down() {
  local i
  for i in $(seq "$NNODES"); do
    ip link del "$VETH$i" 2>/dev/null || true
    ip netns del "$NS$i" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
  hosts_block_remove
}

# --- configuration --------------------------------------------------------------------------------------
gen_slurm_conf() {
  local host=$1 gres="" i
  cat <<EOF
# generated by tests/cluster/slurm.sh — do not edit (rewritten on every 'up')
ClusterName=lab
SlurmctldHost=$host($CTL_IP)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$ST/ctld
SlurmdSpoolDir=$ST/slurmd.%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=$SLURMD_TIMEOUT
InactiveLimit=0
KillWait=5
MinJobAge=300
AuthInfo=cred_expire=10
JobRequeue=1
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL_IP
AccountingStoragePort=6819
EOF
  if [ "$GPUS" -gt 0 ]; then
    echo "GresTypes=gpu"
    gres="Gres=gpu:$GPUS "
  fi
  for i in $(seq "$NNODES"); do
    echo "NodeName=node$i NodeAddr=$NET.$i CPUs=$CPUS RealMemory=$MEM ${gres}State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}
write_conf() { # sets CONF_CHANGED=1 when slurm.conf or gres.conf differ from what the daemons were started with
  local host i new
  host=$(hostname -s)
  mkdir -p "$ETC" "$RUN" "$LOG" "$ST/ctld"
  for i in $(seq "$NNODES"); do mkdir -p "$ST/slurmd.node$i"; done
  case "$GPUS" in '' | *[!0-9]*) die "FAKE_GPUS must be a number, got '$GPUS'" ;; esac
  [ "$GPUS" -le 8 ] || die "FAKE_GPUS=$GPUS: at most 8 fake GPUs per node (/dev/tty0..7)"
  CONF_CHANGED=0
  new=$(gen_slurm_conf "$host")
  if [ "$new" != "$(cat "$ETC/slurm.conf" 2>/dev/null)" ]; then
    printf '%s\n' "$new" >"$ETC/slurm.conf"
    CONF_CHANGED=1
  fi
  if [ "$GPUS" -gt 0 ]; then
    new=$(printf 'AutoDetect=off\nNodeName=node[1-%s] Name=gpu File=/dev/tty[0-%s]' "$NNODES" $((GPUS - 1)))
  else
    new=""
  fi
  if [ "$new" != "$(cat "$ETC/gres.conf" 2>/dev/null)" ] || [ ! -e "$ETC/gres.conf" ]; then
    if [ -n "$new" ]; then printf '%s\n' "$new" >"$ETC/gres.conf"; else : >"$ETC/gres.conf"; fi
    CONF_CHANGED=1
  fi
  cat >"$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=$host
DbdAddr=$CTL_IP
DbdPort=6819
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$ETC/slurmdbd.conf"
  echo "CgroupPlugin=autodetect" >"$ETC/cgroup.conf"
  mkdir -p /etc/slurm
  local f
  for f in "${CONF_FILES[@]}"; do ln -sfn "$ETC/$f" "/etc/slurm/$f"; done
}

# --- daemons --------------------------------------------------------------------------------------------
STARTED=()
start_munge() {
  ours "$RUN/munged.pid" munged && return 0
  if ours /run/munge/munged.pid munged && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0 # a munged this lab did not start already serves /run/munge: use it, never stop it
  fi
  mkdir -p /run/munge
  chown munge:munge /run/munge
  chmod 755 /run/munge
  [ -s /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (the munge package creates it); run: bash $0 install"
  # --force: a socket left by a killed munged would otherwise stop it from starting
  runuser -u munge -- /usr/sbin/munged --force --pid-file=/run/munge/munged.pid 9>&- </dev/null >"$LOG/munged.start.log" 2>&1 ||
    die "munged did not start: $(cat "$LOG/munged.start.log")"
  for _ in $(seq 50); do [ -S /run/munge/munge.socket.2 ] && ours /run/munge/munged.pid munged && break; sleep 0.1; done
  cp /run/munge/munged.pid "$RUN/munged.pid"
  STARTED+=(munged)
  munge -n | unmunge >/dev/null || die "munge does not work (munge -n | unmunge failed)"
}
sql() { mariadb --no-defaults -S "$DB/mysqld.sock" -uroot "$@"; }
start_mariadb() {
  ours "$RUN/mariadb.pid" mariadbd && return 0
  mkdir -p "$DB"
  if [ ! -d "$DB/data/mysql" ]; then
    rm -rf "$DB/data"
    mariadb-install-db --no-defaults --datadir="$DB/data" --user=root --skip-test-db \
      </dev/null >"$LOG/mariadb-install.log" 2>&1 || die "mariadb-install-db failed: see $LOG/mariadb-install.log"
  fi
  rm -f "$DB/mysqld.sock" "$RUN/mariadb.pid"
  nohup /usr/sbin/mariadbd --no-defaults --user=root --datadir="$DB/data" --socket="$DB/mysqld.sock" \
    --pid-file="$RUN/mariadb.pid" --bind-address=127.0.0.1 --port=3307 --skip-name-resolve \
    --log-error="$LOG/mariadb.err" --innodb-buffer-pool-size=256M --innodb-log-file-size=64M \
    --innodb-lock-wait-timeout=900 --performance-schema=OFF 9>&- </dev/null >/dev/null 2>&1 &
  echo $! >"$RUN/mariadb.pid" # mariadbd rewrites it with the same PID; written now so a failure can stop it
  STARTED+=(mariadbd)
  for _ in $(seq 300); do sql -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
  sql -e 'select 1' >/dev/null 2>&1 || die "mariadb did not start (see $LOG/mariadb.err)"
  sql -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
}
start_slurmdbd() {
  if ! ours "$RUN/slurmdbd.pid" slurmdbd; then
    rm -f "$RUN/slurmdbd.pid"
    slurmdbd 9>&- </dev/null >"$LOG/slurmdbd.start.log" 2>&1 || die "slurmdbd did not start: $(cat "$LOG/slurmdbd.start.log")"
    STARTED+=(slurmdbd)
  fi
  for _ in $(seq 150); do timeout 5 sacctmgr -n show cluster >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "slurmdbd is not answering (see $LOG/slurmdbd.log)"
}
ctld_up() { [[ "$(timeout 5 scontrol ping 2>/dev/null)" == *'is UP'* ]]; }
start_slurmctld() {
  if ! ours "$RUN/slurmctld.pid" slurmctld; then
    rm -f "$RUN/slurmctld.pid"
    CTLD_STARTED_AT=$(date +%Y-%m-%dT%H:%M:%S)
    slurmctld -i 9>&- </dev/null >"$LOG/slurmctld.start.log" 2>&1 || die "slurmctld did not start: $(cat "$LOG/slurmctld.start.log")"
    STARTED+=(slurmctld)
  fi
  for _ in $(seq 150); do ctld_up && return 0; sleep 0.2; done
  die "slurmctld is not up (see $LOG/slurmctld.log)"
}
start_node() { # slurmd for node $1 in its netns, in its own UTS namespace so `hostname` == nodeN
  local i=$1 pf="$RUN/slurmd.node$1.pid"
  ours "$pf" slurmd && return 0
  rm -f "$pf"
  [ -e "/run/netns/$NS$i" ] || die "namespace $NS$i is missing; run: bash $0 up"
  nsenter --net="/run/netns/$NS$i" -- unshare --uts -- sh -c "hostname node$i && exec /usr/sbin/slurmd -N node$i" \
    9>&- </dev/null >"$LOG/slurmd.node$i.start.log" 2>&1 || die "slurmd node$i did not start: $(cat "$LOG/slurmd.node$i.start.log")"
  STARTED+=("slurmd.node$i")
  rm -f "$RUN/killed.node$i"
  for _ in $(seq 50); do [ -s "$pf" ] && break; sleep 0.1; done
  ours "$pf" slurmd || die "slurmd node$i exited (see $LOG/slurmd.node$i.log)"
}
stop_slurm() { # slurmd x N and slurmctld, not DB / slurmdbd / munge
  local i
  for i in $(seq "$NNODES"); do stop_pid "$RUN/slurmd.node$i.pid" slurmd; done
  stop_pid "$RUN/slurmctld.pid" slurmctld
}

# --- node health ----------------------------------------------------------------------------------------
# node_states: "nodeN STATE" lines from sinfo ("*" suffix = not responding)
node_states() { timeout 10 sinfo -h -N -p debug -o '%N %T' 2>/dev/null | sort -u; }
healthy_count() {
  node_states | awk '$2 ~ /^(idle|allocated|mixed|completing|planned|reserved)$/' | wc -l
}
wait_nodes() {
  local deadline=$((SECONDS + $1)) resumed=0 name st
  while [ $SECONDS -lt $deadline ]; do
    [ "$(healthy_count)" -ge "$NNODES" ] && return 0
    # a node left DOWN/DRAINED by an earlier failure returns once its slurmd answers (ReturnToService=2
    # covers "not responding"; an explicit down/drain needs a resume)
    if [ $resumed = 0 ] && [ $((deadline - SECONDS)) -lt $(($1 - 5)) ]; then
      while read -r name st; do
        case "$st" in down | drained | draining | fail | failing) timeout 5 scontrol update nodename="$name" state=resume 2>/dev/null || true ;; esac
      done < <(node_states)
      resumed=1
    fi
    sleep 0.2
  done
  return 1
}

# reap_ghosts: a slurmctld that died by SIGKILL (or with the machine) loses the state of the last seconds, so a
# job that had ended comes back RUNNING from its saved state. It holds its nodes until its time limit (an srun
# -N4 -t 2 ended just before the kill blocked the next 4-node job for 2 min). A job that started before this
# slurmctld and has no slurmstepd anywhere (the nodes share this PID namespace) ran under the dead one and is
# gone: cancel it. A live job keeps its slurmstepd through a slurmd or slurmctld restart, so it is kept.
reap_ghosts() {
  local id start ghosts=()
  while read -r id start; do
    [[ "$start" < "$CTLD_STARTED_AT" ]] || continue
    pgrep -f "^slurmstepd: \[$id\." >/dev/null || ghosts+=("$id")
  done < <(timeout 10 squeue -h -t RUNNING -o '%A %S' 2>/dev/null)
  [ ${#ghosts[@]} = 0 ] && return 0
  timeout 10 scancel "${ghosts[@]}" 2>/dev/null || true
  say "cancelled ${#ghosts[@]} job(s) the restarted slurmctld recovered as running with no process left: ${ghosts[*]}"
}

# --- commands -------------------------------------------------------------------------------------------
CPU_GROUP=hpctrain-lab
cpu_group_enter() { # this shell, and every daemon it starts from now on, into the lab's CPU cgroup
  # The lab's jobs are what a test of them waits on, and the kernel shares the CPU between sessions (autogroup):
  # each job step is one session, as is each of the machine's other busy programs (a test worker's local
  # DeepSpeed runs, a build). A weight of LAB_CPU_SHARES against their 1024 lets the jobs run nearly as fast
  # as on an idle machine while the others use what the jobs leave; an idle lab takes nothing from anyone.
  # Best effort: without a writable cpu controller (a container, cgroup v2 without +cpu) nothing changes.
  local shares=${LAB_CPU_SHARES:-4096} dir pidfile pid
  case "$shares" in '' | *[!0-9]*) die "LAB_CPU_SHARES must be a number (0: off), got '$shares'" ;; esac
  [ "$shares" -gt 0 ] || return 0
  if [ -w /sys/fs/cgroup/cpu/cgroup.procs ]; then # v1
    dir=/sys/fs/cgroup/cpu/$CPU_GROUP
    mkdir -p "$dir" 2>/dev/null && echo "$shares" >"$dir/cpu.shares" 2>/dev/null || return 0
  elif [ -e /sys/fs/cgroup/cgroup.controllers ]; then # v2: cpu.weight 100 is v1's 1024
    dir=/sys/fs/cgroup/$CPU_GROUP
    echo +cpu >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
    mkdir -p "$dir" 2>/dev/null && echo $((shares * 100 / 1024)) >"$dir/cpu.weight" 2>/dev/null || return 0
  else
    return 0
  fi
  echo "$BASHPID" >"$dir/cgroup.procs" 2>/dev/null || return 0
  for pidfile in "$RUN"/*.pid; do # daemons started before (an older lab): their next jobs go in too
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    alive "$pid" && echo "$pid" >"$dir/cgroup.procs" 2>/dev/null || true
  done
}
lock() { # serialize up/down/wipe/kill-node/restart-node between concurrent callers (4 engineers, pytest).
  # Every daemon is started with 9>&-: an inherited fd would hold the lock for the daemon's lifetime.
  exec 9>"$LOCK"
  flock -w 300 9 || die "another slurm.sh holds $LOCK for more than 300 s"
}
up_failed() {
  local rc=$?
  trap - ERR EXIT
  [ $rc = 0 ] && return 0
  if [ ${#STARTED[@]} -gt 0 ] || [ "${NET_CREATED:-0}" = 1 ]; then
    # it had to start something, so the cluster was not whole before: stop all of it, never leave half
    echo "slurm.sh: 'up' failed; tearing the lab down (this run had started: ${STARTED[*]:-the network})" >&2
    tail -n 15 "$LOG/slurmctld.log" "$LOG/slurmdbd.log" "$LOG/mariadb.err" 2>/dev/null >&2 || true
    down_all >/dev/null 2>&1 || true
  else
    echo "slurm.sh: 'up' failed; it started nothing, the lab is left as it was" >&2
  fi
  exit "$rc"
}
cmd_up() {
  local t0=$SECONDS
  case "${1:-}" in '' | --keep | --no-keep) ;; *) usage ;; esac
  need_root
  need_bins
  need_netns
  mkdir -p "$LAB"
  lock
  mkdir -p "$RUN" "$LOG"
  cpu_group_enter
  check_ports
  [ -e "/run/netns/${NS}1" ] || NET_CREATED=1
  trap up_failed EXIT
  net_up
  write_conf
  if [ "$CONF_CHANGED" = 1 ] && { ours "$RUN/slurmctld.pid" slurmctld || ours "$RUN/slurmd.node1.pid" slurmd; }; then
    say "configuration changed (FAKE_GPUS/NODE_*?): restarting slurmctld and the slurmd"
    stop_slurm
  fi
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurmctld
  local i
  for i in $(seq "$NNODES"); do start_node "$i"; done
  wait_nodes "$UP_TIMEOUT" || die "not all $NNODES nodes became idle within ${UP_TIMEOUT}s: $(node_states | tr '\n' ' ')"
  [ -z "${CTLD_STARTED_AT:-}" ] || reap_ghosts
  trap - EXIT
  case "${1:-}" in --keep) touch "$KEEP_FLAG" ;; --no-keep) rm -f "$KEEP_FLAG" ;; esac
  if [ ${#STARTED[@]} = 0 ]; then
    say "cluster already up ($NNODES nodes, LAB=$LAB)"
  else
    say "cluster ready in $((SECONDS - t0)) s ($NNODES nodes, LAB=$LAB; started: ${STARTED[*]})"
  fi
}
down_all() {
  if ctld_up; then timeout 10 scancel --user=root 2>/dev/null || true; fi
  local i
  for i in $(seq "$NNODES"); do stop_pid "$RUN/slurmd.node$i.pid" slurmd; done
  for i in $(seq "$NNODES"); do kill_ns "$i"; done
  stop_pid "$RUN/slurmctld.pid" slurmctld
  stop_pid "$RUN/slurmdbd.pid" slurmdbd
  stop_pid "$RUN/mariadb.pid" mariadbd
  stop_pid "$RUN/munged.pid" munged
  rm -f "$RUN"/killed.node*
  net_down
}
cmd_down() {
  need_root
  mkdir -p "$(dirname "$LOCK")"
  lock
  down_all
  say "cluster down (state and DB kept under $LAB)"
}
cmd_wipe() {
  cmd_down
  rm -rf "$ST" "$DB" "$LOG" "$RUN" "$ETC" "$KEEP_FLAG"
  local f
  for f in "${CONF_FILES[@]}"; do
    if [ "$(readlink "/etc/slurm/$f" 2>/dev/null)" = "$ETC/$f" ]; then rm -f "/etc/slurm/$f"; fi
  done
  rmdir "$LAB" 2>/dev/null || true
  say "lab wiped"
}
cmd_status() {
  local bad=0 killed=0 d i
  for d in munged:munged mariadb:mariadbd slurmdbd:slurmdbd slurmctld:slurmctld; do
    if ours "$RUN/${d%%:*}.pid" "${d#*:}"; then
      printf '%-14s running  pid %s\n' "${d%%:*}" "$(cat "$RUN/${d%%:*}.pid")"
    else
      printf '%-14s STOPPED\n' "${d%%:*}"
      bad=1
    fi
  done
  for i in $(seq "$NNODES"); do
    if ours "$RUN/slurmd.node$i.pid" slurmd; then
      printf '%-14s running  pid %s\n' "slurmd.node$i" "$(cat "$RUN/slurmd.node$i.pid")"
    elif [ -e "$RUN/killed.node$i" ]; then
      printf '%-14s STOPPED  on purpose (kill-node %s; back with restart-node %s)\n' "slurmd.node$i" "$i" "$i"
      killed=$((killed + 1))
    else
      printf '%-14s STOPPED\n' "slurmd.node$i"
      bad=1
    fi
  done
  if [ $bad = 0 ] && ctld_up; then
    echo "nodes:"
    node_states | sed 's/^/  /'
    [ "$(healthy_count)" -ge $((NNODES - killed)) ] || bad=1
    timeout 5 sacctmgr -n show cluster >/dev/null 2>&1 || {
      echo "accounting: slurmdbd NOT answering"
      bad=1
    }
  else
    bad=1
  fi
  if [ -e "$KEEP_FLAG" ]; then echo "kept up: yes ($KEEP_FLAG; test sessions leave it running)"; fi
  if [ $bad = 0 ] && [ $killed = 0 ]; then
    echo "cluster: healthy (LAB=$LAB, partition debug, nodes node1..node$NNODES)"
    return 0
  elif [ $bad = 0 ]; then
    echo "cluster: degraded on purpose ($killed node(s) stopped with kill-node; LAB=$LAB)"
    return 3
  fi
  echo "cluster: NOT healthy (LAB=$LAB); run: bash $0 up"
  return 1
}
node_arg() {
  case "${1:-}" in '' | *[!0-9]*) die "need a node number 1..$NNODES, got '${1:-}'" ;; esac
  [ "$1" -ge 1 ] && [ "$1" -le "$NNODES" ] || die "need a node number 1..$NNODES, got '$1'"
}
cmd_kill_node() {
  need_root
  node_arg "${1:-}"
  lock
  kill_ns "$1"
  rm -f "$RUN/slurmd.node$1.pid"
  touch "$RUN/killed.node$1" # status reports it as stopped on purpose; start_node clears it
  say "node$1 killed (every process in its namespace); bring it back with: bash $0 restart-node $1"
}
cmd_restart_node() {
  need_root
  node_arg "${1:-}"
  lock
  ctld_up || die "slurmctld is not running; run: bash $0 up"
  cpu_group_enter
  start_node "$1"
  say "node$1 slurmd running"
}
cmd_slow_net() {
  need_root
  node_arg "${1:-}"
  local rate=${2:-}
  [ -n "$rate" ] || die "usage: $0 slow-net N RATE|off"
  if [ "$rate" = off ]; then
    tc qdisc del dev "$VETH$1" root 2>/dev/null || true
    ip netns exec "$NS$1" tc qdisc del dev eth0 root 2>/dev/null || true
    say "node$1 link restored"
    return
  fi
  # egress on both ends of the veth pair: what node$1 sends (inside) and what it receives (the bridge side)
  tc qdisc replace dev "$VETH$1" root tbf rate "$rate" burst 64kbit latency 400ms
  ip netns exec "$NS$1" tc qdisc replace dev eth0 root tbf rate "$rate" burst 64kbit latency 400ms
  say "node$1 link limited to $rate both ways; restore with: bash $0 slow-net $1 off"
}

CMD=${1:-}
case "$CMD" in
  install) install_pkgs ;;
  up) cmd_up "${2:-}" ;;
  down) cmd_down ;;
  wipe) cmd_wipe ;;
  status) cmd_status ;;
  kill-node) cmd_kill_node "${2:-}" ;;
  restart-node) cmd_restart_node "${2:-}" ;;
  slow-net) cmd_slow_net "${2:-}" "${3:-}" ;;
  *) usage ;;
esac
