#!/usr/bin/env bash
# Run docker/docker-compose.yml for real, on this machine, with Debian's podman and podman-compose:
# the shipped compose file unmodified, plus a CPU override (no GPU reservation) and variables.
#
#   docker/test-compose.sh            # or: make test-compose
#
# The image is the CPU flavour that `make test-image` builds with buildah (docker/test-image.sh
# --build-only: nothing to do when it is cached), run by podman from the same storage, tagged as
# the compose file's hvdtrain:latest. The project is a folder laid out as the repository
# (docker/docker-compose.yml, a byte-for-byte copy, with data/ and runs/ next to docker/, made by
# the image's user before the first run, as docs/containers.md says). Checks, as a user would see them:
#   1. `up -d` of the train service: `hvdtrain launch -np $NUM_GPUS recipes/$RECIPE.yaml` trains on
#      2 workers (NUM_GPUS=2, a gpt-tiny recipe of STEPS steps), then `stop` (SIGTERM) after a few
#      steps: the ranks checkpoint at the same step and the service exits 75 (preempted)
#   2. runs/ on the host holds that checkpoint and metrics.jsonl, owned by uid 1000
#   3. a second `up` resumes from that checkpoint and finishes at STEPS, with hf/, not from step 0
#   4. the volumes: runs/ and data/ of the project bind-mounted at /opt/hvdtrain/runs and /data, the
#      named volume hvdtrain_hf-cache at /home/hvd/.cache holding the tokenized data and HF_HOME;
#      no device, and the compose file's /dev/shm size
#   5. `down` leaves no container, and keeps the cache volume for the next run
#
# Needs root. Installs podman, podman-compose and runc with apt-get when missing, and writes
# /etc/containers/containers.conf when there is none: this kernel's cgroup layout needs runc (crun
# fails) and the cgroupfs manager, and podman's default ulimits cannot be set here.
#
# Environment:
#   TEST_COMPOSE_STEPS     training steps of the run (default 30; the first `up` is stopped after 3)
#   TEST_COMPOSE_TIMEOUT   seconds each `up` may take (default 300)
#   and those of docker/test-image.sh for the build (HVDTRAIN_IMAGE_CACHE, HVDTRAIN_IMAGE_STORAGE, ...)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
steps=${TEST_COMPOSE_STEPS:-30}
up_timeout=${TEST_COMPOSE_TIMEOUT:-300}
user_uid=1000  # the image's user (docker/Dockerfile: USER_UID)

say() { printf '\n== test-compose: %s\n' "$*"; }
die() { printf 'test-compose: %s\n' "$*" >&2; exit 1; }
elapsed() { echo "$((SECONDS - $1)) s"; }
total_start=$SECONDS

# ---------------------------------------------------------------- tools

if [[ $(id -u) != 0 ]]; then
  die "run as root: podman runs the containers as root here, with the storage of test-image.sh"
fi
missing=()
for tool in podman podman-compose runc; do
  command -v "$tool" > /dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
if [[ ! -e /etc/containers/containers.conf ]]; then
  say "writing /etc/containers/containers.conf (runc, cgroupfs, no default ulimits)"
  mkdir -p /etc/containers
  cat > /etc/containers/containers.conf <<'EOF'
# Written by hvdtrain's docker/test-compose.sh: what podman 4.3 needs to run containers on this kernel.
[containers]
# podman sets its default nofile/nproc ulimits on every container; here setting them fails.
default_ulimits = []

[engine]
# crun fails on this kernel's cgroup layout; runc works, with the cgroupfs manager (no systemd).
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
fi
podman --version
podman-compose version 2> /dev/null | grep "^podman-composer* version"

# ---------------------------------------------------------------- the image

say "the CPU image of make test-image"
start=$SECONDS
"$repo/docker/test-image.sh" --build-only
echo "image: $(elapsed "$start")"
source "$repo/docker/image-storage.sh"

work=$(mktemp -d /tmp/hvdtrain-test-compose.XXXXXX)
chmod 755 "$work"  # the image's user reaches the project and the recipe through it
# podman (and every podman that podman-compose starts) uses test-image.sh's storage.
cat > "$work/storage.conf" <<EOF
[storage]
driver = "$STORAGE_DRIVER"
graphroot = "$storage"
runroot = "$runroot"
EOF
export CONTAINERS_STORAGE_CONF=$work/storage.conf
podman tag localhost/hvdtrain:cpu-test localhost/hvdtrain:latest

# ---------------------------------------------------------------- the project

