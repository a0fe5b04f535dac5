"""The training progress as a user reads it: a bar redrawn in place on a terminal, plain lines elsewhere.

Rank 0 reports progress at each log point. On a terminal it is a tqdm bar, with the messages
(evaluations, checkpoints, warnings) written above it, tqdm's way. Anywhere else (a log file,
Slurm's output, the pipe of `hvdtrain launch`) it is one plain line per log point:

    step 10/60: loss 7.3972, lr 1.00e-03, 2670 tokens/s, comm 4%

(a mixture of experts adds its router's load-balancing loss and the busiest expert's tokens
over the mean, the largest of any layer's: `, aux 0.0213, load 1.42`)

and the run's last line, its summary (hvdtrain.observe.run_log: RunLog.summary), starts with
SUMMARY: below the bar, which stays as it last was.

`hvdtrain launch` reads these lines back from rank 0's output (`parse_progress_line`) and, when
its own output is a terminal, draws them as the bar (hvdtrain.launching.relay): the workers'
output reaches it through horovodrun's pipes, where no bar can be drawn.
"""
import os
import re
import sys
from dataclasses import dataclass

from tqdm import tqdm

SUMMARY = "hvdtrain: done: "
# Set by `hvdtrain launch` for its workers: the launcher draws their progress.
LAUNCHED = "HVDTRAIN_LAUNCHED"
PROGRESS_LINE = re.compile(r"step (\d+)/(\d+): loss (\S+), lr (\S+), (\d+) tokens/s, comm (\d+)%"
                           r"(?:, aux (\S+), load (\S+))?$")


@dataclass
class Progress:
    """What a log point says: the step reached of how many, and the figures the bar shows."""
    step: int
    total: int
    loss: float
    lr: float
    tokens_per_s: float
    comm_fraction: float
    # a mixture of experts: the load-balancing loss (aux_loss) and the busiest expert's tokens
    # over the mean (expert_load_max); None for a dense model
    aux_loss: float | None = None
    expert_load: float | None = None

    def line(self) -> str:
        routing = "" if self.aux_loss is None else f", aux {self.aux_loss:.4f}, load {self.expert_load:.2f}"
        return (f"step {self.step}/{self.total}: loss {self.loss:.4f}, lr {self.lr:.2e}, "
                f"{self.tokens_per_s:.0f} tokens/s, comm {self.comm_fraction:.0%}{routing}")

    def postfix(self) -> dict:
        """The figures after the bar."""
        figures = {"loss": f"{self.loss:.4f}", "lr": f"{self.lr:.2e}", "tok_s": f"{self.tokens_per_s:.0f}",
                   "comm": f"{self.comm_fraction:.0%}"}
        if self.aux_loss is not None:
            figures.update(aux=f"{self.aux_loss:.4f}", load=f"{self.expert_load:.2f}")
        return figures


def on_terminal(stream) -> bool:
    """Whether a bar can be drawn on `stream`. Never in a worker of `hvdtrain launch`: its output
    goes to the launcher, through pipes or through mpirun's pseudo-terminal (a terminal to the
    worker, where a bar's redraws would reach the launcher as fragments of lines)."""
    return stream.isatty() and LAUNCHED not in os.environ


def parse_progress_line(line: str) -> Progress | None:
    """The Progress a line of `Progress.line()` holds; None for any other line."""
    match = PROGRESS_LINE.match(line.strip())
    if match is None:
        return None
    step, total, loss, lr, tokens_per_s, comm, aux, load = match.groups()
    return Progress(int(step), int(total), float(loss), float(lr), float(tokens_per_s), int(comm) / 100,
                    None if aux is None else float(aux), None if load is None else float(load))


class ProgressDisplay:
    """Progress and messages on one stream. `terminal`: draw the bar (else plain lines);
    `show_progress`: False shows the messages only."""

    def __init__(self, stream=None, terminal: bool | None = None, show_progress: bool = True):
        self.stream = stream or sys.stdout
        self.terminal = on_terminal(self.stream) if terminal is None else terminal
        self.show_progress = show_progress
        self.bar: tqdm | None = None  # made at the first progress on a terminal, until close()

    def update(self, progress: Progress):
        if not self.show_progress:
            return
        if not self.terminal:
            self._print(progress.line())
            return
        if self.bar is None:  # a resumed run starts its bar where it resumed
            self.bar = tqdm(total=progress.total, initial=progress.step, desc="train", unit="step",
                            dynamic_ncols=True, file=self.stream)
        self.bar.n = progress.step
        self.bar.set_postfix(progress.postfix(), refresh=False)
        self.bar.refresh()

    def message(self, text: str):
        """A line above the bar (or the next plain line)."""
        if self.bar is not None:
            self.bar.write(text.rstrip("\n"), file=self.stream)
        else:
            self._print(text.rstrip("\n"))

    def close(self):
        """The bar stays as it last was; what comes after goes below it."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _print(self, text: str):
        self.stream.write(text + "\n")
        self.stream.flush()
