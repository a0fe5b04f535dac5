#!/usr/bin/env bash
# Entrypoint of the hvdtrain image. The first argument picks the role:
#
#   worker              run sshd, so that a launcher on another node can start ranks in this
#                       container (horovodrun and mpirun start remote ranks over ssh), and pass
#                       a stop signal on to those ranks (see stop_ranks)
#   PROGRAM [ARGS...]   a program on PATH runs as given: bash, mpirun, horovodrun, python ...
#   [ARGS...]           anything else is the launcher/default role: hvdtrain ARGS
#                       (docker run IMAGE launch -np 8 recipes/gpt2-small.yaml), as a child that
#                       a stop signal reaches the same way (see stop_ranks)
#
# Worker settings (environment):
#   SSH_PORT   port sshd listens on (default 2222; the image's ssh client uses the same port)
#   SSH_DIR    folder holding authorized_keys, usually a read-only mount (default ~/.ssh, where
#              the launcher's ssh also finds its private key and the MPI Operator mounts its keys)
set -euo pipefail

# Variables of this container that ranks started over ssh must see too: sshd gives its sessions
# a minimal environment, without the image's PATH (the venv), HF_HOME or NCCL/Open MPI settings.
session_env() {
  local name
  for name in $(compgen -e); do
    case $name in
      PATH | LD_LIBRARY_PATH | PYTHONUNBUFFERED | HF_* | NCCL_* | HOROVOD_* | OMPI_MCA_* | CUDA_*)
        printf ' "%s=%s"' "$name" "${!name}" ;;
    esac
  done
}

run_worker() {
  local port=${SSH_PORT:-2222} ssh_dir=${SSH_DIR:-$HOME/.ssh}
  if [[ ! -s $ssh_dir/authorized_keys ]]; then
    echo "worker: no $ssh_dir/authorized_keys: mount the folder with the cluster key pair and authorized_keys" \
         "there (docker run -v KEYDIR:$ssh_dir:ro), or set SSH_DIR" >&2
    exit 1
  fi
  # The host key and pid file go to a private folder: the key folder is usually read-only.
  # A fresh host key per start is fine, as clients in this image do not check host keys.
  local state
  state=$(mktemp -d)
  ssh-keygen -q -t ed25519 -N '' -f "$state/host_ed25519"
  cat > "$state/sshd_config" <<EOF
Port $port
HostKey $state/host_ed25519
PidFile $state/sshd.pid
AuthorizedKeysFile $ssh_dir/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
# Nothing but commands: no forwarding of ports, agents or X11 through the workers.
AllowTcpForwarding no
AllowAgentForwarding no
X11Forwarding no
PermitTunnel no
# PAM needs root; run as a normal user, sshd can only log in that same user, by key.
UsePAM no
# Mounted keys are often owned by root or group-readable (Docker volumes, Kubernetes Secrets).
StrictModes no
SetEnv$(session_env)
EOF
  echo "worker: sshd on port $port, keys from $ssh_dir"
  # sshd runs as a child, not in this shell's place: as PID 1 it would end on the eviction's SIGTERM,
  # and the kernel would then SIGKILL every rank before it could write its checkpoint.
  # (sshd re-executes itself, so it must be started by absolute path.)
  "$(command -v sshd)" -D -e -f "$state/sshd_config" &
  # Stopped on request once the ranks were gone: a clean stop, whatever sshd says of its SIGTERM.
  supervise stop 0
}

# The default role: hvdtrain as a child, not in this shell's place. As PID 1, `hvdtrain launch`
# would never see a `docker stop` (the kernel drops signals that PID 1 has no handler for), and
# the ranks would be SIGKILLed when the grace period ends. Its exit status is the container's.
run_hvdtrain() {
  hvdtrain "$@" <&0 &
  supervise wait ""
}

