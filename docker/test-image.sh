#!/usr/bin/env bash
# Build the image from docker/Dockerfile and use it, on this machine, without Docker: the CPU
# flavour (a Debian 12 base made by debootstrap), built by buildah, then run as docs/containers.md runs it.
#
#   docker/test-image.sh            # or: make test-image
#   docker/test-image.sh --build-only   # only build (or find cached) the image: docker/test-compose.sh
#
# Checks, each inside the image as its user (uid 1000):
#   1. hvdtrain doctor: READY, with the Gloo and MPI controllers built
#   2. hvdtrain launch -np 2 --gloo recipes/gpt-tiny.yaml   (a few steps; checkpoint and metrics)
#   3. the same with --mpi
#   4. several nodes: one container in the `worker` role (sshd as uid 1000 on SSH_PORT, keys from a
#      read-only mount) and one that runs `hvdtrain launch -np 2 -H 127.0.0.1:1,127.0.0.2:1`, so
#      that horovodrun starts the second rank over ssh in the worker container, with MPI and with
#      Gloo. Both share the host network (as with `docker run --network host`) and the runs
#      folder; each has its own cache (data prepared per host).
#   5. all four runs end with the same loss (the recipe fixes the global batch)
#   6. hvdtrain launch -np 2 on a terminal (buildah run -t, on a pseudo-terminal of this host):
#      one clean stream, as on the host (docker/terminal_check.py, with the repository's .venv)
# The CUDA/NCCL part of the image cannot be checked without a GPU: the Dockerfile's build checks
# cover it (the flavour follows the base image).
#
# Needs root (buildah with chroot isolation, overlay or vfs storage; apt-get installs buildah and
# debootstrap when missing), Debian's and PyPI's registries. Caches: HVDTRAIN_IMAGE_CACHE (default
# ~/.cache/hvdtrain/image) holds the debootstrap root file system and the build's cache mounts
# (pip's cache, the Horovod wheel); HVDTRAIN_IMAGE_STORAGE (default /var/lib/hvdtrain/buildah)
# buildah's images and layers, so a second run rebuilds only what changed. Delete both to start over.
#
# Environment:
#   TEST_IMAGE_STEPS       training steps of each run (default 20)
#   TEST_IMAGE_TIMEOUT     seconds each check may take (default 300)
#   TORCH_WHEEL            a CPU torch wheel to install in the image instead of the PyTorch CPU
#                          index (default: /opt/wheels/torch-<version>+cpu-cp311-*.whl if present)
#   DEBIAN_MIRROR          for debootstrap (default http://deb.debian.org/debian)
#   HVDTRAIN_IMAGE_HOST_WHEEL=0   compile Horovod in the image even when this host (Debian 12 too)
#                          has a CPU wheel from scripts/install.py that the image could reuse
#   STORAGE_DRIVER         overlay or vfs (default: overlay where the kernel has it)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${HVDTRAIN_IMAGE_CACHE:-$HOME/.cache/hvdtrain/image}
steps=${TEST_IMAGE_STEPS:-20}
check_timeout=${TEST_IMAGE_TIMEOUT:-300}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
image=localhost/hvdtrain:cpu-test
# Bump when the base image recipe below changes.
base_recipe=1

say() { printf '\n== test-image: %s\n' "$*"; }
die() { printf 'test-image: %s\n' "$*" >&2; exit 1; }
elapsed() { echo "$((SECONDS - $1)) s"; }

# ---------------------------------------------------------------- tools

if [[ $(id -u) != 0 ]]; then
  die "run as root: buildah builds here as root, with chroot isolation"
fi
missing=()
command -v buildah > /dev/null || missing+=(buildah)
command -v debootstrap > /dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The storage of images and layers: docker/image-storage.sh.
source "$repo/docker/image-storage.sh"
export BUILDAH_ISOLATION=chroot
# Cache mounts of the build (pip, the Horovod wheel) land under $TMPDIR/buildah-cache.
mkdir -p "$storage" "$cache/tmp"
export TMPDIR=$cache/tmp
bh() { buildah --root "$storage" --runroot "$runroot" --storage-driver "$STORAGE_DRIVER" "$@"; }

# One run at a time on this storage; containers left by a run that was killed go first.
exec 9> "$cache/lock"
flock 9
bh rm --all > /dev/null 2>&1 || true

