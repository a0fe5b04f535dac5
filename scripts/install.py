#!/usr/bin/env python3
"""Set up an hvdtrain environment: venv, torch, Horovod built for this machine, hvdtrain.

One script for local set-up (`make setup`), CI and the container image. It only uses the
standard library and runs on Python 3.10.0 and later (Debian 12's 3.11.2, Ubuntu 22.04's 3.10,
24.04's 3.12 included), before anything is installed. Each step is skipped when its result is
already there, so a second call costs a few seconds.

On Debian and Ubuntu, run as root, it first installs with apt-get what the machine lacks:
Open MPI (so that Horovod is built with MPI besides Gloo), CMake and g++ for the build, the
system Python's venv module and headers, and with --sshd an OpenSSH server (the several-hosts
test starts its own on the loopback). Otherwise it says what it skipped and why.

Horovod's last release (0.28.1) does not build against current PyTorch and compilers as
published, so we download its source package from PyPI, check it against a pinned sha256,
patch it in a build folder and build a wheel. The wheel is cached per torch version (and
per feature set): Horovod refuses to import when torch changed after it was built.

    python3 scripts/install.py --venv .venv              # full set-up
    python3 scripts/install.py --print-horovod-env        # show the build flags it would use
    python3 scripts/install.py --sshd                     # CI: also what the several-hosts test needs
"""
import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
HOROVOD_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
DEFAULT_TORCH_SPEC = "torch==2.13.0"
# Horovod's setup_requires and build-time imports; installed before the no-isolation build.
HOROVOD_BUILD_DEPS = ["numpy", "cloudpickle", "psutil", "pyyaml", "packaging", "cffi", "setuptools", "wheel"]
REPO = Path(__file__).resolve().parent.parent

# (file in the sdist, text to find, replacement): C++17 for torch>=2.1 headers, CUDA 17 for nvcc 12/13;
# and a wait that can stop spinning. hvd.synchronize (every DistributedOptimizer step) polls its
# handle in a loop of sched_yield: a rank that waits for a slower one burns its core, so when
# workers share cores (CPU jobs, more ranks than cores) the rank being waited for is starved of it.
# Patched, with HVDTRAIN_HOROVOD_SPIN_US set (hvdtrain sets 50 in CPU workers:
# parallel/distributed.py), the wait spins that long, then sleeps 50 us between polls; unset, it
# spins as upstream does (a GPU worker has its cores, and its many short waits keep their latency).
# Measured on 2 cores, 4 workers (t=2 x 2 copies, 8 tiny steps): 46 s of steps spinning, 11 s not.
HOROVOD_PATCHES = [
    ("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"),
    ("horovod/torch/CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"),
    ("horovod/common/ops/cuda/CMakeLists.txt", "set(CMAKE_CUDA_STANDARD 11)", "set(CMAKE_CUDA_STANDARD 17)"),
    ("horovod/torch/mpi_ops_v2.cc",
     "void WaitAndClear(int handle) {\n"
     "  while (true) {\n"
     "    if (handle_manager.PollHandle(handle)) break;\n"
     "    {\n"
     "      py::gil_scoped_release release_python_gil;\n"
     "      std::this_thread::yield();\n",
     "void WaitAndClear(int handle) {\n"
     "  static const char* spin_us_set = std::getenv(\"HVDTRAIN_HOROVOD_SPIN_US\");\n"
     "  static const auto spin = std::chrono::microseconds(spin_us_set ? std::atol(spin_us_set) : 0);\n"
     "  const auto waiting_since = std::chrono::steady_clock::now();\n"
     "  while (true) {\n"
     "    if (handle_manager.PollHandle(handle)) break;\n"
     "    {\n"
     "      py::gil_scoped_release release_python_gil;\n"
     "      if (!spin_us_set || std::chrono::steady_clock::now() - waiting_since < spin) {\n"
     "        std::this_thread::yield();\n"
     "      } else {\n"
     "        std::this_thread::sleep_for(std::chrono::microseconds(50));\n"
     "      }\n"),
]
# gcc 13 no longer pulls these headers in transitively and Horovod forgot to include them.
GCC13_INCLUDES = ["cstdint", "string", "stdexcept", "limits", "memory", "functional", "algorithm"]
# Names what the build is made of: written into the built horovod/__init__.py and into the wheel
# cache's folder name, so that a Horovod built from another source or with other patches is
# rebuilt, not reused.
HOROVOD_PATCHES_TAG = hashlib.sha256(
    repr((HOROVOD_VERSION, HOROVOD_SHA256, HOROVOD_PATCHES, GCC13_INCLUDES)).encode()).hexdigest()[:12]


