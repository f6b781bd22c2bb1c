"""Training throughput of the baseline against gated rows, measured in the same process.

``python -m sweep.throughput --scale tiny`` (``make throughput``) prints tokens/s (forward,
backward and AdamW step, with the training loss and optimiser of ``experiments.lit``) for each
row, interleaving short timed blocks of every row so machine noise hits all of them alike, and
the gated row's throughput as a share of the baseline's. On CUDA it runs under bf16 autocast.

``--dense-twin`` adds, for every MoE row, a dense model of the same active parameters (the FFN a
token uses: one SwiGLU of width ``top_k * expert_dim``; only the router's ``d * E`` per layer
differs), timed in the same rounds, and prints the MoE's throughput as a share of its twin's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from experiments.config import ModelConfig, RunConfig
from experiments.lit import LMModule, adamw
from sweep.grid import load_grid

TWIN = ":dense-twin"


def _step(module: LMModule, opt: torch.optim.Optimizer, batch: torch.Tensor, device: str) -> None:
    """One training step as ``LMModule.training_step`` takes it: the loss plus the MoE's router
    losses, backward, AdamW."""
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = module.loss(batch)
        aux = module.auxiliary()
    opt.zero_grad(set_to_none=True)
    (loss if aux is None else loss + aux[0]).backward()
    opt.step()


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """The dense model a MoE model's tokens see: one SwiGLU of width ``top_k * expert_dim``."""
    return dataclasses.replace(cfg, moe=None, ffn_dim=cfg.moe.top_k * cfg.moe.expert_dim)


def configs(grid_file: str, scale: str, rows: list[str], twins: bool) -> dict[str, RunConfig]:
    """The runs to time by name: each row's seed-0 config, and ``<row>:dense-twin`` for MoE rows."""
    out = {}
    for cell in load_grid(grid_file).cells(scale, seeds=[0], rows=rows):
        out[cell.row.id] = cell.config
        if twins and cell.config.model.moe is not None:
            out[cell.row.id + TWIN] = dataclasses.replace(cell.config, model=dense_twin(cell.config.model))
    return out


def measure(runs: dict[str, RunConfig], rounds: int, steps: int) -> dict[str, list[float]]:
    """tokens/s per timed block, by run name."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    setups = {}
    for name, cfg in runs.items():
        torch.manual_seed(0)
        model = LMModule(cfg, domains=["bench"]).to(device)
        opt = adamw(model.model, cfg.train)
        t = cfg.train
        batch = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), device=device)
        for _ in range(3):  # warm-up: allocator, kernels
            _step(model, opt, batch, device)
        setups[name] = (model, opt, batch)
    figures: dict[str, list[float]] = {r: [] for r in setups}
    for _ in range(rounds):
        for row, (model, opt, batch) in setups.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                _step(model, opt, batch, device)
            if device == "cuda":
                torch.cuda.synchronize()
            figures[row].append(steps * batch[:, 1:].numel() / (time.perf_counter() - start))
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="grids/table1.yaml")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--rows", default="baseline,sdpa_elementwise,sdpa_headwise")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="training steps per timed block")
    p.add_argument("--dense-twin", action="store_true", help="also time a dense twin of each MoE row")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    runs = configs(args.grid, args.scale, rows, args.dense_twin)
    figures = measure(runs, args.rounds, args.steps)
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"training throughput, {args.grid} scale {args.scale}, {device}, torch {torch.__version__}")
    print(f"{args.rounds} interleaved rounds of {args.steps} steps; median tokens/s (min-max)")
    base = statistics.median(figures[rows[0]])
    for name, values in figures.items():
        med = statistics.median(values)
        total, active = runs[name].model.param_counts()
        print(
            f"  {name:<32} {med:>10.0f}  ({min(values):.0f}-{max(values):.0f})  "
            f"{100 * med / base:6.1f}% of {rows[0]}   params {total / 1e6:.2f}M, active {active / 1e6:.2f}M"
        )
    for name in runs:
        if name.endswith(TWIN):
            moe, dense = (statistics.median(figures[n]) for n in (name.removesuffix(TWIN), name))
            print(f"  MoE {name.removesuffix(TWIN)} / its dense twin: {moe / dense:.2f}x the tokens/s")


if __name__ == "__main__":
    main()
