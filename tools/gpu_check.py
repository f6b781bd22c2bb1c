"""``make gpu-check``: what a GPU machine does with this project, measured in a few minutes.

Run it at once whenever a GPU is lent (the project's sessions get 15 minutes of one). It prints one
line per check and writes them, with a table of figures, to one report (``--report``, default
``results/gpu_check.md``), whose figures go into docs/performance.md:

1. the GPU tests (``pytest -m gpu``: the expert kernels, probes and a bf16 step against the CPU);
2. the expert kernels at ``small``'s shape: ``grouped_mm`` (groups padded as on CUDA) against the
   per-expert loop, forward and backward, bf16 and fp32, on unaligned counts; and their speed;
3. routing: how many tokens a bf16 router would send elsewhere, and that the layer routes in fp32;
4. the cell's own path at a micro scale (Lightning, clipping, logging, the deferred checks) in
   bf16-mixed, counting host syncs per step between checks (0 expected);
5. ``small`` (Table 1's baseline and G1, compiled as the grid says, and the baseline eager) for
   ``--steps`` steps on real text that needs no network (Python's standard library, BPE'd here):
   tokens/s between the logged windows (the first, with compiling, left out), MFU and
   ``max_memory_allocated``;
6. packing: 2 and 3 ``small`` baseline cells at once on the one GPU (CELLS_PER_GPU), in
   processes of their own: tokens/s summed over them and each one's peak memory.

MFU counts 6 FLOPs per active parameter per token plus attention's ``12 * L * H * D * T``
(forward and backward, causal attention counted in full, as PaLM does) against the GPU's dense
bf16 peak (``GPU_PEAK_TFLOPS`` overrides the table). It needs torch, Lightning, HF ``tokenizers``,
PyYAML and pytest, not MLflow, Optuna or lm-eval (a GPU image without network has the first
ones). The report is rewritten after every check, so a run stopped at its time limit keeps what
it found; ``--skip`` leaves checks out. ``--dry-run`` runs every check but the GPU tests on the CPU
at ``tiny`` with a few steps, CUDA hidden, CPU autocast for the bf16 paths, so the script cannot
rot between GPU sessions (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from experiments.config import RunConfig
from experiments.experts import expert_counts, group_align, grouped_swiglu, looped_swiglu
from experiments.moe import MoEFFN, choose_experts_path
from sweep.run.quiet import quiet_lightning

#: Dense bf16 peak TFLOP/s by device-name fragment (vendor data sheets, SXM parts).
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0, "4090": 165.2}
#: The test files that hold the GPU tests; each imports only torch, Lightning and experiments.
GPU_TEST_FILES = ("tests/test_experts.py", "tests/test_gpu.py")


def peak_flops() -> float | None:
    """The GPU's dense bf16 peak in FLOP/s, or None where unknown."""
    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"]) * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


def flops_per_token(cfg: RunConfig) -> float:
    """Training FLOPs per token: 6 per active parameter (embedding lookups excluded), plus attention
    scores and values, ``12 * L * H * D * T``."""
    m = cfg.model
    _, active = m.param_counts()
    active -= m.vocab_size * m.d_model  # the input embedding is a lookup, not a matmul
    return 6 * active + 12 * m.n_layers * m.n_heads * m.head_dim * cfg.train.seq_len


class Report:
    """The check lines and the figures table, printed as they come and written at the end."""

    def __init__(self, header: str, path: Path, skip: set[str]) -> None:
        self.lines, self.figures, self.path, self.skip = [header], [("figure", "value")], path, skip
        print(header, flush=True)

    def check(self, name: str, fn: Callable[[], str]) -> bool:
        """Run one check (unless ``--skip`` names it); print ``ok``/``FAIL`` with what it found and
        its seconds; rewrite the report."""
        if name in self.skip:
            self.lines.append(f"[skipped] {name}")
            return True
        start = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as err:  # a check that breaks is a finding, and the others still run
            detail, ok = f"{type(err).__name__}: {str(err)[:400]}", False
        line = f"[{'ok' if ok else 'FAIL'}] {name} ({time.perf_counter() - start:.0f} s): {detail}"
        print(line, flush=True)
        self.lines.append(line)
        self.write()
        return ok

    def figure(self, name: str, value: str) -> None:
        self.figures.append((name, value))

    def write(self) -> None:
        table = [f"| {a} | {b} |" for a, b in self.figures]
        table.insert(1, "|---|---|")
        text = "\n".join(["# make gpu-check", "", *[f"- {line}" for line in self.lines], "", *table, ""])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(text)


