"""``make gpu-check``: what a GPU machine does with this project, measured within a lease.

A lent H100 comes for 15 minutes in all and 10 minutes a command, so the checks run in stages of
at most ``--budget`` seconds (360 by default), most value first, by a plan of what each costs on
one H100 (``tools/gpu_plan.py``, justified in docs/performance.md):

- stage 1: the expert kernels at ``small``'s shape (``grouped_mm`` with and without the 8-row
  padding against the per-expert loop, forward and backward, bf16 and fp32: parity and
  milliseconds); routing in fp32; host syncs a step of a micro MoE through the cell's path in
  bf16-mixed (0 expected); ``small``'s baseline compiled for about 100 steps (tokens/s, MFU,
  allocated and reserved peak), then the same eager;
- stage 2 (``--stage 2``, ``STAGE=2``): the GPU tests (``pytest -m gpu``); 2, then 3 baseline
  cells packed on the GPU, each in its own process, meeting at a file barrier after their
  compile and warm-up so their measured windows overlap: tokens/s of each and in all, peak memory;
- stage 3: ``small``'s G1 row compiled for 200 steps.

Each line and each figure goes to the report (``--report``, default ``results/gpu_check.md``, one
file a stage) the moment it is measured, so a run killed at its time limit keeps what it found.
A check that does not fit the budget left is skipped with one line; a cell stops at the budget.

It needs torch, Lightning, HF ``tokenizers``, PyYAML and pytest (tiktoken where installed), not
MLflow, Optuna or lm-eval: ``make gpu-check GPU_PY=python3`` on a machine without network.
``--dry-run`` prints the stage's plan in one line and fails when it exceeds the budget (CI runs
it); ``--rehearse`` runs the stage's checks on the CPU at ``tiny`` (CUDA hidden, CPU autocast
for the bf16 paths) so the script cannot rot between GPU sessions (``tests/test_gpu_check.py``).

MFU counts 6 FLOPs per active matmul parameter per token plus attention's ``12 * L * H * D * T``
(PaLM's count) against the GPU's dense bf16 peak by its name (:data:`PEAK_TFLOPS`;
``GPU_PEAK_TFLOPS`` overrides it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from experiments.config import RunConfig
from tools import gpu_plan

#: Dense bf16 peak TFLOP/s by a fragment of ``torch.cuda.get_device_name()``, the first that
#: matches (NVIDIA's data sheets give them with sparsity: halved here; docs/performance.md).
PEAK_TFLOPS = (
    ("H100 NVL", 835.5), ("H100 PCIe", 756.5), ("H100", 989.4),
    ("H200 NVL", 835.5), ("H200", 989.4), ("A100", 312.0), ("L40S", 362.05),
)  # fmt: skip
#: Seconds a stage may take unless ``--budget`` says otherwise: 6 of a lease's minutes.
DEFAULT_BUDGET = 360.0
#: The test files that hold the GPU tests; each imports only torch, Lightning and experiments.
GPU_TEST_FILES = ("tests/test_experts.py", "tests/test_gpu.py")


def peak_flops(name: str | None = None) -> float | None:
    """The dense bf16 peak in FLOP/s of the GPU called ``name`` (default: this one), or None."""
    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"]) * 1e12
    if name is None and not torch.cuda.is_available():
        return None
    name = name or torch.cuda.get_device_name()
    return next((v * 1e12 for k, v in PEAK_TFLOPS if k in name), None)


def flops_per_token(cfg: RunConfig) -> float:
    """Training FLOPs per token: 6 per active parameter, the input embedding left out (a lookup;
    tied to the LM head, its one matrix is the head's matmul and stays), plus attention's
    ``12 * L * H * D * T``."""
    m = cfg.model
    _, active = m.param_counts()
    if not m.tie_embeddings:
        active -= m.vocab_size * m.d_model
    return 6 * active + 12 * m.n_layers * m.n_heads * m.head_dim * cfg.train.seq_len


class Report:
    """The check lines and the figures, printed and written to ``path`` as each comes, against a
    budget of ``budget`` seconds from now."""

    def __init__(self, header: str, path: Path, budget: float, skip: set[str]) -> None:
        self.lines, self.figures, self.path, self.skip = [header], [("figure", "value")], path, skip
        self.start, self.budget = time.time(), budget
        print(header, flush=True)
        self.write()

    @property
    def left(self) -> float:
        """Seconds of the budget left."""
        return self.budget - (time.time() - self.start)

    @property
    def deadline(self) -> float:
        """The budget's end, ``time.time()``'s clock."""
        return self.start + self.budget

    def check(self, name: str, planned: float, fn: Callable[[], str]) -> bool:
        """Run one check unless ``--skip`` names it or its ``planned`` seconds exceed the budget
        left (one line either way); print ``ok``/``FAIL`` with what it found and its seconds."""
        if name in self.skip or planned > self.left:
            left = f"planned {planned:.0f} s, {max(0, self.left):.0f} s of the budget left (--budget)"
            self.line(f"[skipped] {name}: {'--skip' if name in self.skip else left}")
            return True
        start, ok = time.perf_counter(), True
        try:
            detail = fn()
        except Exception as err:  # a check that breaks is a finding, and the others still run
            detail, ok = f"{type(err).__name__}: {str(err)[:400]}", False
        seconds = time.perf_counter() - start
        self.line(f"[{'ok' if ok else 'FAIL'}] {name} ({seconds:.0f} s, planned {planned:.0f}): {detail}")
        return ok

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)
        self.write()

    def figure(self, name: str, value: str) -> None:
        """One figure, written to the report at once."""
        self.figures.append((name, value))
        self.write()

    def write(self) -> None:
        table = [f"| {a} | {b} |" for a, b in self.figures]
        table.insert(1, "|---|---|")
        text = "\n".join(["# make gpu-check", "", *[f"- {line}" for line in self.lines], "", *table, ""])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(text)


def gpu_tests() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TEST_FILES],
        capture_output=True, text=True,
    )  # fmt: skip
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode not in (0, 5):  # 5: no test collected
        raise RuntimeError(f"{last} {done.stderr.strip()[-300:]}")
    return last


def count_gpu_tests() -> int:
    """The tests ``pytest -m gpu`` collects from :data:`GPU_TEST_FILES` (on any machine)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
         *GPU_TEST_FILES], capture_output=True, text=True,
    )  # fmt: skip
    return sum("::" in line for line in done.stdout.splitlines())


