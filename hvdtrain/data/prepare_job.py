"""`hvdtrain prepare CONFIG [key=value ...]`: tokenize the corpus into the data cache before training.

`train` does the same when it finds the data unprepared, on one process per host. Run on its
own, `prepare` can use many:

- alone, data.num_proc tokenizing processes (default: the cores it may use);
- under horovodrun, every worker tokenizes its share of the corpus's pieces with its own
  processes (default: the cores it may use, divided among the workers of its host that share
  them). When data.cache_dir is a folder every host sees, all the workers divide one
  preparation; otherwise each host prepares its own copy with its own workers, and `train`
  checks that the hosts' copies agree.

The result is the same files whatever the number of workers and processes. A preparation reads
every file it wrote back against its checksum; a start of training checks only the files'
sizes and a sample's checksums. `--verify` reads every file of a prepared folder back again
(divided among the workers under horovodrun): after copying a cache, or to be sure of old data.
"""
import logging
import os
import socket
from functools import partial
from pathlib import Path

from hvdtrain.launching.launch import add_config_args

log = logging.getLogger(__name__)

# Set by horovodrun (Gloo), Open MPI and MPICH / Intel MPI for each worker they start.
WORLD_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def run_prepare(args) -> int:
    from hvdtrain.config import load_config

    cfg = load_config(args.config, args.overrides)  # no torch yet: a mistake in the config is told at once
    from hvdtrain.data import preparation

    if any(int(os.environ.get(v, "1")) > 1 for v in WORLD_SIZE_VARIABLES):
        index, folder = prepare_with_workers(cfg, args.verify)
    else:
        plan = preparation.plan(cfg)
        index = preparation.prepare(plan, num_proc=cfg.data.num_proc, progress=cfg.log.progress, verify=args.verify)
        folder = plan.folder
    splits = index["splits"]
    log.info("prepared data in %s: %d training and %d validation tokens", folder, splits["train"]["tokens"],
             splits["validation"]["tokens"])
    return 0


def prepare_with_workers(cfg, verify: bool) -> tuple[dict, Path]:
    """This worker's part of a preparation by every worker of a Horovod job."""
    from hvdtrain.parallel import distributed
    from hvdtrain.data import preparation

    world = distributed.init(cfg)  # Horovod: hvd.init
    with distributed.leader_first(world, "tokenizer"):  # Horovod: barriers; one process per host trains a tokenizer
        plan = preparation.plan(cfg)
    group = sharing_group(world, plan.folder)
    num_proc = cfg.data.num_proc or cores_per_worker(world)
    index = preparation.prepare(plan, group, num_proc, progress=cfg.log.progress and world.rank == 0, verify=verify)
    return index, plan.folder


def sharing_group(world, folder):
    """The workers this one prepares `folder` with: all of them when every host sees the folder
    (each host leaves a marker in it; after a barrier, every worker looks for all of them),
    else the workers of its own host."""
    from hvdtrain.parallel import distributed
    from hvdtrain.data.preparation import Group

    hosts = (folder / ".hosts")
    hosts.mkdir(parents=True, exist_ok=True)
    (hosts / socket.gethostname()).touch()
    barrier = partial(distributed.barrier, "prepare.barrier")
    barrier()  # Horovod: barrier
    names = set(distributed.allgather_object(socket.gethostname(), name="prepare.hosts"))  # Horovod: allgather
    # Horovod: allgather
    shared = all(distributed.allgather_object(all((hosts / n).exists() for n in names), name="prepare.shared"))
    if shared:
        return Group(world.rank, world.size, barrier)
    return Group(world.local_rank, world.local_size, barrier)


def cores_per_worker(world) -> int:
    """The cores this worker may use, divided by the number of workers of its host whose
    affinity masks overlap its own: the whole host shared by all, or each worker's own cores
    when a launcher binds them to disjoint sets."""
    from hvdtrain.parallel import distributed

    mine = os.sched_getaffinity(0)
    # Horovod: allgather
    everyone = distributed.allgather_object((socket.gethostname(), sorted(mine)), name="prepare.cores")
    sharing = sum(1 for host, cores in everyone if host == socket.gethostname() and mine & set(cores))
    return max(1, len(mine) // sharing)


def add_cli(sub):
    p = sub.add_parser("prepare", help="tokenize the corpus into the data cache (in parallel, on many workers too)")
    add_config_args(p)
    p.add_argument("--verify", action="store_true",
                   help="read every token file of an already prepared folder back against its checksum (a start "
                        "of training checks only sizes and a sample); a damaged file is a one-line error")
    p.set_defaults(func=run_prepare)
