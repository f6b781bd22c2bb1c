"""Tokens/s of a bare training loop (the recipe's loss and AdamW, nothing else), rows interleaved."""

from __future__ import annotations

import dataclasses
import time

import torch

from experiments.config import ModelConfig, RunConfig
from experiments.lit import LMModule, adamw
from sweep.grid import Grid

TWIN = ":dense-twin"
COMPILED = ":compiled"  # the row with train.compile: the loss through torch.compile


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step(module: LMModule, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    """One training step as ``LMModule.training_step`` takes it: the loss plus the MoE's router
    losses, backward, AdamW (bf16 autocast on CUDA, as training)."""
    with torch.autocast(device_type=device(), dtype=torch.bfloat16, enabled=device() == "cuda"):
        loss = module.loss(batch)
        aux = module.auxiliary()
    opt.zero_grad(set_to_none=True)
    (loss if aux is None else loss + aux[0]).backward()
    opt.step()


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """The dense model a MoE model's tokens see: one SwiGLU of width ``top_k * expert_dim``."""
    return dataclasses.replace(cfg, moe=None, ffn_dim=cfg.moe.top_k * cfg.moe.expert_dim)


def configs(
    grid: Grid, scale: str, rows: list[str], twins: bool, compiled: str | None = None
) -> dict[str, RunConfig]:
    """The runs to time by name: each row's seed-0 config, ``<row>:dense-twin`` for MoE rows, and
    ``<compiled>:compiled`` (and ``<compiled>:eager``) with ``train.compile`` on (off) for the
    row ``compiled``, whatever its scale says.

    Raises:
        GridError: an unknown scale or row.
    """
    out = {}
    for cell in grid.cells(scale, seeds=[0], rows=rows):
        out[cell.row.id] = cell.config
        if twins and cell.config.model.moe is not None:
            out[cell.row.id + TWIN] = dataclasses.replace(cell.config, model=dense_twin(cell.config.model))
        if cell.row.id == compiled:
            for name, on in ((COMPILED, True), (EAGER, False)):
                train = dataclasses.replace(cell.config.train, compile=on)
                out[cell.row.id + name] = dataclasses.replace(cell.config, train=train)
    return out


EAGER = ":eager"


def setup(cfg: RunConfig) -> tuple[LMModule, torch.optim.Optimizer, torch.Tensor]:
    """The module, its optimiser and one random (B, T + 1) batch, warmed up (allocator, kernels)."""
    torch.manual_seed(0)
    module = LMModule(cfg, domains=["bench"]).to(device())
    opt = adamw(module.model, cfg.train)
    t = cfg.train
    batch = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), device=device())
    for _ in range(3):
        step(module, opt, batch)
    return module, opt, batch


def measure(
    runs: dict[str, RunConfig], rounds: int, steps: int, setup_times: dict[str, float] | None = None
) -> dict[str, list[float]]:
    """Tokens/s of each run in each of ``rounds`` rounds; a round times ``steps`` steps of every run
    in turn, so machine noise hits all of them alike. ``setup_times`` gets each run's setup seconds."""
    setups = {}
    for name, cfg in runs.items():
        start = time.perf_counter()
        setups[name] = setup(cfg)
        if setup_times is not None:
            setup_times[name] = time.perf_counter() - start
    figures: dict[str, list[float]] = {r: [] for r in setups}
    for _ in range(rounds):
        for name, (module, opt, batch) in setups.items():
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                step(module, opt, batch)
            sync()
            figures[name].append(steps * batch[:, 1:].numel() / (time.perf_counter() - start))
    return figures