def packing(scale: str, counts: tuple[int, ...], report: Report, rehearse: bool) -> Callable[[int], str]:
    """A check per packed count: that many baseline cells at once, each in its own process (as
    ``CELLS_PER_GPU`` workers are), meeting at a file barrier after their compile and warm-up;
    tokens/s of each over its window, their sum, how much the windows overlap, peak memory."""
    warmup, window = (2, 4) if rehearse else (gpu_plan.PACK_WARMUP, gpu_plan.PACK_WINDOW)

    def run(count: int) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            outs = [Path(tmp) / f"cell{i}.json" for i in range(count)]
            command = [sys.executable, "-m", "tools.gpu_check", "--cell"]
            args = [f"baseline,{scale},{i},{count},{tmp},{warmup},{window},{o}" for i, o in enumerate(outs)]
            procs = [subprocess.Popen([*command, a]) for a in args]
            if any(proc.wait() != 0 for proc in procs):
                raise RuntimeError(f"a packed cell failed ({count} at once)")
            cells = [json.loads(o.read_text()) for o in outs]
        together = min(c["end"] for c in cells) - max(c["start"] for c in cells)
        overlap = together / max(c["end"] - c["start"] for c in cells)
        each = ", ".join(f"{c['window_tokens_per_s']:,.0f}" for c in cells)
        total = sum(c["window_tokens_per_s"] for c in cells)
        name = f"{count} baseline cells on one GPU"
        report.figure(
            f"{name}: tokens/s each; in all; windows overlapping", f"{each}; {total:,.0f}; {overlap:.0%}"
        )
        peak = max(c["peak_gib"] for c in cells), max(c["reserved_gib"] for c in cells)
        report.figure(f"{name}: peak GiB allocated, reserved (the largest)", f"{peak[0]:.1f}, {peak[1]:.1f}")
        return (
            f"{total:,.0f} tok/s in all ({each}), windows overlapping {overlap:.0%}, {peak[0]:.1f} GiB each"
        )

    return run