def log(msg):
    print(f"[install] {msg}", flush=True)


def run(cmd, env=None, cwd=None):
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, env=env, cwd=cwd)


def python_says(python, code):
    """Run `code` in `python`; return its stdout, or None when it fails."""
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


# ---------------------------------------------------------------- system packages (Debian, Ubuntu)

# What set-up asks of a base interpreter: its version, whether it is the system's (Debian and
# Ubuntu split venv and the C headers into packages for it) and whether it has them.
PYTHON_PROBE = ("import json, os, sys, sysconfig, importlib.util; print(json.dumps({"
                "'version': '%d.%d' % sys.version_info[:2], 'system': sys.base_prefix == '/usr', "
                "'headers': os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')), "
                "'ensurepip': importlib.util.find_spec('ensurepip') is not None}))")


# sshd lives in /usr/sbin, which is often not on a user's PATH. A list so tests can empty it.
SBIN_DIRS = ["/usr/sbin"]


def missing_system_packages(base_python: str, env: dict, make_venv: bool, sshd: bool) -> list[tuple[str, str]]:
    """(Debian/Ubuntu packages, what for) that this machine lacks for set-up."""
    path = env.get("PATH")
    python = json.loads(python_says(base_python, PYTHON_PROBE) or "{}")
    missing = []
    if shutil.which("mpicxx", path=path) is None:
        missing.append(("openmpi-bin libopenmpi-dev", "Open MPI; without it Horovod is built with Gloo only"))
    if shutil.which("cmake", path=path) is None:
        missing.append(("cmake", "Horovod's build"))
    if shutil.which("c++", path=path) is None and shutil.which("g++", path=path) is None:
        missing.append(("g++", "Horovod's build"))
    if python.get("system") and not python["headers"]:
        missing.append((f"python{python['version']}-dev", f"Python.h of {base_python}, for Horovod's build"))
    if python.get("system") and make_venv and not python["ensurepip"]:
        missing.append((f"python{python['version']}-venv", f"`{base_python} -m venv`"))
    if sshd and shutil.which("sshd", path=os.pathsep.join(filter(None, [path, *SBIN_DIRS]))) is None:
        missing.append(("openssh-server", "the several-hosts test, which starts its own sshd"))
    return missing