project=$work/hvdtrain  # as the repository: docker/docker-compose.yml, data/ and runs/
mkdir -p "$project/docker"
cp "$repo/docker/docker-compose.yml" "$project/docker/"
# The first step of docs/containers.md (One node), as the image's user (uid 1000) would run it.
chown "$user_uid:$user_uid" "$project"
setpriv --reuid "$user_uid" --regid "$user_uid" --clear-groups mkdir -p "$project/data" "$project/runs"

# A tiny recipe, mounted next to the image's recipes: gpt-tiny, few steps, no checkpoint but the
# one that the stop makes.
cat > "$work/compose-test.yaml" <<EOF
base: gpt-tiny.yaml
out_dir: runs/compose-test
train:
  max_steps: $steps
  warmup_steps: 2
checkpoint:
  every: 0
log:
  every: 1
  progress: false
eval:
  every: 0
EOF
chmod 644 "$work/compose-test.yaml"
# The override: what a CPU host changes, and the recipe. The GPU reservation needs no change here:
# podman-compose 1.0.3 reads only cpus and memory from `deploy` (checked below: no device).
# (Docker Compose on a CPU host would need `deploy: !reset {}`, which podman-compose cannot parse.)
cat > "$work/cpu.yml" <<EOF
services:
  train:
    volumes:
      - $work/compose-test.yaml:/opt/hvdtrain/recipes/compose-test.yaml:ro
EOF
# The compose file's ulimits (memlock unlimited, for NCCL and InfiniBand) need a host that lets
# root raise hard limits. Where it does not (a sandbox like this CI machine: runc fails with
# "error setting rlimit ... operation not permitted"), the container keeps the hard limits that a
# container gets here without any: memlock, and nofile and nproc, which podman adds whenever a
# service sets ulimits.
if ! podman run --rm --ulimit memlock=-1 --ulimit stack=67108864 --entrypoint /bin/true \
       localhost/hvdtrain:latest > /dev/null 2>&1; then
  echo "test-compose: this host cannot raise the memlock limit for a container: the override keeps its limits"
  limits=$(podman run --rm --entrypoint cat localhost/hvdtrain:latest /proc/self/limits)
  hard() { awk -v name="$1" 'index($0, name) == 1 { print $(NF - 1) }' <<< "$limits"; }
  cat >> "$work/cpu.yml" <<EOF
    ulimits:
      memlock: $(hard "Max locked memory")
      nofile: $(hard "Max open files")
      nproc: $(hard "Max processes")
EOF
fi
# podman-compose 1.0.3 ignores the file's `name: hvdtrain` (it names the project after the
# folder, docker/): -p gives the project the name Docker Compose takes from the file.
compose=(podman-compose -p hvdtrain -f "$project/docker/docker-compose.yml" -f "$work/cpu.yml")
export NUM_GPUS=2 RECIPE=compose-test