def plan_line(stage: int, budget: float) -> tuple[str, bool]:
    """The stage's plan in one line, and whether it fits the budget."""
    seconds = gpu_plan.planned(stage, count_gpu_tests() if stage == 2 else 0)
    return f"planned on one H100: {seconds:.0f} s of a {budget:.0f} s budget", seconds <= budget


def main(argv: list[str] | None = None) -> int:
    from sweep.cli_parser import OneLineParser, whole  # a bad value: one line, exit 2

    p = OneLineParser(prog="python -m tools.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=1, help="which checks (module docstring)")
    p.add_argument("--budget", type=whole(1), default=None, help="seconds the stage may take (default 360)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the stage's plan in one line; fail over budget"
    )
    p.add_argument(
        "--rehearse", action="store_true", help="run the stage on the CPU at tiny: check the script"
    )
    p.add_argument("--report", default=None, help="the report file (default results/gpu_check[_stageN].md)")
    p.add_argument("--skip", default="", help="comma-separated check names to leave out")
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # one packed cell's arguments
    args = p.parse_args(argv)
    if args.dry_run:
        line, fits = plan_line(args.stage, args.budget or DEFAULT_BUDGET)
        print(line)
        return 0 if fits else 1
    if args.rehearse:  # the CPU, even on a GPU machine: the script's check, not the GPU's
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from sweep.run.quiet import quiet_lightning

    quiet_lightning()
    if args.cell:
        from tools.gpu_cells import packed_cell

        row, scale, index, count, folder, warmup, window, out = args.cell.split(",")
        got = packed_cell(row, scale, Path(folder), int(index), int(count), int(warmup), int(window))
        Path(out).write_text(json.dumps(got))
        return 0
    if not args.rehearse and not torch.cuda.is_available():
        print("error: no CUDA device (--rehearse checks the script on the CPU)", file=sys.stderr)
        return 2
    return run_stage(args)


def run_stage(args: argparse.Namespace) -> int:
    """The checks of ``args.stage``, each against the budget left."""
    from tools.gpu_cells import micro_syncs, speed_cell
    from tools.gpu_kernels import expert_kernels, routing

    device, rehearse = ("cpu", True) if args.rehearse else ("cuda", False)
    scale = "tiny" if rehearse else "small"
    steps = 8 if rehearse else gpu_plan.SMALL_STEPS
    default = "results/gpu_check.md" if args.stage == 1 else f"results/gpu_check_stage{args.stage}.md"
    budget = args.budget or (
        float("inf") if rehearse else DEFAULT_BUDGET
    )  # the plan is an H100's, not a CPU's
    where = "CPU (rehearsal, CPU autocast for bf16)" if rehearse else torch.cuda.get_device_name()
    tests = count_gpu_tests() if args.stage == 2 else 0
    plan = f"planned on one H100 {gpu_plan.planned(args.stage, tests):.0f} s of a {budget:.0f} s budget"
    if budget == float("inf"):
        plan = "no budget (a rehearsal's CPU is not the plan's H100)"
    header = f"gpu-check stage {args.stage} on {where}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    header = f"{header}: {plan}"
    report = Report(header, Path(args.report or default), budget, {s for s in args.skip.split(",") if s})
    planned = {c.name: c.seconds for c in gpu_plan.checks(tests)}
    peak = peak_flops()

    def cell(row: str, n: int, compile: bool | None) -> Callable[[], str]:
        compile = False if rehearse else compile  # compiling on 2 CPU cores takes minutes
        return lambda: speed_cell(row, scale, n, compile, report, peak, flops_per_token, report.deadline)

    runs = {
        "expert kernels": lambda: expert_kernels(device, report),
        "routing": lambda: routing(device, report),
        "host syncs, micro cell": lambda: micro_syncs(report),
        "small, compiled": cell("baseline", steps, True),
        "small, eager": cell("baseline", steps, False),
        "GPU tests": gpu_tests,
        "small G1, compiled": cell("sdpa_elementwise", 2 * steps, True),
    }
    pack = packing(scale, (2, 3), report, rehearse)
    results = []
    for check in gpu_plan.checks(tests):
        if check.stage != args.stage:
            continue
        count = int(check.name.split()[0]) if "packed" in check.name else 0
        fn = runs.get(check.name) or (lambda n=count: pack(n))
        results.append(report.check(check.name, planned[check.name], fn))
    report.line(f"report: {report.path} ({time.time() - report.start:.0f} s)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
