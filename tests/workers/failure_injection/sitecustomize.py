"""Test aid: makes one worker of a real run fail, without changing hvdtrain.

Put this folder on PYTHONPATH (horovodrun and mpirun pass it to every worker) and set
HVDTRAIN_TEST_FAIL to `error` (a RuntimeError), `user-error` (a UserError) or `kill` (SIGKILL);
the worker of rank HVDTRAIN_TEST_FAIL_RANK (default 1) fails at its third backward pass,
while the other workers are in the middle of training. Python imports `sitecustomize` at start-up
in every process; processes without a rank (horovodrun itself) are left alone.
"""
import os

rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
failure = os.environ.get("HVDTRAIN_TEST_FAIL")

if failure and rank == os.environ.get("HVDTRAIN_TEST_FAIL_RANK", "1"):
    import signal

    import torch.autograd

    real_backward = torch.autograd.backward  # what Tensor.backward calls
    calls = 0

    def failing_backward(*args, **kwargs):
        global calls
        calls += 1
        if calls == 3:
            if failure == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if failure == "user-error":
                from hvdtrain.errors import UserError
                raise UserError("injected user error on this worker only")
            raise RuntimeError("injected failure in the middle of training")
        return real_backward(*args, **kwargs)

    torch.autograd.backward = failing_backward
