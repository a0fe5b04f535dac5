#!/usr/bin/env bash
# Entrypoint of the hvdtrain image. The first argument picks the role:
#
#   worker              run sshd in the foreground, so that a launcher on another node can start
#                       ranks in this container (horovodrun and mpirun start remote ranks over ssh)
#   PROGRAM [ARGS...]   a program on PATH runs as given: bash, mpirun, horovodrun, python ...
#   [ARGS...]           anything else is the launcher/default role: hvdtrain ARGS
#                       (docker run IMAGE launch -np 8 recipes/gpt2-small.yaml)
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
  # sshd re-executes itself, so it must be started by absolute path.
  exec "$(command -v sshd)" -D -e -f "$state/sshd_config"
}

if [[ ${1:-} == worker ]]; then
  run_worker
elif [[ $# -gt 0 ]] && type -P "$1" > /dev/null; then
  exec "$@"
else
  exec hvdtrain "$@"
fi
