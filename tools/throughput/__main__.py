"""``python -m tools.throughput`` (``make throughput``): tokens/s of each row in a bare loop, the
harness against that loop, and one step's breakdown; every figure measured in this process with the
variants interleaved, printed as a median with its spread (min-max over rounds)."""

from __future__ import annotations

import statistics
import sys

import torch

from sweep.cli_parser import OneLineParser, whole  # a bad value: one line, exit 2
from sweep.grid import load_grid
from sweep.gridfile import GridError
from sweep.run.quiet import CELL_THREADS
from tools.throughput.bare import COMPILED, EAGER, TWIN, configs, measure
from tools.throughput.breakdown import breakdown
from tools.throughput.harness import harness_vs_bare


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _ratios(figures: dict[str, list[float]], name: str, base: str) -> list[float]:
    """Per round, ``name``'s tokens/s over ``base``'s (paired: measured in the same round)."""
    return [a / b for a, b in zip(figures[name], figures[base])]


DEFAULT_ROWS = ("baseline", "sdpa_elementwise", "sdpa_headwise")


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m tools.throughput", description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="grids/table1.yaml")
    p.add_argument("--scale", default="tiny")
    p.add_argument(
        "--rows", default=None, help=f"comma-separated row ids (default: {','.join(DEFAULT_ROWS)})"
    )
    p.add_argument("--rounds", type=whole(1), default=7)
    p.add_argument("--steps", type=whole(1), default=10, help="training steps per timed block")
    p.add_argument("--no-twins", action="store_true", help="skip the dense twin of each MoE row")
    p.add_argument("--no-harness", action="store_true", help="skip the harness and the breakdown")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled against eager timing")
    p.add_argument("--threads", type=whole(1), default=CELL_THREADS, help="torch threads (default: a cell's)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        grid = load_grid(args.grid)
        rows = args.rows.split(",") if args.rows else [r for r in DEFAULT_ROWS if r in grid.row_ids()]
        rows = rows or grid.row_ids()[:1]
        runs = configs(grid, args.scale, rows, not args.no_twins, None if args.no_compile else rows[0])
    except GridError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = [r for r in rows if r in runs]
    where = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"training throughput, {args.grid} scale {args.scale}, {where}, torch {torch.__version__}")
    print(f"bare loop: {args.rounds} interleaved rounds of {args.steps} steps; median tokens/s (min-max)")
    setup_times: dict[str, float] = {}
    figures = measure(runs, args.rounds, args.steps, setup_times)
    base = rows[0]
    for name, values in figures.items():
        total, active = runs[name].model.param_counts()
        size = f"params {total / 1e6:.2f}M, active {active / 1e6:.2f}M"
        print(f"  {name:<32} {_spread(values, '{:.0f}'):>22}   {size}")
    print("ratios, paired by round: median (min-max)")
    for name in figures:
        if name.endswith(TWIN):
            moe = name.removesuffix(TWIN)
            print(f"  {moe} (MoE) / its dense twin           {_spread(_ratios(figures, moe, name))}")
    if base + COMPILED in figures:
        warm = setup_times[base + COMPILED] - setup_times[base + EAGER]
        ratio = _spread(_ratios(figures, base + COMPILED, base + EAGER))
        print(f"  {base} compiled / eager (train.compile)   {ratio}")
        print(f"    compiling took {warm:.0f} s (three warm-up steps, compiled minus eager)")
    for name in figures:
        if name != base and not name.endswith((TWIN, COMPILED, EAGER)):
            print(f"  {name} / {base}{'':<14} {_spread(_ratios(figures, name, base))}")
            if name + TWIN in figures and base + TWIN in figures:
                print(f"    dense twins: {_spread(_ratios(figures, name + TWIN, base + TWIN))}")
    if args.no_harness:
        return 0
    cfg = runs[base]
    shares = harness_vs_bare(cfg, rounds=3, steps=30)
    print(f"harness (Lightning, MLflow, callbacks) / bare loop, {base}, 3 x 30 steps: {_spread(shares)}")
    parts = breakdown(cfg)
    total = parts["step"]
    print(f"one bare step of {base}: {1e3 * total:.1f} ms; parts as shares of it")
    for part in ("attention", "ffn", "rest", "optimizer"):
        print(f"  {part:<10} {parts[part] / total:6.1%}   ({1e3 * parts[part]:.1f} ms)")
    print(
        f"  logging    {parts['logging'] / total:6.1%}   ({1e3 * parts['logging']:.2f} ms a step, batched; "
        f"{1e3 * parts['logging_each_step']:.1f} ms writing every step)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