cleanup() {
  local status=$?
  # (podman-compose 1.0.3's down leaves the project's network.)
  (cd "$project/docker" && "${compose[@]}" down --volumes > /dev/null 2>&1) || true
  podman volume rm hvdtrain_hf-cache > /dev/null 2>&1 || true
  podman network rm hvdtrain_default > /dev/null 2>&1 || true
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT

cmp "$repo/docker/docker-compose.yml" "$project/docker/docker-compose.yml"
cd "$project/docker"
run=$project/runs/compose-test

up() { # LOG [UP OPTIONS]: `up` of the train service, until it exits (or in the background: -d)
  local log=$1
  shift
  # (--abort-on-container-exit makes podman-compose 1.0.3 exit 255 whatever the container did.)
  timeout "$up_timeout" "${compose[@]}" up --no-build "$@" train > "$work/compose.log" 2>&1 \
    || { tail -40 "$work/compose.log"; die "podman-compose up failed (or took over $up_timeout s)"; }
}

exited() { # EXIT_CODE LOG: the train container exited with EXIT_CODE; LOG: what it printed
  # podman-compose 1.0.3 does not show the container's output, and its exit status is its own.
  podman logs hvdtrain_train_1 > "$2" 2>&1
  grep -E 'step [0-9]+:|hvdtrain:|[Ee]rror|Traceback' "$2" | cut -c1-200 || true
  local code
  code=$(podman inspect --format '{{.State.ExitCode}}' hvdtrain_train_1)
  [[ $code == "$1" ]] || { tail -40 "$2"; die "the train container exited with $code, not $1"; }
}

trained() { # the number of training steps in runs/compose-test/metrics.jsonl
  if [[ -f $run/metrics.jsonl ]]; then grep -c '"tokens_per_s"' "$run/metrics.jsonl" || true; else echo 0; fi
}

check() { # STEP: metrics.jsonl reaches STEP on 2 workers; checkpoint and metrics owned by uid 1000
  python3 - "$run" "$1" "$user_uid" <<'EOF' || die "runs/compose-test is not what the run should leave"
import json, sys
from pathlib import Path
run, step, uid = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
steps = [r["step"] for r in records if "loss" in r and "tokens_per_s" in r]
assert steps and max(steps) == step, f"the training steps in metrics.jsonl end at {max(steps, default=None)}, not {step}"
assert len(steps) == len(set(steps)), f"a step was trained twice: {steps}"
assert {r["world_size"] for r in records if "world_size" in r} == {2}, "not 2 workers"
checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
assert f"step_{step:08d}" in checkpoints, f"no checkpoint of step {step}: {checkpoints}"
wrong = [str(p) for p in [run, *run.rglob("*")] if p.stat().st_uid != uid]
assert not wrong, f"not owned by uid {uid}: {wrong[:5]}"
print(f"runs/compose-test: steps up to {step} on 2 workers, checkpoints {checkpoints}, all owned by uid {uid}")
EOF
}

# ---------------------------------------------------------------- the runs

say "1. up -d: NUM_GPUS=2 RECIPE=compose-test (gpt-tiny, $steps steps), then stop after 3 steps"
start=$SECONDS
up "$work/up1.log" -d
deadline=$((SECONDS + up_timeout))
while (($(trained) < 3)); do
  [[ $(podman inspect --format '{{.State.Running}}' hvdtrain_train_1) == true ]] \
    || { exited 0 "$work/up1.log"; die "the train container stopped before 3 steps"; }
  ((SECONDS < deadline)) || die "no 3 training steps in $up_timeout s"
  sleep 1
done
# As `docker compose stop`: SIGTERM to the container's PID 1, the entrypoint.
"${compose[@]}" stop -t 120 train > "$work/compose.log" 2>&1 || { cat "$work/compose.log"; die "stop failed"; }
exited 75 "$work/up1.log"
stopped_at=$(sed -n 's/.*stopped: preempted at step \([0-9]*\).*/\1/p' "$work/up1.log" | head -1)
[[ -n $stopped_at ]] || { tail -20 "$work/up1.log"; die "the stop did not end the run as preempted"; }
check "$stopped_at"
echo "first up and stop: $(elapsed "$start")"

say "4. the volumes of the train container (and no device)"
[[ $(podman inspect --format '{{len .HostConfig.Devices}}' hvdtrain_train_1) == 0 ]] || die "the container has devices"
shm=$(podman inspect --format '{{.HostConfig.ShmSize}}' hvdtrain_train_1)
[[ $shm == $((16 << 30)) ]] || die "/dev/shm of the container is $shm bytes, not the compose file's 16gb"
podman inspect --format '{{range .Mounts}}{{.Type}} {{.Name}} {{.Source}} {{.Destination}}{{"\n"}}{{end}}' \
  hvdtrain_train_1 | tee "$work/mounts"
grep -qx "bind  $project/runs /opt/hvdtrain/runs" "$work/mounts" || die "runs/ is not mounted at /opt/hvdtrain/runs"
grep -qx "bind  $project/data /data" "$work/mounts" || die "data/ is not mounted at /data"
grep -q "^volume hvdtrain_hf-cache .* /home/hvd/.cache$" "$work/mounts" \
  || die "the volume hvdtrain_hf-cache is not mounted at /home/hvd/.cache"
cache=$(podman volume inspect --format '{{.Mountpoint}}' hvdtrain_hf-cache)
compgen -G "$cache/hvdtrain/tokenized/*" > /dev/null || die "no tokenized data in the cache volume ($cache)"
[[ -d $cache/huggingface ]] || die "no HF_HOME (huggingface/) in the cache volume"

say "3. up again: resumes at step $stopped_at and finishes at $steps"
start=$SECONDS
up "$work/up2.log"
exited 0 "$work/up2.log"
grep -q "resuming at step $stopped_at from runs/compose-test/checkpoints/step_" "$work/up2.log" \
  || { tail -40 "$work/up2.log"; die "the second up did not resume at step $stopped_at"; }
check "$steps"
[[ -f $run/hf/config.json ]] || die "no hf/ export at the end of the run"
echo "second up: $(elapsed "$start")"

say "5. down"
"${compose[@]}" down > "$work/down.log" 2>&1 || { cat "$work/down.log"; die "podman-compose down failed"; }
left=$(podman ps --all --filter label=io.podman.compose.project=hvdtrain --format '{{.Names}}')
[[ -z $left ]] || die "containers left after down: $left"
podman volume exists hvdtrain_hf-cache || die "down removed the cache volume"

say "passed in $(elapsed "$total_start")"
