"""Training throughput of the baseline against gated rows, measured in the same process.

``python -m sweep.bench --scale tiny`` prints tokens/s (forward, backward and AdamW step) for each
row, interleaving short timed blocks of every row so machine noise hits all of them alike, and
the gated row's throughput as a share of the baseline's. On CUDA it runs under bf16 autocast.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from experiments.model import GatedLM
from sweep.grid import load_grid


def _step(model: GatedLM, opt: torch.optim.Optimizer, batch: torch.Tensor, device: str) -> None:
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def measure(grid_file: str, scale: str, rows: list[str], rounds: int, steps: int) -> dict[str, list[float]]:
    """tokens/s per timed block, by row id."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grid = load_grid(grid_file)
    setups = {}
    for cell in grid.cells(scale, seeds=[0], rows=rows):
        torch.manual_seed(0)
        model = GatedLM(cell.config.model).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        t = cell.config.train
        batch = torch.randint(0, cell.config.model.vocab_size, (t.batch_size, t.seq_len + 1), device=device)
        for _ in range(3):  # warm-up: allocator, kernels
            _step(model, opt, batch, device)
        setups[cell.row.id] = (model, opt, batch)
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
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    figures = measure(args.grid, args.scale, rows, args.rounds, args.steps)
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"training throughput, {args.grid} scale {args.scale}, {device}, torch {torch.__version__}")
    print(f"{args.rounds} interleaved rounds of {args.steps} steps; median tokens/s (min-max)")
    base = statistics.median(figures[rows[0]])
    for row, values in figures.items():
        med = statistics.median(values)
        print(
            f"  {row:<24} {med:>10.0f}  ({min(values):.0f}-{max(values):.0f})  "
            f"{100 * med / base:6.1f}% of {rows[0]}"
        )


if __name__ == "__main__":
    main()