work=$(mktemp -d /tmp/hvdtrain-test-image.XXXXXX)
containers=()
worker_pid=
cleanup() {
  local status=$?
  if [[ -n ${build_pid:-} ]] && kill -0 "$build_pid" 2> /dev/null; then
    kill "$build_pid" 2> /dev/null || true
    wait "$build_pid" 2> /dev/null || true
  fi
  # The worker container (buildah run and its sshd) is a process group of its own.
  if [[ -n $worker_pid ]]; then
    kill -- "-$worker_pid" 2> /dev/null || true
    wait "$worker_pid" 2> /dev/null || true
  fi
  for c in "${containers[@]}"; do bh rm "$c" > /dev/null 2>&1 || true; done
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
total_start=$SECONDS

# ---------------------------------------------------------------- base image: Debian 12

base_tar=$cache/debian12-minbase.tar
if [[ ! -s $base_tar ]]; then
  say "debootstrap: Debian 12 (bookworm) minbase from $mirror"
  start=$SECONDS
  debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log"; die "debootstrap failed"; }
  tar -C "$work/rootfs" -cf "$base_tar.part" . && mv "$base_tar.part" "$base_tar"
  rm -rf "$work/rootfs"
  echo "debootstrap: $(elapsed "$start")"
fi

# The base carries this machine's settings for reaching the registries: its extra CA certificates
# (the image's ca-certificates package adds them to the bundle pip uses), its Debian sources and
# apt's Acquire settings. The tag changes when any of them, or the root file system, does.
host_settings() {
  cat /usr/local/share/ca-certificates/*.crt 2> /dev/null || true
  cat /etc/apt/sources.list.d/debian.sources 2> /dev/null || true
  grep -h '^Acquire::' /etc/apt/apt.conf.d/* 2> /dev/null || true
}
base_key=$( (echo "$base_recipe"; stat -c '%s %Y' "$base_tar"; host_settings) | sha256sum | cut -c1-12)
base=localhost/hvdtrain-base:debian12-$base_key
if ! bh inspect --type image "$base" > /dev/null 2>&1; then
  say "base image $base"
  ctr=$(bh from scratch)
  containers+=("$ctr")
  root=$(bh mount "$ctr")
  tar -C "$root" -xf "$base_tar"
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2> /dev/null || true
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/"
    rm -f "$root/etc/apt/sources.list"
  fi
  grep -h '^Acquire::' /etc/apt/apt.conf.d/* > "$root/etc/apt/apt.conf.d/99host-acquire" 2> /dev/null || true
  bh umount "$ctr" > /dev/null
  bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  bh commit --quiet --format docker "$ctr" "$base" > /dev/null
  bh rm "$ctr" > /dev/null
  containers=()
fi

# ---------------------------------------------------------------- build

build_args=(--build-arg "BASE_IMAGE=$base")
volumes=()
torch_version=$(sed -n 's/^ARG TORCH_SPEC=torch==//p' "$repo/docker/Dockerfile")
torch_wheel=${TORCH_WHEEL:-$(compgen -G "/opt/wheels/torch-${torch_version}+cpu-cp311-*.whl" | head -1 || true)}
if [[ -n $torch_wheel ]]; then
  # torch from a wheel on this machine; its dependencies from PyPI.
  volumes+=(-v "$(dirname "$torch_wheel"):/tmp/torch-wheel:ro")
  build_args+=(--build-arg "TORCH_SPEC=/tmp/torch-wheel/$(basename "$torch_wheel")"
               --build-arg "TORCH_INDEX_URL=https://pypi.org/simple")
fi

# The Horovod wheel: a wheel that install.py built on this host counts as cached for the image
# when the host is Debian 12 too (same Open MPI, glibc and Python minor; the wheel's tags say
# which Python). The image's install.py then installs it instead of compiling for minutes.
# HVDTRAIN_IMAGE_HOST_WHEEL=0 turns that off.
host_wheels=${HVDTRAIN_CACHE:-$HOME/.cache/hvdtrain}/wheels
image_wheels=$TMPDIR/buildah-cache/root/.cache/hvdtrain/debian12-cpython-311/wheels
if [[ ${HVDTRAIN_IMAGE_HOST_WHEEL:-1} == 1 && -d $host_wheels ]] \
   && grep -qx 'VERSION_ID="12"' /etc/os-release && grep -qx 'ID=debian' /etc/os-release; then
  while IFS= read -r whl; do
    dest=$image_wheels/$(basename "$(dirname "$whl")")
    if ! compgen -G "$dest/horovod-*.whl" > /dev/null; then
      echo "test-image: the image reuses this host's Horovod wheel $whl"
      mkdir -p "$dest" && cp "$whl" "$dest/"
    fi
  done < <(find "$host_wheels" -path '*+cpu-*/horovod-*-cp311-cp311-linux_x86_64.whl' 2> /dev/null)
fi

say "buildah build $image from $base"
start=$SECONDS
: > "$work/build.log"
bh build --layers --force-rm --format docker --ignorefile "$repo/docker/Dockerfile.dockerignore" \
  -f "$repo/docker/Dockerfile" "${build_args[@]}" "${volumes[@]}" -t "$image" "$repo" \
  > "$work/build.log" 2>&1 &
build_pid=$!
tail -f --pid="$build_pid" "$work/build.log" | grep --line-buffered -E '^(STEP|\[install\]|torch |Error)' \
  | cut -c1-160 || true
wait "$build_pid" || { tail -40 "$work/build.log"; die "buildah build failed"; }
bh inspect --type image "$image" > /dev/null || die "buildah build made no $image"
echo "build: $(elapsed "$start")"
# Layers of earlier builds that no tag uses any more.
bh rmi --prune > /dev/null 2>&1 || true
if [[ ${1:-} == --build-only ]]; then
  say "built $image in $storage ($STORAGE_DRIVER)"
  exit 0
fi

# ---------------------------------------------------------------- run

new_container() { # NAME: a working container of the image, removed at exit
  bh rm "$1" > /dev/null 2>&1 || true
  bh from --name "$1" --pull-never "$image" > /dev/null
  containers+=("$1")
}

# As `docker run --network host`: the image's user, entrypoint, working directory, environment; the
# host's network and host name. (buildah's own host name for a container is in no /etc/hosts, and
# Horovod's Gloo controller dies of SIGSEGV in hvd.init when the host name does not resolve.)
run_in() { # CONTAINER [buildah run options] -- ARGS...
  local ctr=$1
  shift
  local opts=()
  while [[ $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  # (The worker runs until the end of the script: no time limit, which would be a process group
  # of its own, out of reach of the cleanup.)
  local limit=(timeout "$check_timeout")
  if [[ -n ${NO_TIMEOUT:-} ]]; then limit=(); fi
  "${limit[@]}" buildah --root "$storage" --runroot "$runroot" --storage-driver "$STORAGE_DRIVER" \
    run --user 1000:1000 --network host --uts host "${opts[@]}" "$ctr" -- hvdtrain-entrypoint "$@"
}

# The runs folder is a mount, as in docs/containers.md, written by the container user.
mkdir -p "$work/runs"
chown 1000:1000 "$work/runs"
runs_mount=(-v "$work/runs:/opt/hvdtrain/runs")

check_run() { # RUN_NAME: the run reached the last step on 2 workers and wrote a checkpoint
  python3 - "$work/runs/$1" "$steps" <<'EOF' || die "$1: not the folder of a finished 2-worker run"
import json, sys
from pathlib import Path
run, steps = Path(sys.argv[1]), int(sys.argv[2])
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
assert any(r.get("step") == steps for r in records), f"no record of step {steps} in {run}/metrics.jsonl"
assert {r["world_size"] for r in records if "world_size" in r} == {2}, "not 2 workers"
assert any((run / "checkpoints").iterdir()), f"no checkpoint in {run}/checkpoints"
print(f"{run.name}: step {steps} reached on 2 workers, {len(records)} metrics records, checkpoint written")
EOF
}

# What the runs print, less the progress bars (the whole output is in the log file).
show() { grep --line-buffered -E 'step [0-9]+:|hvdtrain:|[Ee]rror|Traceback|worker' || true; }

a=hvdtrain-a-$$
new_container "$a"

say "1. hvdtrain doctor"
start=$SECONDS
run_in "$a" -- doctor | tee "$work/doctor.log" || die "hvdtrain doctor failed"
grep -q '^controllers.*Gloo.*MPI' "$work/doctor.log" || die "doctor: Gloo and MPI are not both built"
grep -q '^verdict: READY' "$work/doctor.log" || die "doctor: not READY"
echo "doctor: $(elapsed "$start")"

for controller in gloo mpi; do
  n=2; [[ $controller == gloo ]] || n=3
  say "$n. hvdtrain launch -np 2 --$controller recipes/gpt-tiny.yaml train.max_steps=$steps"
  start=$SECONDS
  run_in "$a" "${runs_mount[@]}" -- launch -np 2 "--$controller" recipes/gpt-tiny.yaml \
    "train.max_steps=$steps" "out_dir=runs/$controller" 2>&1 | tee "$work/$controller.log" | show \
    || die "the --$controller run failed (or took over $check_timeout s)"
  check_run "$controller"
  echo "$controller: $(elapsed "$start")"
done

say "4. two containers: a worker (sshd) and a launcher with -H 127.0.0.1:1,127.0.0.2:1"
start=$SECONDS
# A key pair for the "cluster", readable by the container user, mounted read-only in both.
mkdir -p "$work/keys"
ssh-keygen -q -t ed25519 -N '' -C hvdtrain-test -f "$work/keys/id_ed25519"
cp "$work/keys/id_ed25519.pub" "$work/keys/authorized_keys"
chown -R 1000:1000 "$work/keys"
chmod 700 "$work/keys"
# A free port for the worker's sshd; the launcher's ssh is told it with -p. Both "hosts" are this
# machine, with the same eth0 address: Open MPI's TCP transport between them hangs when offered
# eth0, so Horovod's and MPI's traffic is pinned to lo (--network-interface, as on a cluster).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
b=hvdtrain-b-$$
new_container "$b"
NO_TIMEOUT=1 setsid bash -c "$(declare -f run_in); $(declare -p storage runroot STORAGE_DRIVER check_timeout); "'run_in "$@"' \
  worker "$b" -v "$work/keys:/home/hvd/.ssh:ro" "${runs_mount[@]}" -e "SSH_PORT=$port" -- worker \
  > "$work/worker.log" 2>&1 &
worker_pid=$!
for _ in $(seq 60); do
  if (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then break; fi
  kill -0 "$worker_pid" 2> /dev/null || { cat "$work/worker.log"; die "the worker container stopped"; }
  sleep 1
done
(exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null || { cat "$work/worker.log"; die "no sshd on port $port"; }
cat "$work/worker.log"
for controller in mpi gloo; do
  run_in "$a" -v "$work/keys:/home/hvd/.ssh:ro" "${runs_mount[@]}" -- \
    launch -np 2 -H 127.0.0.1:1,127.0.0.2:1 "--$controller" --network-interface lo --horovodrun-args "-p $port" \
    recipes/gpt-tiny.yaml "train.max_steps=$steps" "out_dir=runs/hosts-$controller" 2>&1 \
    | tee "$work/hosts-$controller.log" | show \
    || { cat "$work/worker.log"; die "the two-container --$controller run failed (or took over $check_timeout s)"; }
  check_run "hosts-$controller"
done
# The second rank ran in the worker container: it prepared the data in its own cache.
run_in "$b" -- bash -c 'ls -d ~/.cache/hvdtrain/tokenized/*' > /dev/null 2>&1 \
  || die "the worker container has no data of its own: did rank 1 run there?"
echo "two containers: $(elapsed "$start")"

# A fixed global batch: every run saw the same batches, whatever the controller or the hosts.
python3 - "$work/runs" "$steps" <<'EOF' || die "the runs do not agree"
import json, sys
from pathlib import Path
runs, steps = Path(sys.argv[1]), int(sys.argv[2])
losses = {}
for name in ("gloo", "mpi", "hosts-mpi", "hosts-gloo"):
    records = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses[name] = [r["loss"] for r in records if r.get("step") == steps and "loss" in r][0]
print("loss at step", steps, losses)
assert max(losses.values()) - min(losses.values()) <= 1e-4 * abs(losses["gloo"]), "losses differ"
EOF

say "6. hvdtrain launch -np 2 on a terminal"
start=$SECONDS
# No timeout around buildah run here: timeout would run it in a background process group, which
# may not set up the terminal; terminal_check.py has its own time limit.
NO_TIMEOUT=1 "$repo/.venv/bin/python" "$repo/docker/terminal_check.py" "$steps" runs/terminal \
  bash -c "$(declare -f run_in); $(declare -p storage runroot STORAGE_DRIVER check_timeout); "'run_in "$@"' \
  terminal "$a" -t "${runs_mount[@]}" -- launch -np 2 recipes/gpt-tiny.yaml "train.max_steps=$steps" \
  out_dir=runs/terminal || die "launch on a terminal: not one clean stream"
check_run terminal
echo "terminal: $(elapsed "$start")"

say "passed in $(elapsed "$total_start")"
