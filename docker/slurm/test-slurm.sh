#!/usr/bin/env bash
# Submit docker/slurm/hvdtrain.sbatch to a real Slurm: a one-node cluster made here from Debian's
# packages (munge, slurmctld, slurmd), for the time of the test, then check that the job trained.
#
#   docker/slurm/test-slurm.sh          # or: make test-slurm (needs the venv: make setup)
#
# The cluster is a sandbox: its configuration, state, spool, logs and munge key live in a temporary
# folder, the daemons listen on free loopback ports and are stopped at the end; no cgroups
# (proctrack/linuxproc, task/none), no accounting. Nothing of the machine's own Slurm or munge
# set-up is used or changed. The job is the real batch script with 2 tasks on this node and no
# GPUs; the options given to sbatch override its #SBATCH lines, as a user's would:
#   sbatch --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 ... \
#       docker/slurm/hvdtrain.sbatch recipes/gpt-tiny.yaml train.max_steps=20 out_dir=...
# srun starts the tasks with --mpi=pmix (Debian's Slurm has the PMIx plugin, its Open MPI uses
# PMIx): Horovod's MPI controller gets its ranks from there.
#
# Needs root (slurmd starts job steps; apt-get installs the packages when missing) and the venv
# made by scripts/install.py (HVDTRAIN_VENV, default .venv), with Horovod built with MPI.
#
# Environment: TEST_SLURM_STEPS (default 20), TEST_SLURM_TIMEOUT (seconds for the job, default 600).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
venv=${HVDTRAIN_VENV:-$repo/.venv}
steps=${TEST_SLURM_STEPS:-20}
job_timeout=${TEST_SLURM_TIMEOUT:-600}

say() { printf '\n== test-slurm: %s\n' "$*"; }
die() { printf 'test-slurm: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root: slurmd starts the job's tasks, and packages may need installing"
[[ -x $venv/bin/hvdtrain ]] || die "no $venv/bin/hvdtrain: make setup first (or set HVDTRAIN_VENV)"
missing=()
for program in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
  command -v "${program%%:*}" > /dev/null || missing+=("${program#*:}")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  apt-get update -q
  # The packages' own services would start with the machine's default configuration: none here.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

tmp=$(mktemp -d /tmp/hvdtrain-slurm.XXXXXX)
chmod 755 "$tmp"
pids=()
cleanup() {
  local status=$?
  if [[ -n ${job_id:-} ]] && [[ $status != 0 ]]; then scancel "$job_id" 2> /dev/null || true; sleep 1; fi
  # Last started, first stopped: slurmd, slurmctld, then munged (both daemons talk to it until they end).
  local i pid
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    pid=${pids[i]}
    kill "$pid" 2> /dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2> /dev/null || break; sleep 0.5; done
  done
  if [[ $status != 0 ]]; then
    for log in "$tmp"/log/*.log; do echo "--- $log"; tail -25 "$log"; done
  fi
  rm -rf "$tmp"
  exit "$status"
}
trap cleanup EXIT
mkdir -p "$tmp"/{etc,state,spool,log,munge,out}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() { # SECONDS WHAT COMMAND...: until COMMAND succeeds
  local limit=$1 what=$2
  shift 2
  for _ in $(seq "$((limit * 2))"); do
    if "$@" > /dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  die "$what did not come up within $limit s"
}

say "munge"
mungekey --create --keyfile="$tmp/munge/munge.key" 2> /dev/null \
  || dd if=/dev/urandom of="$tmp/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$tmp/munge/munge.key"
socket=$tmp/munge/munge.socket
# --force: the temporary folder sits in /tmp, which munged finds too open for its liking.
munged --force --key-file="$tmp/munge/munge.key" --socket="$socket" \
  --pid-file="$tmp/munge/munged.pid" --seed-file="$tmp/munge/munged.seed" --log-file="$tmp/log/munged.log"
wait_for 10 munged test -s "$tmp/munge/munged.pid"
pids+=("$(cat "$tmp/munge/munged.pid")")
munge --socket="$socket" -n | unmunge --socket="$socket" > /dev/null || die "munge does not work"

say "slurmctld and slurmd"
node=hvdtest-node
cpus=$(nproc)
memory=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024))
export SLURM_CONF=$tmp/etc/slurm.conf
cat > "$SLURM_CONF" <<EOF
ClusterName=hvdtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool/%n
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
SlurmdDebug=info
# No cgroups: processes tracked by their parent ids, CPU binding by sched_setaffinity (the sbatch
# asks for none), no accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -f "$SLURM_CONF" -i
wait_for 20 slurmctld test -s "$tmp/slurmctld.pid"
pids+=("$(cat "$tmp/slurmctld.pid")")
wait_for 30 "slurmctld (scontrol ping)" bash -c 'scontrol ping | grep -q UP'
slurmd -f "$SLURM_CONF" -N "$node"
wait_for 20 slurmd test -s "$tmp/slurmd.pid"
pids+=("$(cat "$tmp/slurmd.pid")")
wait_for 60 "the node (sinfo: idle)" bash -c "sinfo -h -n $node -o %T | grep -qx idle"
sinfo
echo "srun --mpi=list:"
srun --mpi=list 2>&1 | sed 's/^/  /'
srun --mpi=list 2>&1 | grep -q pmix || die "this Slurm has no PMIx plugin: the sbatch needs srun --mpi=pmix"

say "sbatch docker/slurm/hvdtrain.sbatch recipes/gpt-tiny.yaml: 2 tasks, no GPU"
cd "$repo"
job_id=$(HVDTRAIN_VENV=$venv sbatch --parsable --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 \
  --gpus-per-node=0 --mem=0 --time=15 --output="$tmp/out/%x-%j.out" \
  docker/slurm/hvdtrain.sbatch recipes/gpt-tiny.yaml "train.max_steps=$steps" "out_dir=$tmp/out/run")
echo "job $job_id"
state=
for _ in $(seq "$job_timeout"); do
  state=$(scontrol show job "$job_id" 2> /dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
  case $state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE) break ;; esac
  sleep 1
done
output=$tmp/out/hvdtrain-$job_id.out
echo "--- job output ($output)"
cat "$output" 2> /dev/null || true
echo "---"
scontrol show job "$job_id" | grep -E 'JobState|ExitCode|NumTasks|NodeList=' | sed 's/^ */  /'
[[ $state == COMPLETED ]] || die "job $job_id ended $state"

grep -q "2 workers on 1 node" "$output" || die "the job did not start 2 workers on 1 node"
"$venv/bin/python" - "$tmp/out/run" "$steps" <<'EOF' || die "the job's run folder is not that of a finished run"
import json, sys
from pathlib import Path
run, steps = Path(sys.argv[1]), int(sys.argv[2])
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
trained = [r for r in records if r.get("step") == steps]
assert trained, f"no record of step {steps} in {run / 'metrics.jsonl'}"
workers = {r.get("world_size", r.get("workers")) for r in records} - {None}
print(f"metrics: {len(records)} records, last step {max(r.get('step', 0) for r in records)}, workers {workers or '?'}")
assert any((run / "checkpoints").iterdir()), "no checkpoint"
EOF
say "passed: the job trained $steps steps on 2 Slurm tasks (srun --mpi=pmix)"
