"""`hvdtrain doctor`: what this installation can do, and a one-line verdict."""
import platform
import sys

REBUILD = "rebuild with `make setup` (or `python scripts/install.py`), which builds Horovod for the installed torch"


def run_doctor(args) -> int:
    import torch

    print(f"python      {platform.python_version()} ({sys.executable})")
    print(f"torch       {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(gpus):
        print(f"gpu {i}       {torch.cuda.get_device_name(i)}")
    if not gpus:
        print("gpus        none (CPU training)")
    try:
        import horovod
        import horovod.torch as hvd
    except ImportError as e:
        print(f"horovod     not importable: {str(e).splitlines()[0]}")
        print(f"verdict: NOT READY - Horovod is missing or was built against another torch; {REBUILD}")
        return 1
    except Exception as e:  # HorovodVersionMismatchError and friends
        print(f"horovod     unusable: {str(e).splitlines()[0]}")
        print(f"verdict: NOT READY - Horovod does not match this torch; {REBUILD}")
        return 1
    controllers = [name for name, ok in (("Gloo", hvd.gloo_built()), ("MPI", hvd.mpi_built())) if ok]
    ops = [name for name, ok in (("NCCL", hvd.nccl_built()), ("DDL", hvd.ddl_built()), ("CCL", hvd.ccl_built()),
                                 ("ROCm", hvd.rocm_built()), ("Gloo", hvd.gloo_built()), ("MPI", hvd.mpi_built()))
           if ok]
    print(f"horovod     {horovod.__version__}")
    print("frameworks  PyTorch")
    print(f"controllers {', '.join(controllers) or 'none'}")
    print(f"tensor ops  {', '.join(ops) or 'none'}")
    if gpus and not hvd.nccl_built():
        print("verdict: DEGRADED - GPUs present but Horovod has no NCCL: GPU gradients go through the CPU; "
              "install NCCL (e.g. pip install nvidia-nccl-cu12) and " + REBUILD)
        return 1
    where = f"{gpus} GPU(s) with NCCL" if gpus else "CPU workers"
    print(f"verdict: READY - data-parallel training on {where} over {' and '.join(controllers)}")
    return 0
