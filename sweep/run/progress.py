"""Progress lines for a sweep: where it is and how long is left, a few lines per cell."""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning.pytorch as pl

from experiments.names import VAL_PPL_AVG


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class SweepClock:
    """Estimates the time left in a sweep from the cells finished so far.

    A queue worker sets :attr:`waiting` (cells no worker has taken yet) and :attr:`parallel`
    (workers training now) from the queue each time it takes a cell."""

    def __init__(self, n_cells: int) -> None:
        self.n_cells, self.done, self.spent = n_cells, 0, 0.0
        self.waiting: int | None = None
        self.parallel = 1

    def cell_done(self, seconds: float) -> None:
        self.done += 1
        self.spent += seconds

    def left(self, current_cell_left: float, current_cell_total: float) -> float:
        """Seconds left in the sweep, given the running cell's own estimate."""
        per_cell = self.spent / self.done if self.done else current_cell_total
        others = self.waiting if self.waiting is not None else max(0, self.n_cells - self.done - 1)
        return current_cell_left + per_cell * others / self.parallel


class ProgressPrinter(pl.Callback):
    """Prints one line at each quarter of a cell's steps and after each validation.

    Line: ``[3/14] sdpa_elementwise s0 | step 75/150 | loss 5.21 | 7.4k tok/s | cell 0:21 left |
    sweep 6:40 left``
    (loss: the module's moving average of the global batch's training loss as of its last check,
    ``LMModule.loss_ema``, which never waits for the device). A compiled cell's first line also
    gives its first step's seconds, mostly compiling.
    """

    def __init__(self, prefix: str, clock: SweepClock, out: Callable[[str], None] = print) -> None:
        self.prefix, self.clock, self.out = prefix, clock, out
        self.started = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()
        self.first_step = trainer.global_step  # > 0 for a resumed run
        self.report_at = {1} | {round(trainer.max_steps * k / 4) for k in range(1, 5)}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:  # not a step's last micro-batch
            return
        step, total = trainer.global_step, trainer.max_steps
        if step not in self.report_at:
            return
        ema = getattr(pl_module, "loss_ema", None)
        loss = "loss -" if ema is None else f"loss {ema:.3f}"
        elapsed = time.perf_counter() - self.started
        done = step - self.first_step  # steps this process trained
        if done <= 1:  # the first step carries start-up costs: no estimate from it
            first = getattr(pl_module, "first_step_seconds", None)
            compiled = pl_module.cfg.train.compile if hasattr(pl_module, "cfg") else False
            how = f" (first step {first:.1f} s, compiling)" if compiled and first is not None else ""
            self.out(f"{self.prefix} | step {step}/{total} | {loss} | started{how}")
            return
        cell_total = elapsed / done * (total - self.first_step)
        global_batch = batch[:, 1:].numel() * trainer.world_size * trainer.accumulate_grad_batches
        tok_s = done * global_batch / max(elapsed, 1e-9)
        self.out(
            f"{self.prefix} | step {step}/{total} | {loss} | {tok_s / 1e3:.1f}k tok/s | "
            f"cell {_clock(cell_total - elapsed)} left | "
            f"sweep {_clock(self.clock.left(cell_total - elapsed, cell_total))} left"
        )

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        avg = getattr(pl_module, "last_val", {}).get(VAL_PPL_AVG)
        if avg is not None and not trainer.sanity_checking:
            self.out(f"{self.prefix} | step {trainer.global_step} | val Avg PPL {avg:.2f}")
