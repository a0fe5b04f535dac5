"""On-demand profiling: torch.profiler on chosen ranks plus Horovod's timeline for the same steps.

With `profile.enabled=true`, the ranks in `profile.ranks` record `wait` + `warmup` + `active`
steps on a schedule; the active steps are written as a Chrome/Perfetto trace per rank
(OUT_DIR/profile/trace_rank{R}.json) with the named step phases as ranges, and the operator
table of `key_averages()` is saved (and printed by rank 0). The Horovod timeline
(OUT_DIR/profile/horovod_timeline.json) covers the same steps on all ranks, unless
horovod.timeline already records the whole run.
"""
from pathlib import Path

import torch

from hvdtrain.config import ProfileConfig


class Profiler:
    def __init__(self, cfg: ProfileConfig, out_dir: str, world, timer, whole_run_timeline: bool):
        self.cfg, self.world, self.timer = cfg, world, timer
        self.record_timeline = cfg.enabled and cfg.timeline and not whole_run_timeline
        self.dir = Path(out_dir) / "profile"
        self.step_count = 0
        self.prof = None
        if not cfg.enabled:
            return
        self.timeline_on = False
        if world.rank in cfg.ranks:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if world.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
                on_trace_ready=self.write,
                record_shapes=True, profile_memory=cfg.memory, with_stack=False)
            self.prof.start()
            timer.annotate = True

    def step(self):
        if not self.cfg.enabled:
            return
        self.step_count += 1
        if self.record_timeline:
            self.toggle_timeline()
        if self.prof is not None:
            self.prof.step()
            if self.step_count >= self.cfg.wait + self.cfg.warmup + self.cfg.active:
                self.prof.stop()  # the trace is written; detach the profiler so later steps run at full speed
                self.prof = None

    def toggle_timeline(self):
        """Horovod's timeline is global: every rank starts and stops it at the same steps."""
        import horovod.torch as hvd

        first, last = self.cfg.wait + self.cfg.warmup, self.cfg.wait + self.cfg.warmup + self.cfg.active
        if self.step_count == first and not self.timeline_on:
            self.dir.mkdir(parents=True, exist_ok=True)
            # Horovod: the timeline, started on every rank
            hvd.start_timeline(str(self.dir / "horovod_timeline.json"), mark_cycles=False)
            self.timeline_on = True
        elif self.step_count == last and self.timeline_on:
            hvd.stop_timeline()
            self.timeline_on = False

    def write(self, prof):
        self.dir.mkdir(parents=True, exist_ok=True)
        rank = self.world.rank
        prof.export_chrome_trace(str(self.dir / f"trace_rank{rank}.json"))
        sort = "cuda_time_total" if self.world.device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (self.dir / f"ops_rank{rank}.txt").write_text(table)
        if self.cfg.memory:
            (self.dir / f"memory_rank{rank}.txt").write_text(
                prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=30))
        if rank == 0:
            print(table, flush=True)
        self.timer.annotate = False

    def close(self):
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        if self.record_timeline and self.timeline_on:
            import horovod.torch as hvd
            hvd.stop_timeline()
            self.timeline_on = False