def gpu_tests() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TEST_FILES],
        capture_output=True,
        text=True,
    )
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode not in (0, 5):  # 5: no test collected
        raise RuntimeError(f"{last} {done.stderr.strip()[-300:]}")
    return last


def expert_kernels(device: str, report: Report) -> str:
    """``small``'s MoE layer (d 512, 128 experts of 192, top-8) on 4,096 tokens (256 on a CPU),
    routed by a random router (unbalanced, unaligned counts): grouped against the loop, forward
    and backward."""
    torch.manual_seed(0)
    moe = MoEFFN(512, 128, 8, 192).to(device)
    x = torch.randn(4096 if device == "cuda" else 256, 512, device=device)
    flat = x.reshape(-1, 512)
    experts = moe.router(flat).topk(8).indices.flatten()
    order = experts.argsort(stable=True)
    sorted_experts = experts.index_select(0, order)
    counts = expert_counts(experts, 128)
    grouped = flat.repeat_interleave(8, dim=0).index_select(0, order)
    scale = torch.rand(grouped.shape[0], 1, device=device)
    out = []
    layer = (counts, scale, moe.w_gate_up, moe.w_down, sorted_experts)
    for dtype in (torch.bfloat16, torch.float32):
        results, seconds = [], []
        for path in ("grouped", "loop"):
            _experts_once(path, grouped, layer, dtype, device)  # a warm-up: kernels load, memory settles
            took, result = _experts_once(path, grouped, layer, dtype, device)
            seconds.append(took)
            results.append(result)
        worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*results))
        tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
        if not worst <= tolerance:
            raise AssertionError(f"{dtype}: grouped against loop off by {worst:.1e} (relative)")
        name = str(dtype).removeprefix("torch.")
        ms = f"{seconds[0] * 1e3:.1f} / {seconds[1] * 1e3:.1f}"
        report.figure(f"experts fwd+bwd, {name}: grouped / loop (ms)", ms)
        out.append(f"{name} within {worst:.1e}")
    path = choose_experts_path(moe, torch.device(device), torch.bfloat16)
    report.figure("experts path (bf16)", path)
    return f"path {path}; grouped equals the loop forward and backward: {', '.join(out)}"


def _experts_once(
    path: str, grouped: torch.Tensor, layer: tuple, dtype: torch.dtype, device: str
) -> tuple[float, list[torch.Tensor]]:
    """One forward and backward of the experts by ``path``: its seconds, its output and gradients."""
    counts, scale, w_gate_up, w_down, sorted_experts = layer
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (grouped, w_gate_up, w_down)]
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if path == "grouped":
        align = group_align(torch.device(device))
        y = grouped_swiglu(leaves[0], counts, scale.to(dtype), leaves[1], leaves[2], sorted_experts, align)
    else:
        y = looped_swiglu(leaves[0], counts, scale.to(dtype), leaves[1], leaves[2])
    y.float().square().mean().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, [y.detach().float(), *(t.grad.float() for t in leaves)]


