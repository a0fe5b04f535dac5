"""scripts/install.py's decisions, checked without building anything.

Which Horovod features a machine gets (NCCL, MPI) is decided from what is on it: torch's CUDA
version, nvcc and mpicxx on PATH, nccl.h and libnccl.so somewhere. Each test builds a fake
machine of that kind in tmp_path (tools are empty scripts, libraries empty files) and reads the
HOROVOD_* variables the script would build with. The last tests check the sha256 pin on
Horovod's source package.
"""
import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

INSTALL = Path(__file__).resolve().parent.parent / "scripts" / "install.py"
CUDA_TORCH = {"version": "2.13.0+cu124", "cuda": "12.4"}
CPU_TORCH = {"version": "2.13.0+cpu", "cuda": None}


@pytest.fixture
def install(monkeypatch):
    """scripts/install.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("hvdtrain_install_script", INSTALL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Only the fake layouts count, not an NCCL or sshd this machine may have in /usr.
    monkeypatch.setattr(module, "SYSTEM_NCCL_HOMES", [])
    monkeypatch.setattr(module, "SBIN_DIRS", [])
    return module


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def fake_machine(tmp_path: Path, *tools: str) -> dict:
    """The environment of a machine whose PATH holds only `tools` (e.g. nvcc, mpicxx) and whose
    CUDA_HOME has no NCCL."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in tools:
        executable(bin_dir / tool)
    return {"PATH": str(bin_dir), "CUDA_HOME": str(tmp_path / "cuda"), "HOME": str(tmp_path)}


