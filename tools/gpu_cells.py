"""The cells ``make gpu-check`` trains (``tools/gpu_check.py``): Table 1's rows at a scale on text
that needs no network, through the recipe a sweep's cell runs (Lightning, clipping, logging, the
deferred checks), with their speed and memory read back."""

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
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger

from experiments import names as N
from experiments.config import DataConfig, GateConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig
from experiments.train import Training
from tools.syncs import StepSyncs

#: Python's standard library: real text (code) every machine has, BPE'd where the check runs.
OFFLINE_SOURCES = ("stdlib",)


def _cache() -> Path | None:
    return Path(os.environ["GATED_ATTN_CACHE"]) if os.environ.get("GATED_ATTN_CACHE") else None


def offline_cell(row: str, scale: str, steps: int, compile: bool | None = None) -> RunConfig:
    """``grids/table1.yaml``'s ``row`` at ``scale`` for ``steps`` steps, validating once at the end,
    on :data:`OFFLINE_SOURCES`; ``compile`` None keeps the scale's own setting. bf16-mixed on a
    GPU; fp32 on a CPU (a dry run), whose emulated bf16 matmuls would take minutes a cell (the
    micro check runs the bf16 path there)."""
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


def _peak_gib() -> tuple[float, float]:
    """(allocated, reserved) peak GiB on CUDA (the caching allocator's reserve is what another
    process cannot have); the process's peak RSS twice on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB
    return rss, rss


class CheckClock(pl.Callback):
    """The wall clock at each check (every ``log_every`` steps, after the device's queue)."""

    def __init__(self, every: int) -> None:
        self.every, self.points = every, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.points.append((time.time(), trainer.global_step))


def overlap_tokens_per_s(cells: list[dict[str, Any]]) -> tuple[float, float]:
    """Tokens/s of cells that trained at once, over the span all of them were past their first
    window, and that span's seconds; each cell's steps in it interpolated from its clock. NaN and
    0 s when they never trained at once (too few ``--steps``)."""
    start = max(c["clock"][1][0] for c in cells)  # each one's first window is its start-up
    end = min(c["clock"][-1][0] for c in cells)
    if end <= start:  # a finding, not a failure: the report says so
        return float("nan"), 0.0
    steps = sum(
        (np.interp(end, *zip(*c["clock"])) - np.interp(start, *zip(*c["clock"]))) * c["tokens_per_step"]
        for c in cells
    )
    return float(steps) / (end - start), end - start


def cell_speed(cfg: RunConfig, callbacks: list[Any] = ()) -> dict[str, float]:
    """Train ``cfg``; its tokens/s (the logged windows after the first, which holds the start-up
    and any compiling), peak memory (GiB: ``max_memory_allocated`` on CUDA, the process's RSS on
    a CPU), first step's seconds and final Avg PPL."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    clock = CheckClock(cfg.train.log_every)
    with tempfile.TemporaryDirectory() as tmp:
        run = Training(cfg, _cache(), logger=CSVLogger(tmp), callbacks=[*callbacks, clock])
        run.fit()
        final = run.finish()
        lines = (Path(tmp) / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    col = header.index(N.TRAIN_TOKENS_PER_S)
    speeds = [float(r.split(",")[col]) for r in lines[1:] if r.split(",")[col]]
    steady = speeds[1:] or speeds
    allocated, reserved = _peak_gib()
    return {
        "tokens_per_s": sum(steady) / len(steady),
        "peak_gib": allocated,
        "reserved_gib": reserved,
        "clock": clock.points,
        "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len,
        "first_step_s": run.module.first_step_seconds or 0.0,
        "avg_ppl": final[N.VAL_PPL_AVG],
        "experts": "; ".join(run.experts_paths()),
    }


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
    return f"0 host syncs a step between checks; Avg PPL {result['avg_ppl']:.1f}; experts {result['experts']}"


def speed_lines(
    scale: str, steps: int, report: Any, peak: float | None, flops: Callable[[RunConfig], float]
) -> str:
    """Table 1's baseline and G1 at ``scale`` as the grid compiles them, and on a GPU the baseline
    with the other compile setting: tokens/s, MFU, peak memory and first step into the report."""
    runs = [("baseline", None), ("sdpa_elementwise", None)]
    if torch.cuda.is_available():  # a CPU dry run skips compiling (minutes on 2 cores)
        runs.append(("baseline", not offline_cell("baseline", scale, steps).train.compile))
    lines = []
    for row, compile in runs:
        cfg = offline_cell(row, scale, steps, compile)
        got = cell_speed(cfg)
        how = "compiled" if cfg.train.compile else "eager"
        mfu = f", MFU {got['tokens_per_s'] * flops(cfg) / peak:.1%}" if peak else ""
        name = f"{scale} {row} ({how})"
        report.figure(f"{name}: tokens/s", f"{got['tokens_per_s']:,.0f}{mfu}")
        report.figure(f"{name}: peak GiB, first step s", f"{got['peak_gib']:.1f}, {got['first_step_s']:.1f}")
        lines.append(f"{name} {got['tokens_per_s']:,.0f} tok/s{mfu}, {got['peak_gib']:.1f} GiB")
    return "; ".join(lines)
