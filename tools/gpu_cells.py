"""The cells ``make gpu-check`` trains (``tools/gpu_check.py``): Table 1's rows at a scale on text
that needs no network, through the recipe a sweep's cell runs (Lightning, clipping, logging, the
deferred checks), with their speed and memory read back; packed cells meet at a file barrier
before the window they measure."""

from __future__ import annotations

import dataclasses
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from experiments import names as N
from experiments.config import DataConfig, GateConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig
from experiments.train import Training
from tools.syncs import StepSyncs

#: Python's standard library: real text (code) every machine has, BPE'd where the check runs.
OFFLINE_SOURCES = ("stdlib",)
#: Seconds a packed cell waits at the barrier for the others before it measures alone.
BARRIER_TIMEOUT_S = 600.0


def _cache() -> Path | None:
    return Path(os.environ["GATED_ATTN_CACHE"]) if os.environ.get("GATED_ATTN_CACHE") else None


def offline_cell(row: str, scale: str, steps: int, compile: bool | None = None) -> RunConfig:
    """``grids/table1.yaml``'s ``row`` at ``scale`` for ``steps`` steps on :data:`OFFLINE_SOURCES`,
    logging four windows of tokens/s; ``compile`` None keeps the scale's own setting. bf16-mixed on
    a GPU; fp32 on a CPU (a rehearsal), whose emulated bf16 matmuls would take minutes a cell (the
    micro check runs the bf16 path there). :func:`cell_speed` trains it without validating (a
    compiled validation is a second graph to compile)."""
    from sweep.grid import load_grid

    (cell,) = load_grid("grids/table1.yaml").cells(scale, seeds=[0], rows=[row])
    cfg, t = cell.config, cell.config.train
    chars = 3_000_000 if scale != "tiny" else 400_000
    data = DataConfig(sources=OFFLINE_SOURCES, vocab_size=cfg.data.vocab_size, max_chars_per_source=chars)
    train = dataclasses.replace(
        t, max_steps=steps, warmup_steps=max(1, steps // 10), val_every=steps, val_tokens=t.seq_len + 1,
        checkpoint_every=0, log_every=max(1, steps // 4),
        precision="bf16-mixed" if torch.cuda.is_available() else "32-true",
        compile=t.compile if compile is None else compile,
    )  # fmt: skip
    return dataclasses.replace(cfg, data=data, train=train)


def peak_gib() -> tuple[float, float]:
    """(allocated, reserved) peak GiB on CUDA (the caching allocator's reserve is what another
    process cannot have); the process's peak RSS twice on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB
    return rss, rss


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Deadline(pl.Callback):
    """Stops the fit after the step that ends past ``deadline`` (``time.time()``): the budget's."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.stopped_at = deadline, None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if time.time() > self.deadline and not trainer.should_stop:
            trainer.should_stop, self.stopped_at = True, trainer.global_step


class Barrier(pl.Callback):
    """A packed cell's measured window: after ``warmup`` steps (its compile and warm-up) it writes
    ``folder/ready<index>`` and waits until ``count`` cells have, then times ``window`` steps from
    the moment all were ready, and stops. Its ``start`` and ``end`` are wall-clock seconds after
    the GPU's queue (``time.time()``: one clock for every process)."""

    def __init__(self, folder: Path, index: int, count: int, warmup: int, window: int) -> None:
        self.folder, self.index, self.count, self.warmup, self.window = folder, index, count, warmup, window
        self.start = self.end = None
        self.waited = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.warmup or self.start is not None:
            return
        _sync()
        (self.folder / f"ready{self.index}").touch()
        began = time.time()
        while len(list(self.folder.glob("ready*"))) < self.count and time.time() - began < BARRIER_TIMEOUT_S:
            time.sleep(0.005)
        self.start = time.time()
        self.waited = self.start - began

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.start is not None and self.end is None and trainer.global_step >= self.warmup + self.window:
            _sync()
            self.end = time.time()
            trainer.should_stop = True


def cell_speed(cfg: RunConfig, callbacks: list[Any] = (), deadline: float | None = None) -> dict[str, Any]:
    """Train ``cfg`` without validating (to its last step, or the ``deadline``); its tokens/s
    (the logged windows after the first, which holds the start-up and any compiling), peak memory
    (GiB: allocated and reserved on CUDA, the process's RSS on a CPU), first step's seconds,
    steps taken, last training loss and experts' path."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    stop = Deadline(deadline if deadline is not None else float("inf"))
    with tempfile.TemporaryDirectory() as tmp:
        run = Training(cfg, _cache(), logger=CSVLogger(tmp), callbacks=[*callbacks, stop])
        run.trainer.limit_val_batches = 0  # no validation: the compiled one is another graph
        run.fit()
        lines = (Path(tmp) / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, line.split(","))) for line in lines[1:]]
    speeds = [float(r[N.TRAIN_TOKENS_PER_S]) for r in rows if r.get(N.TRAIN_TOKENS_PER_S)]
    losses = [float(r[N.TRAIN_LOSS]) for r in rows if r.get(N.TRAIN_LOSS)]
    steady = speeds[1:] or speeds
    allocated, reserved = peak_gib()
    return {
        "tokens_per_s": sum(steady) / max(1, len(steady)),
        "peak_gib": allocated,
        "reserved_gib": reserved,
        "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len,
        "first_step_s": run.module.first_step_seconds or 0.0,
        "steps": run.step,
        "stopped_by_budget": stop.stopped_at,
        "loss": losses[-1] if losses else float("nan"),
        "experts": "; ".join(run.experts_paths()),
    }


def packed_cell(row: str, scale: str, folder: Path, index: int, count: int, warmup: int, window: int) -> dict:
    """One of ``count`` cells packed on the GPU (its own process): ``warmup`` steps, the barrier,
    ``window`` timed steps; its tokens/s over that window, its window and its peak memory."""
    barrier = Barrier(folder, index, count, warmup, window)
    got = cell_speed(offline_cell(row, scale, warmup + window + 1), [barrier])
    if barrier.end is None:
        raise RuntimeError(f"packed cell {index} stopped before its window ended (step {got['steps']})")
    seconds = barrier.end - barrier.start
    got.update(start=barrier.start, end=barrier.end, waited=barrier.waited,
               window_tokens_per_s=window * got["tokens_per_step"] / seconds)  # fmt: skip
    return got


def micro_syncs(report: Any) -> str:
    """A micro MoE with the G1 gate through the cell's path in bf16-mixed: host syncs per step
    between the checks, which must be none."""
    model = ModelConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
        max_seq_len=64, gate=GateConfig(position="sdpa"), moe=MoEConfig(n_experts=8, top_k=2, expert_dim=32),
    )  # fmt: skip
    train = TrainConfig(
        max_steps=12, batch_size=8, seq_len=64, warmup_steps=2, val_every=12, val_tokens=1024,
        checkpoint_every=0, log_every=4, precision="bf16-mixed",
    )  # fmt: skip
    data = DataConfig(sources=OFFLINE_SOURCES, vocab_size=512, max_chars_per_source=200_000)
    counter = StepSyncs()
    result = cell_speed(RunConfig(model=model, train=train, data=data), [counter])
    worst = max((sum(c.values()) for c in counter.steady(train.log_every).values()), default=0)
    report.figure("host syncs per step between checks (micro MoE, bf16-mixed)", str(worst))
    if worst:
        raise AssertionError(f"{worst} host syncs in a step between checks: {counter.steady(4)}")
    return f"0 host syncs a step between checks; loss {result['loss']:.2f}; experts {result['experts']}"


def speed_cell(
    row: str, scale: str, steps: int, compile: bool | None, report: Any, peak: float | None,
    flops: Callable[[RunConfig], float], deadline: float,
) -> str:  # fmt: skip
    """``row`` at ``scale`` for ``steps`` steps, compiled as ``compile`` says (None: as the grid
    says): tokens/s, MFU, allocated and reserved peak and first step into the report, each figure
    as it is measured."""
    cfg = offline_cell(row, scale, steps, compile)
    got = cell_speed(cfg, deadline=deadline)
    how = "compiled" if cfg.train.compile else "eager"
    name = f"{scale} {row} ({how})"
    mfu = f", MFU {got['tokens_per_s'] * flops(cfg) / peak:.1%}" if peak else ""
    cut = f", stopped by the budget at step {got['stopped_by_budget']}" if got["stopped_by_budget"] else ""
    report.figure(f"{name}: tokens/s", f"{got['tokens_per_s']:,.0f}{mfu}{cut}")
    report.figure(
        f"{name}: peak GiB allocated, reserved", f"{got['peak_gib']:.1f}, {got['reserved_gib']:.1f}"
    )
    report.figure(f"{name}: first step s", f"{got['first_step_s']:.1f}")
    return f"{got['steps']} steps, {got['tokens_per_s']:,.0f} tok/s{mfu}, {got['peak_gib']:.1f} GiB{cut}"