def ensure_system_packages(missing: list[tuple[str, str]], env: dict, is_root: bool):
    """apt-get install what is missing, when this is root on a machine with apt-get; else say why not."""
    if not missing:
        return
    packages = [name for names, _ in missing for name in names.split()]
    what = "; ".join(f"{names} ({why})" for names, why in missing)
    if shutil.which("apt-get", path=env.get("PATH")) is None:
        log(f"not installing {what}: no apt-get here, install them with this system's package manager")
        return
    if not is_root:
        log(f"not installing {what}: not root; `sudo apt-get install {' '.join(packages)}`, then set up again")
        return
    log(f"installing {what}")
    apt_env = dict(env, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update"], env=apt_env)
    run(["apt-get", "install", "-y", "--no-install-recommends", *packages], env=apt_env)


# ---------------------------------------------------------------- venv and torch

def ensure_venv(venv: Path, base_python: str) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    # Reuse a torch the user already has (e.g. a CUDA build) instead of downloading another one.
    reuse_torch = python_says(base_python, "import torch") is not None
    args = [base_python, "-m", "venv", str(venv)]
    if reuse_torch:
        log(f"{base_python} already has torch: the venv will see its site-packages")
        args.insert(3, "--system-site-packages")
    run(args)
    run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return python


def ensure_torch(python: Path, torch_spec: str):
    if python_says(python, "import torch") is not None:
        return
    run([python, "-m", "pip", "install", torch_spec])


def torch_info(python: Path) -> dict:
    out = python_says(python, "import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda}))")
    if out is None:
        sys.exit("[install] torch is not importable in the venv")
    return json.loads(out)


# ---------------------------------------------------------------- Horovod build flags

# Searched after HOROVOD_NCCL_HOME and CUDA_HOME: where libnccl-dev from the CUDA apt repo puts
# nccl.h and libnccl.so (/usr/include, /usr/lib/x86_64-linux-gnu). A list so tests can empty it.
SYSTEM_NCCL_HOMES = [Path("/usr")]


def nccl_libs(home: Path) -> list[str]:
    """libnccl.so* under home/lib, lib64 or a multiarch folder such as lib/x86_64-linux-gnu."""
    return sorted(glob.glob(str(home / "lib*" / "libnccl.so*")) + glob.glob(str(home / "lib" / "*" / "libnccl.so*")))


def has_nccl(home: Path) -> bool:
    return (home / "include" / "nccl.h").exists() and bool(nccl_libs(home))


def find_nccl_home(python: Path | None, env: dict) -> Path | None:
    """Where nccl.h and libnccl.so live: HOROVOD_NCCL_HOME, a system install, or the nvidia-nccl pip wheel."""
    candidates = []
    if env.get("HOROVOD_NCCL_HOME"):
        candidates.append(Path(env["HOROVOD_NCCL_HOME"]))
    candidates += [Path(env.get("CUDA_HOME", "/usr/local/cuda")), *SYSTEM_NCCL_HOMES]
    for home in candidates:
        if has_nccl(home):
            return home
    if python is not None:
        site = python_says(python, "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])")
        if site and has_nccl(Path(site)):
            return Path(site)
    return None


def nccl_layout_for_horovod(nccl_home: Path, build_dir: Path) -> Path:
    """Horovod wants <home>/include/nccl.h and <home>/lib/libnccl.so; the pip wheel ships libnccl.so.2
    only and Debian's libnccl-dev puts the library in lib/<multiarch>, so link both into one folder."""
    if (nccl_home / "lib" / "libnccl.so").exists():
        return nccl_home
    layout = build_dir / "nccl"
    (layout / "include").mkdir(parents=True, exist_ok=True)
    (layout / "lib").mkdir(parents=True, exist_ok=True)
    header = nccl_home / "include" / "nccl.h"
    lib = nccl_libs(nccl_home)[0]
    for link, target in [(layout / "include" / "nccl.h", header), (layout / "lib" / "libnccl.so", lib)]:
        if not link.exists():
            link.symlink_to(target)
    return layout


def horovod_build_env(torch: dict, env: dict, nccl_home: Path | None, has_mpi: bool, has_nvcc: bool) -> dict:
    """The HOROVOD_* variables for this machine. Pure function so tests can check the decisions."""
    flags = {
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        # CMake 4 rejects the cmake_minimum_required of Horovod's bundled gloo.
        "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
        "CXXFLAGS": " ".join([env.get("CXXFLAGS", "")] + [f"-include {h}" for h in GCC13_INCLUDES]).strip(),
    }
    flags["HOROVOD_WITH_MPI" if has_mpi else "HOROVOD_WITHOUT_MPI"] = "1"
    if torch.get("cuda") and has_nvcc and nccl_home is not None:
        flags.update({
            "HOROVOD_GPU_OPERATIONS": "NCCL",
            "HOROVOD_NCCL_HOME": str(nccl_home),
            "HOROVOD_NCCL_LINK": "SHARED",
            "HOROVOD_BUILD_CUDA_CC_LIST": env.get("HOROVOD_BUILD_CUDA_CC_LIST", "70,80,90"),
        })
    return flags


def feature_tag(flags: dict) -> str:
    tag = ["gloo"]
    if "HOROVOD_WITH_MPI" in flags:
        tag.append("mpi")
    if flags.get("HOROVOD_GPU_OPERATIONS") == "NCCL":
        tag.append("nccl")
    return "-".join(tag)


def detect(python: Path | None, torch: dict, build_dir: Path, env: dict) -> dict:
    nccl_home = find_nccl_home(python, env) if torch.get("cuda") else None
    has_nvcc = shutil.which("nvcc", path=env.get("PATH")) is not None or Path(env.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc").exists()
    if nccl_home is not None and has_nvcc:
        nccl_home = nccl_layout_for_horovod(nccl_home, build_dir)
    has_mpi = shutil.which("mpicxx", path=env.get("PATH")) is not None
    return horovod_build_env(torch, env, nccl_home, has_mpi, has_nvcc)


# ---------------------------------------------------------------- Horovod wheel

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_patched_source(python: Path, build_dir: Path) -> Path:
    sdist = build_dir / f"horovod-{HOROVOD_VERSION}.tar.gz"
    if not sdist.exists():
        run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"horovod=={HOROVOD_VERSION}", "-d", build_dir])
    digest = sha256(sdist)
    if digest != HOROVOD_SHA256:
        sdist.unlink()
        sys.exit(f"[install] {sdist.name}: sha256 {digest} does not match the pinned {HOROVOD_SHA256}")
    src = build_dir / f"horovod-{HOROVOD_VERSION}"
    shutil.rmtree(src, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        # The checksum above makes the archive the published one. Extraction filters came with
        # Python 3.12 and 3.11.4 / 3.10.12 (not Debian 12's 3.11.2): use one where there is one.
        tar.extractall(build_dir, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    for rel, old, new in HOROVOD_PATCHES:
        path = src / rel
        text = path.read_text()
        if old not in text:
            sys.exit(f"[install] patch target not found in {rel}: {old!r}")
        path.write_text(text.replace(old, new))
    with open(src / "horovod" / "__init__.py", "a") as init:
        init.write(f'\nhvdtrain_patches = "{HOROVOD_PATCHES_TAG}"  # scripts/install.py\'s HOROVOD_PATCHES_TAG\n')
    return src


# The feature tag of the Horovod installed in a venv and the tag of the patches it was built with,
# if it imports with this torch.
INSTALLED_FEATURES = ("import horovod, horovod.torch as h; "
                      "print('-'.join(['gloo'] * bool(h.gloo_built()) + ['mpi'] * bool(h.mpi_built()) + "
                      "['nccl'] * bool(h.nccl_built())), getattr(horovod, 'hvdtrain_patches', 'unpatched'))")


def ensure_horovod(python: Path, cache_dir: Path, jobs: int):
    torch = torch_info(python)
    build_dir = cache_dir / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = detect(python, torch, build_dir, dict(os.environ))
    installed = python_says(python, INSTALLED_FEATURES)
    if installed is not None:
        *_, features, patches = ["?", "?", *installed.split()]
        if set(feature_tag(flags).split("-")) <= set(features.split("-")) and patches == HOROVOD_PATCHES_TAG:
            log(f"Horovod is installed ({features}) and matches this torch and these patches")
            return
        log(f"the installed Horovod has {features} with patches {patches}; this machine can have "
            f"{feature_tag(flags)} with patches {HOROVOD_PATCHES_TAG}: replacing it")
    wheel_dir = cache_dir / "wheels" / f"torch-{torch['version']}-{feature_tag(flags)}-{HOROVOD_PATCHES_TAG}"
    wheels = sorted(wheel_dir.glob("horovod-*.whl"))
    if not wheels:
        run([python, "-m", "pip", "install", "-q", *HOROVOD_BUILD_DEPS])
        src = fetch_patched_source(python, build_dir)
        log(f"building Horovod {HOROVOD_VERSION} for torch {torch['version']} ({feature_tag(flags)}); "
            "about 4-5 minutes on 2 cores, once")
        env = dict(os.environ, **flags, MAKEFLAGS=f"-j{jobs}")
        with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
            run([python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir",
                 "-w", tmp, src], env=env)
            wheel_dir.mkdir(parents=True, exist_ok=True)
            for whl in Path(tmp).glob("horovod-*.whl"):
                shutil.move(str(whl), wheel_dir / whl.name)
        wheels = sorted(wheel_dir.glob("horovod-*.whl"))
    run([python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", wheels[-1]])
    run([python, "-m", "pip", "install", "-q", "cloudpickle", "psutil", "pyyaml", "packaging", "cffi", "setuptools"])


def ensure_hvdtrain(python: Path, extras: str):
    """Editable install of this repo; redone only when pyproject.toml (its dependency list) changed."""
    stamp = python.parent.parent / ".hvdtrain-setup-sha256"
    wanted = sha256(REPO / "pyproject.toml") + extras
    if stamp.exists() and stamp.read_text() == wanted and python_says(python, "import hvdtrain") is not None:
        return
    run([python, "-m", "pip", "install", "-q", "-e", f"{REPO}[{extras}]" if extras else str(REPO)])
    stamp.write_text(wanted)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default=str(REPO / ".venv"), help="virtual environment to create or reuse")
    parser.add_argument("--python", default=sys.executable, help="base interpreter for a new venv")
    parser.add_argument("--no-venv", action="store_true", help="install into --python itself (containers)")
    parser.add_argument("--torch-spec", default=os.environ.get("TORCH_SPEC", DEFAULT_TORCH_SPEC),
                        help="pip requirement for torch when none is importable (env TORCH_SPEC)")
    parser.add_argument("--cache-dir", default=os.environ.get("HVDTRAIN_CACHE", str(Path.home() / ".cache" / "hvdtrain")),
                        help="where the Horovod wheel is cached (env HVDTRAIN_CACHE)")
    parser.add_argument("--extras", default="test", help="hvdtrain extras to install ('' for none)")
    parser.add_argument("--no-hvdtrain", action="store_true",
                        help="stop after torch and Horovod (a container layer built before the code is copied)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--print-horovod-env", action="store_true",
                        help="print the Horovod build variables this machine gets, as JSON, and exit")
    parser.add_argument("--sshd", action="store_true",
                        help="also install an OpenSSH server (for the several-hosts test; CI sets it)")
    parser.add_argument("--no-apt", action="store_true", help="install no system packages, even as root")
    args = parser.parse_args()

    if not args.print_horovod_env and not args.no_apt:
        make_venv = not args.no_venv and not (Path(args.venv) / "bin" / "python").exists()
        missing = missing_system_packages(args.python, dict(os.environ), make_venv, args.sshd)
        ensure_system_packages(missing, dict(os.environ), is_root=os.geteuid() == 0)

    python = Path(args.python) if args.no_venv else ensure_venv(Path(args.venv), args.python)
    cache_dir = Path(args.cache_dir)
    if args.print_horovod_env:
        torch = torch_info(python)
        print(json.dumps(detect(python, torch, cache_dir / "build", dict(os.environ)), indent=2, sort_keys=True))
        return
    ensure_torch(python, args.torch_spec)
    ensure_horovod(python, cache_dir, args.jobs)
    if not args.no_hvdtrain:
        ensure_hvdtrain(python, args.extras)
    log("ready: " + (python_says(python, "import torch, horovod; print('torch', torch.__version__, '| horovod', horovod.__version__)") or "?"))


if __name__ == "__main__":
    main()