supervise() { # AFTER_RANKS STOPPED_STATUS: wait for the child just started; stop signals -> stop_ranks
  child=$! after_ranks=$1 stopped_status=$2 stopped=
  trap 'stop_ranks TERM TERM' TERM
  trap 'stop_ranks INT TERM' INT
  trap 'stop_ranks USR1 USR1' USR1
  # `wait` returns early when a trapped signal arrives (status > 128): wait again until it ends,
  # then once more for its own exit status (bash keeps it for a child it has collected).
  while kill -0 "$child" 2> /dev/null; do wait "$child" || true; done
  local status=0
  wait "$child" || status=$?
  if [[ -n $stopped && -n $stopped_status ]]; then exit "$stopped_status"; fi
  exit "$status"
}

# The hvdtrain ranks among this shell's descendants (started by sshd's sessions or by the child), by the
# program they run: `hvdtrain train ...` (mpirun and the MPI Operator; the console script runs as
# `python /opt/venv/bin/hvdtrain train`) or `python -m hvdtrain.cli train ...` (horovodrun). The
# processes that started them (orted, shells) are left alone: stopped, they would end the job at once.
rank_pids() {
  local dir pid line stat children=() parent_of=() queue=("$$") argv
  for dir in /proc/[0-9]*; do
    read -r line 2> /dev/null < "$dir/stat" || continue
    stat=(${line##*) })  # the fields after the command name, which may hold spaces
    parent_of[${dir#/proc/}]=${stat[1]}
  done
  for pid in "${!parent_of[@]}"; do children[${parent_of[pid]}]+=" $pid"; done
  while ((${#queue[@]})); do
    pid=${queue[0]}
    queue=("${queue[@]:1}")
    argv=()
    mapfile -d '' argv 2> /dev/null < "/proc/$pid/cmdline"
    argv+=('' '' '' '')
    if [[ ${argv[0]##*/} == hvdtrain && ${argv[1]} == train || ${argv[1]##*/} == hvdtrain && ${argv[2]} == train
          || ${argv[1]} == -m && ${argv[2]} == hvdtrain.cli && ${argv[3]} == train ]]; then
      echo "$pid"  # not its children: its DataLoader processes are forks with its command line, and stop with it
    else
      queue+=(${children[pid]:-})
    fi
  done
}

alive() { # PID: running, not a zombie that its parent has yet to collect
  local line
  read -r line 2> /dev/null < "/proc/$1/stat" || return 1
  line=${line##*) }
  [[ ${line:0:1} != Z ]]
}

# A stop signal (Kubernetes' eviction, `docker stop`, Ctrl-C) goes to PID 1 only. The ranks get it
# as hvdtrain's preemption signal (SIGTERM; SIGUSR1 as given): they agree on a step, write a
# checkpoint and exit (hvdtrain/training/stopping.py); the orchestrator's grace period bounds the wait.
# Then, in a worker, sshd is stopped, which ends the container (exit 0); a launcher (`hvdtrain
# launch`, horovodrun) ends by itself once its ranks have. Without ranks here the child gets the
# SIGTERM itself. SIGUSR1 only warns: the container stays.
stop_ranks() { # RECEIVED FORWARDED
  local ranks
  ranks=$(rank_pids)
  echo "hvdtrain-entrypoint: SIG$1: SIG$2 to the hvdtrain ranks here:" ${ranks:-none} >&2
  if [[ -z $ranks ]]; then
    if [[ $2 == TERM ]]; then
      stopped=1
      kill -s TERM "$child" 2> /dev/null || true
    fi
    return 0
  fi
  kill -s "$2" $ranks 2> /dev/null || true
  [[ $2 == TERM ]] || return 0
  while [[ -n $ranks ]]; do
    sleep 0.2
    ranks=$(for pid in $ranks; do if alive "$pid"; then echo "$pid"; fi; done)
  done
  stopped=1
  if [[ $after_ranks == stop ]]; then kill -s TERM "$child" 2> /dev/null || true; fi
}

if [[ ${1:-} == worker ]]; then
  run_worker
elif [[ $# -gt 0 ]] && type -P "$1" > /dev/null; then
  exec "$@"
else
  run_hvdtrain "$@"
fi