def fake_nccl_wheel(site: Path) -> Path:
    """site-packages/nvidia/nccl as the nvidia-nccl-cu12 wheel lays it out: nccl.h and
    libnccl.so.2, but no libnccl.so. nvidia/ gets an __init__.py so that it shadows a real
    nvidia package of the interpreter running the tests."""
    nccl = site / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (site / "nvidia" / "__init__.py").write_text("")
    (nccl / "__init__.py").write_text("")
    (nccl / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    (nccl / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF")
    return nccl


def fake_torch(site: Path, cuda: str | None):
    """A `torch` package that only answers torch_info()'s question."""
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("from torch import version\n__version__ = '2.13.0'\n")
    (site / "torch" / "version.py").write_text(f"cuda = {cuda!r}\n")


def assert_horovod_can_use(nccl_home: str, header: Path, library: Path):
    """Horovod's CMake looks for exactly <home>/include/nccl.h and <home>/lib/libnccl.so."""
    home = Path(nccl_home)
    assert (home / "include" / "nccl.h").resolve() == header.resolve()
    assert (home / "lib" / "libnccl.so").resolve() == library.resolve()


# ---------------------------------------------------------------- NCCL

def test_cuda_torch_with_the_nccl_wheel_builds_nccl_against_a_linked_layout(install, tmp_path, monkeypatch):
    wheel = fake_nccl_wheel(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))  # the script asks `python -c "import nvidia.nccl"`
    flags = install.detect(Path(sys.executable), CUDA_TORCH, tmp_path / "build", fake_machine(tmp_path, "nvcc"))

    assert flags["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert flags["HOROVOD_NCCL_LINK"] == "SHARED"
    assert_horovod_can_use(flags["HOROVOD_NCCL_HOME"], wheel / "include" / "nccl.h", wheel / "lib" / "libnccl.so.2")
    assert Path(flags["HOROVOD_NCCL_HOME"]).is_relative_to(tmp_path / "build")  # made in the build folder
    assert install.feature_tag(flags) == "gloo-nccl"


def nccl_home_machine(tmp_path):
    """A complete NCCL folder named by HOROVOD_NCCL_HOME, on a machine with nvcc: (folder, env)."""
    home = tmp_path / "nccl"
    executable(home / "include" / "nccl.h")
    executable(home / "lib" / "libnccl.so")
    return home, dict(fake_machine(tmp_path, "nvcc"), HOROVOD_NCCL_HOME=str(home))


def test_horovod_nccl_home_with_a_complete_layout_is_used_as_it_is(install, tmp_path):
    home, env = nccl_home_machine(tmp_path)
    flags = install.detect(None, CUDA_TORCH, tmp_path / "build", env)
    assert flags["HOROVOD_NCCL_HOME"] == str(home)
    assert not (tmp_path / "build").exists()


def test_system_nccl_in_a_multiarch_lib_folder_is_found_and_linked(install, tmp_path, monkeypatch):
    """libnccl-dev from the CUDA apt repo (what the nvidia/cuda devel images carry):
    /usr/include/nccl.h and /usr/lib/x86_64-linux-gnu/libnccl.so."""
    usr = tmp_path / "usr"
    executable(usr / "include" / "nccl.h")
    library = executable(usr / "lib" / "x86_64-linux-gnu" / "libnccl.so")
    executable(usr / "lib" / "x86_64-linux-gnu" / "libnccl.so.2")
    monkeypatch.setattr(install, "SYSTEM_NCCL_HOMES", [usr])
    flags = install.detect(None, CUDA_TORCH, tmp_path / "build", fake_machine(tmp_path, "nvcc"))
    assert_horovod_can_use(flags["HOROVOD_NCCL_HOME"], usr / "include" / "nccl.h", library)


def test_cpu_torch_gets_no_nccl_even_when_nvcc_and_nccl_are_there(install, tmp_path):
    home, env = nccl_home_machine(tmp_path)
    flags = install.detect(None, CPU_TORCH, tmp_path / "build", env)
    assert not {"HOROVOD_GPU_OPERATIONS", "HOROVOD_NCCL_HOME", "HOROVOD_NCCL_LINK",
                "HOROVOD_BUILD_CUDA_CC_LIST"} & flags.keys()
    assert install.feature_tag(flags) == "gloo"


def test_cuda_torch_without_nvcc_or_without_nccl_gets_no_nccl(install, tmp_path):
    home = tmp_path / "nccl"
    executable(home / "include" / "nccl.h")
    executable(home / "lib" / "libnccl.so")
    no_nvcc = dict(fake_machine(tmp_path), HOROVOD_NCCL_HOME=str(home))
    assert "HOROVOD_GPU_OPERATIONS" not in install.detect(None, CUDA_TORCH, tmp_path / "build", no_nvcc)
    no_nccl = fake_machine(tmp_path, "nvcc")
    assert "HOROVOD_GPU_OPERATIONS" not in install.detect(None, CUDA_TORCH, tmp_path / "build", no_nccl)


def test_cuda_architectures_come_from_the_environment(install, tmp_path):
    """The Dockerfile's HOROVOD_BUILD_CUDA_CC_LIST build argument reaches the build this way."""
    home = tmp_path / "nccl"
    executable(home / "include" / "nccl.h")
    executable(home / "lib" / "libnccl.so")
    env = dict(fake_machine(tmp_path, "nvcc"), HOROVOD_NCCL_HOME=str(home), HOROVOD_BUILD_CUDA_CC_LIST="90")
    assert install.detect(None, CUDA_TORCH, tmp_path / "build", env)["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"


# ---------------------------------------------------------------- MPI

def test_mpicxx_on_path_builds_the_mpi_controller(install, tmp_path):
    flags = install.detect(None, CPU_TORCH, tmp_path / "build", fake_machine(tmp_path, "mpicxx"))
    assert flags["HOROVOD_WITH_MPI"] == "1"
    assert "HOROVOD_WITHOUT_MPI" not in flags
    assert install.feature_tag(flags) == "gloo-mpi"


def test_without_mpicxx_mpi_is_left_out(install, tmp_path):
    flags = install.detect(None, CPU_TORCH, tmp_path / "build", fake_machine(tmp_path))
    assert flags["HOROVOD_WITHOUT_MPI"] == "1"
    assert "HOROVOD_WITH_MPI" not in flags


# ---------------------------------------------------------------- the command line

def print_horovod_env(tmp_path: Path, cuda: str | None) -> dict:
    """`install.py --no-venv --print-horovod-env` in a fresh process, on a fake machine: a torch
    with the given CUDA, the nvidia-nccl wheel, nvcc and mpicxx."""
    site = tmp_path / "site"
    fake_torch(site, cuda)
    fake_nccl_wheel(site)
    env = dict(fake_machine(tmp_path, "nvcc", "mpicxx"), PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, INSTALL, "--no-venv", "--python", sys.executable,
                           "--cache-dir", tmp_path / "cache", "--print-horovod-env"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_print_horovod_env_on_a_cuda_machine(tmp_path):
    flags = print_horovod_env(tmp_path, cuda="12.4")
    assert flags["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert flags["HOROVOD_NCCL_LINK"] == "SHARED"
    assert flags["HOROVOD_WITH_MPI"] == "1"
    # The wheel's layout here; a machine with a system NCCL in /usr gets that one. Either way:
    home = Path(flags["HOROVOD_NCCL_HOME"])
    assert (home / "include" / "nccl.h").exists() and (home / "lib" / "libnccl.so").exists()


def test_print_horovod_env_with_a_cpu_torch(tmp_path):
    flags = print_horovod_env(tmp_path, cuda=None)
    assert "HOROVOD_GPU_OPERATIONS" not in flags and "HOROVOD_NCCL_HOME" not in flags
    assert flags["HOROVOD_WITH_MPI"] == "1" and flags["HOROVOD_WITH_GLOO"] == "1"


# ---------------------------------------------------------------- the pinned source package

def write_sdist(install, build_dir: Path) -> Path:
    """A well-formed horovod sdist holding the files HOROVOD_PATCHES edits and the package's
    __init__.py, but not the published one (so its sha256 differs from the pin)."""
    sdist = build_dir / f"horovod-{install.HOROVOD_VERSION}.tar.gz"
    files = [(rel, f"cmake_minimum_required(VERSION 3.13)\n{old}\n") for rel, old, _new in install.HOROVOD_PATCHES]
    with tarfile.open(sdist, "w:gz") as tar:
        for rel, text in [*files, ("horovod/__init__.py", f"__version__ = '{install.HOROVOD_VERSION}'\n")]:
            data = text.encode()
            info = tarfile.TarInfo(f"horovod-{install.HOROVOD_VERSION}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sdist


def no_commands(cmd, **kw):
    raise AssertionError(f"nothing may be downloaded or built, but it ran: {cmd}")


def test_a_tampered_sdist_is_refused_before_anything_is_unpacked_or_built(install, tmp_path, monkeypatch):
    build = tmp_path / "build"
    build.mkdir()
    sdist = write_sdist(install, build)
    monkeypatch.setattr(install, "run", no_commands)
    with pytest.raises(SystemExit) as exit_info:
        install.fetch_patched_source(Path("/nonexistent/python"), build)
    # A message as exit code: Python prints it and exits with status 1.
    assert "does not match the pinned" in str(exit_info.value.code)
    assert not sdist.exists()  # removed, so the next run downloads it again
    assert not (build / f"horovod-{install.HOROVOD_VERSION}").exists()


def test_an_sdist_matching_the_pin_is_unpacked_and_patched_for_cxx17(install, tmp_path, monkeypatch):
    build = tmp_path / "build"
    build.mkdir()
    sdist = write_sdist(install, build)
    monkeypatch.setattr(install, "HOROVOD_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    monkeypatch.setattr(install, "run", no_commands)
    src = install.fetch_patched_source(Path("/nonexistent/python"), build)
    for rel, old, new in install.HOROVOD_PATCHES:
        text = (src / rel).read_text()
        assert new in text and old not in text, rel
    # the tag that ensure_horovod compares with an installed Horovod's
    assert f'hvdtrain_patches = "{install.HOROVOD_PATCHES_TAG}"' in (src / "horovod" / "__init__.py").read_text()


@pytest.mark.parametrize("has_filter", [True, False], ids=["python-3.12", "python-3.11.2"])
def test_the_sdist_unpacks_with_and_without_tarfile_extraction_filters(install, tmp_path, monkeypatch, has_filter):
    """Extraction filters exist from Python 3.12 and 3.11.4 / 3.10.12 on; Debian 12's 3.11.2 has none."""
    if not has_filter:
        monkeypatch.delattr(install.tarfile, "data_filter", raising=False)
        real_extractall = tarfile.TarFile.extractall

        def extractall_of_3_11_2(self, path=".", members=None, *, numeric_owner=False):
            return real_extractall(self, path, members, numeric_owner=numeric_owner)

        monkeypatch.setattr(tarfile.TarFile, "extractall", extractall_of_3_11_2)
    build = tmp_path / "build"
    build.mkdir()
    sdist = write_sdist(install, build)
    monkeypatch.setattr(install, "HOROVOD_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    src = install.fetch_patched_source(Path("/nonexistent/python"), build)
    assert all(new in (src / rel).read_text() for rel, _old, new in install.HOROVOD_PATCHES)


# ---------------------------------------------------------------- system packages (apt)

def fake_apt_machine(tmp_path: Path, *tools: str) -> dict:
    """A machine with apt-get (which records its arguments and DEBIAN_FRONTEND) and `tools`."""
    env = fake_machine(tmp_path, *tools)
    apt = tmp_path / "bin" / "apt-get"
    apt.write_text(f'#!/bin/sh\necho "$DEBIAN_FRONTEND $*" >> {tmp_path / "apt.log"}\n')
    apt.chmod(0o755)
    return env


def apt_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def set_up_system(install, tmp_path, env, is_root=True, python=sys.executable, make_venv=True, sshd=False):
    missing = install.missing_system_packages(python, env, make_venv, sshd)
    install.ensure_system_packages(missing, env, is_root)
    return apt_calls(tmp_path)


def test_as_root_with_apt_open_mpi_is_installed_non_interactively_after_an_update(install, tmp_path, capsys):
    env = fake_apt_machine(tmp_path, "cmake", "g++")
    assert set_up_system(install, tmp_path, env) == [
        "noninteractive update", "noninteractive install -y --no-install-recommends openmpi-bin libopenmpi-dev"]
    assert "installing openmpi-bin libopenmpi-dev (Open MPI" in capsys.readouterr().out


@pytest.mark.parametrize("is_root,apt,reason", [(False, True, "not root"), (True, False, "no apt-get")])
def test_without_root_or_apt_nothing_is_installed_and_the_log_says_why(install, tmp_path, capsys, is_root, apt, reason):
    env = (fake_apt_machine if apt else fake_machine)(tmp_path, "cmake", "g++")
    assert set_up_system(install, tmp_path, env, is_root=is_root) == []
    out = capsys.readouterr().out
    assert "not installing openmpi-bin libopenmpi-dev" in out and reason in out and "Gloo only" in out


def test_a_machine_with_everything_installs_nothing(install, tmp_path, capsys):
    env = fake_apt_machine(tmp_path, "mpicxx", "cmake", "c++")
    assert set_up_system(install, tmp_path, env, sshd=False) == []
    assert capsys.readouterr().out == ""


def test_build_tools_and_the_ssh_server_are_installed_when_missing(install, tmp_path):
    env = fake_apt_machine(tmp_path, "mpicxx")
    calls = set_up_system(install, tmp_path, env, sshd=True)
    assert calls[-1] == "noninteractive install -y --no-install-recommends cmake g++ openssh-server"


def test_a_debian_system_python_gets_its_venv_module_and_headers(install, tmp_path):
    """Debian and Ubuntu ship `python3 -m venv` (ensurepip) and Python.h as separate packages."""
    env = fake_apt_machine(tmp_path, "mpicxx", "cmake", "g++")
    system_python = tmp_path / "python3.11"
    probe = {"version": "3.11", "system": True, "headers": False, "ensurepip": False}
    system_python.write_text(f"#!/bin/sh\necho '{json.dumps(probe)}'\n")
    system_python.chmod(0o755)
    calls = set_up_system(install, tmp_path, env, python=str(system_python))
    assert calls[-1] == "noninteractive install -y --no-install-recommends python3.11-dev python3.11-venv"
    # In an existing venv (or the container's --no-venv) the venv module is not needed.
    (tmp_path / "apt.log").unlink()
    calls = set_up_system(install, tmp_path, env, python=str(system_python), make_venv=False)
    assert calls[-1] == "noninteractive install -y --no-install-recommends python3.11-dev"


def test_the_real_probe_answers_on_this_interpreter(install):
    probe = json.loads(install.python_says(sys.executable, install.PYTHON_PROBE))
    assert probe["version"] == "%d.%d" % sys.version_info[:2] and probe["headers"] in (True, False)


# ---------------------------------------------------------------- the wheel cache and the installed Horovod

def horovod_set_up(install, tmp_path, monkeypatch, machine_flags: dict, installed: str | None,
                   cached_tags: list[str], installed_patches: str | None = None) -> list[str]:
    """ensure_horovod on a machine whose build flags are `machine_flags`, with a Horovod of the
    `installed` features (None: none importable) built with `installed_patches` (None: today's
    HOROVOD_PATCHES), and cached wheels under these feature tags (each one followed by today's
    patches tag unless it names its own). Returns what it did: the wheel folder it installed
    from, or "build"."""
    cache = tmp_path / "cache"
    for tag in cached_tags:
        folder = tag if tag.count("-") > 1 else f"{tag}-{install.HOROVOD_PATCHES_TAG}"
        wheel = cache / "wheels" / f"torch-{CPU_TORCH['version']}-{folder}" / "horovod-0.28.1-cp311-linux_x86_64.whl"
        wheel.parent.mkdir(parents=True)
        wheel.write_text("")
    done = []
    says = None if installed is None else f"{installed} {installed_patches or install.HOROVOD_PATCHES_TAG}"
    monkeypatch.setattr(install, "torch_info", lambda python: CPU_TORCH)
    monkeypatch.setattr(install, "detect", lambda *a: machine_flags)
    monkeypatch.setattr(install, "python_says", lambda python, code: says if code == install.INSTALLED_FEATURES else None)

    def build(*a):
        done.append("build")
        raise StopIteration  # no real build in a unit test

    monkeypatch.setattr(install, "fetch_patched_source", build)
    monkeypatch.setattr(install, "run", lambda cmd, **kw: done.extend(
        Path(c).parent.name for c in cmd if str(c).endswith(".whl")))
    try:
        install.ensure_horovod(Path("/venv/bin/python"), cache, jobs=1)
    except StopIteration:
        pass
    return done


GLOO_MPI = {"HOROVOD_WITH_GLOO": "1", "HOROVOD_WITH_MPI": "1"}
GLOO_ONLY = {"HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_MPI": "1"}


def folder(install, features: str) -> str:
    return f"torch-{CPU_TORCH['version']}-{features}-{install.HOROVOD_PATCHES_TAG}"


def test_the_wheel_cache_key_covers_mpi(install, tmp_path, monkeypatch):
    """A Gloo-only wheel in the cache is not used on a machine that has Open MPI, and the other way round."""
    assert horovod_set_up(install, tmp_path / "a", monkeypatch, GLOO_MPI, None, ["gloo"]) == ["build"]
    assert horovod_set_up(install, tmp_path / "b", monkeypatch, GLOO_MPI, None, ["gloo", "gloo-mpi"]) == [
        folder(install, "gloo-mpi")]
    assert horovod_set_up(install, tmp_path / "c", monkeypatch, GLOO_ONLY, None, ["gloo", "gloo-mpi"]) == [
        folder(install, "gloo")]


def test_an_installed_gloo_only_horovod_is_replaced_once_open_mpi_is_there(install, tmp_path, monkeypatch, capsys):
    assert horovod_set_up(install, tmp_path / "a", monkeypatch, GLOO_MPI, "gloo-mpi", []) == []
    assert "Horovod is installed (gloo-mpi)" in capsys.readouterr().out
    assert horovod_set_up(install, tmp_path / "b", monkeypatch, GLOO_MPI, "gloo", ["gloo-mpi"]) == [
        folder(install, "gloo-mpi")]
    assert "has gloo with patches" in capsys.readouterr().out
    # A Horovod with more than this machine would build (MPI, but mpicxx not on PATH now) stays.
    assert horovod_set_up(install, tmp_path / "c", monkeypatch, GLOO_ONLY, "gloo-mpi", []) == []


def test_a_horovod_built_with_other_patches_is_neither_kept_nor_reused(install, tmp_path, monkeypatch, capsys):
    """The spinning wait (HOROVOD_PATCHES) is fixed only in a Horovod built with today's patches:
    one installed by an earlier hvdtrain is replaced, and a wheel cached by it is not installed."""
    earlier = "gloo-mpi-0123456789ab"
    assert horovod_set_up(install, tmp_path / "a", monkeypatch, GLOO_MPI, "gloo-mpi", [earlier],
                          installed_patches="unpatched") == ["build"]
    assert "with patches unpatched" in capsys.readouterr().out
    assert horovod_set_up(install, tmp_path / "b", monkeypatch, GLOO_MPI, "gloo-mpi", [earlier, "gloo-mpi"],
                          installed_patches="0123456789ab") == [folder(install, "gloo-mpi")]
    # one built with neither Gloo nor MPI prints no features: replaced too
    assert horovod_set_up(install, tmp_path / "c", monkeypatch, GLOO_MPI, "", ["gloo-mpi"]) == [
        folder(install, "gloo-mpi")]