def routing(device: str, report: Report) -> str:
    torch.manual_seed(1)
    moe = MoEFFN(512, 128, 8, 192).to(device)
    x = torch.randn(8192, 512, device=device)
    with torch.no_grad():
        fp32 = moe.router(x).topk(8).indices.sort(-1).values
        rounded = (x.bfloat16() @ moe.router.weight.bfloat16().T).float().topk(8).indices.sort(-1).values
        with torch.autocast(device, dtype=torch.bfloat16):
            moe(x)
    moved = float((rounded != fp32).any(-1).float().mean())
    layer = expert_counts(fp32.flatten(), 128).float()
    if not torch.equal(moe.stats.load, layer):
        raise AssertionError("the layer's routing under autocast differs from fp32 routing")
    report.figure("tokens a bf16 router would route elsewhere", f"{moved:.1%}")
    return f"a bf16 router would move {moved:.1%} of the tokens' top-8 sets; the layer routes in fp32"


def main(argv: list[str] | None = None) -> int:
    from sweep.cli_parser import OneLineParser, whole  # a bad value: one line, exit 2

    p = OneLineParser(prog="python -m tools.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, scale tiny, a few steps: check the script")
    p.add_argument("--steps", type=whole(1), default=None, help="steps a small cell (default 200; dry run 6)")
    p.add_argument("--report", default="results/gpu_check.md", help="the report file (markdown)")
    p.add_argument("--skip", default="", help="comma-separated check names to leave out")
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # one packed cell: row,scale,steps,json
    args = p.parse_args(argv)
    if args.dry_run:  # the CPU, even on a GPU machine: the script's check, not the GPU's
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    quiet_lightning()
    from tools.gpu_cells import cell_speed, micro_syncs, offline_cell, speed_lines

    if args.cell:
        row, scale, steps, out = args.cell.split(",")
        Path(out).write_text(json.dumps(cell_speed(offline_cell(row, scale, int(steps)))))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    scale, steps = ("tiny", args.steps or 6) if args.dry_run else ("small", args.steps or 200)
    where = "CPU (dry run, CPU autocast for bf16)" if args.dry_run else torch.cuda.get_device_name()
    header = f"gpu-check on {where}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    report = Report(header, Path(args.report), {s for s in args.skip.split(",") if s})
    peak = peak_flops()
    results = [
        args.dry_run or report.check("GPU tests", gpu_tests),
        report.check("expert kernels", lambda: expert_kernels(device, report)),
        report.check("routing", lambda: routing(device, report)),
        report.check("cell path, micro", lambda: micro_syncs(report)),
        report.check(f"{scale}, one cell", lambda: speed_lines(scale, steps, report, peak, flops_per_token)),
        report.check("packing cells on one GPU", lambda: packing(scale, steps, report, args.dry_run)),
    ]
    print(f"report: {args.report}")
    return 0 if all(results) else 1


def packing(scale: str, steps: int, report: Report, dry_run: bool) -> str:
    """2 and 3 baseline cells at once, each in its own process (as CELLS_PER_GPU workers are);
    only 2 in a dry run. Tokens/s over the time all of them trained at once, past each one's first
    window (start-up, compiling): their checks' clocks give each one's steps in that span."""
    import tempfile

    from tools.gpu_cells import overlap_tokens_per_s

    lines, command = [], [sys.executable, "-m", "tools.gpu_check", "--cell"]
    for count in (2,) if dry_run else (2, 3):
        with tempfile.TemporaryDirectory() as tmp:
            outs = [Path(tmp) / f"cell{i}.json" for i in range(count)]
            procs = [subprocess.Popen([*command, f"baseline,{scale},{steps},{o}"]) for o in outs]
            if any(proc.wait() != 0 for proc in procs):
                raise RuntimeError(f"a packed cell failed ({count} at once)")
            cells = [json.loads(o.read_text()) for o in outs]
        total, seconds = overlap_tokens_per_s(cells)
        peak = max(c["peak_gib"] for c in cells)
        reserved = max(c["reserved_gib"] for c in cells)
        what = f"{count} baseline cells on one GPU: tokens/s together ({seconds:.0f} s), peak GiB each"
        report.figure(what, f"{total:,.0f}, {peak:.1f} allocated, {reserved:.1f} reserved")
        lines.append(f"{count} cells {total:,.0f} tok/s over {seconds:.0f} s together, {peak:.1f} GiB each")
    return "; ".join(lines)


if __name__ == "__main__":
    sys.exit(main())
