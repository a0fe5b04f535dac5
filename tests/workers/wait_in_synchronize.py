"""Rank 0 sleeps SECONDS before its allreduce; rank 1 starts its allreduce at once and waits in
hvd.synchronize. Rank 1 prints the wall time of its wait and the CPU time its main thread (the
waiting one; not Horovod's background thread) spent meanwhile."""
import sys
import time

import horovod.torch as hvd
import torch

seconds = float(sys.argv[1])
hvd.init()
hvd.allreduce(torch.ones(1), name="warm-up")  # the rings are set up before the measured wait
if hvd.rank() == 0:
    time.sleep(seconds)
cpu, wall = time.thread_time(), time.monotonic()
hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="waited-for"))
if hvd.rank() == 1:
    print(f"waited {time.monotonic() - wall:.3f} s, cpu {time.thread_time() - cpu:.3f} s", flush=True)
