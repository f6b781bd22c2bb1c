"""``make gpu-check``: the CUDA path of every part, and the speed at ``small``, in one short script.

Run it at once whenever a GPU is lent (the project's machines have 15 minutes of one): it checks, in
order, and prints one line per check,

1. the test suite's GPU tests (``pytest -m gpu``);
2. a bf16-mixed Lightning run of a micro MoE config through ``experiments.train.Training``;
3. the MoE experts on ``grouped_mm`` (or its per-expert fallback) under bf16 autocast, against
   the fp32 per-expert loop;
4. the probes on CUDA against the same model's probes on the CPU;
5. ``torch.compile`` of a dense model's training step, against eager;
6. tokens/s and model FLOPs utilisation (MFU) of a bare training loop at scale ``small`` for the
   MoE base (Table 1) and the dense base (Table 2), baseline and the SDPA elementwise gate (G1).

MFU counts 6 FLOPs per active parameter per token plus attention's ``12 * L * H * D * T`` (forward
and backward, causal attention counted in full, as PaLM does) against the GPU's dense bf16 peak
(``GPU_PEAK_TFLOPS`` overrides the table). ``--dry-run`` runs every check that does not need CUDA
on the CPU at scale ``tiny`` with a few steps, so the script cannot rot between GPU sessions
(``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from experiments.config import DataConfig, GateConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig
from experiments.model import GatedLM
from experiments.moe import MoEFFN
from experiments.probes import run_probes
from sweep.grid import load_grid
from tools.throughput.bare import setup, step, sync

#: Dense bf16 peak TFLOP/s by device-name fragment (vendor data sheets, SXM parts).
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0, "4090": 165.2}
#: The rows timed: the baseline and the SDPA elementwise gate (G1) of each base.
ROWS = {
    "grids/table1.yaml": ["baseline", "sdpa_elementwise"],
    "grids/table2.yaml": ["baseline_28l", "sdpa_elementwise_28l"],
}


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


def micro_config(moe: bool, device_steps: int) -> RunConfig:
    model = ModelConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
        max_seq_len=64, gate=GateConfig(position="sdpa"),
        moe=MoEConfig(n_experts=8, top_k=2, expert_dim=32) if moe else None,
    )  # fmt: skip
    train = TrainConfig(
        max_steps=device_steps, batch_size=4, seq_len=64, warmup_steps=1, val_every=device_steps,
        val_tokens=1024, checkpoint_every=0,
    )  # fmt: skip
    return RunConfig(model=model, train=train, data=DataConfig(vocab_size=512, max_chars_per_source=200000))


def check(name: str, fn: Callable[[], str]) -> bool:
    """Run one check; print ``ok``/``FAIL`` with what it found and its seconds."""
    start = time.perf_counter()
    try:
        detail, ok = fn(), True
    except Exception as err:  # a check that breaks is a finding, and the others still run
        detail, ok = f"{type(err).__name__}: {err}", False
    print(f"[{'ok' if ok else 'FAIL'}] {name} ({time.perf_counter() - start:.0f} s): {detail}", flush=True)
    return ok


def gpu_tests() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
    )
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode not in (0, 5):  # 5: no test collected
        raise RuntimeError(last)
    return last


def bf16_training(cache: Path | None) -> str:
    from experiments.train import Training

    cfg = micro_config(moe=True, device_steps=5)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="auto"))
    run = Training(cfg, cache)
    run.fit()
    final = run.finish()
    where = run.trainer.strategy.root_device
    return f"precision {run.trainer.precision}, device {where}, Avg PPL {final['val/ppl/avg']:.1f}"


def grouped_experts() -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    moe = MoEFFN(256, 32, 4, 128).to(device)
    x = torch.randn(512, 256, device=device)
    with torch.no_grad():
        moe.use_grouped_mm = False
        reference = moe(x)
        moe.use_grouped_mm = True
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            got = moe(x).float()
    error = float((got - reference).abs().max() / reference.abs().max())
    path = "grouped_mm" if moe.use_grouped_mm else "per-expert fallback"
    if error > 2e-2:
        raise AssertionError(f"{path}: relative error {error:.2e} against the fp32 loop")
    return f"{path}, max relative error {error:.1e} against the fp32 per-expert loop"


def probes_match() -> str:
    cfg = micro_config(moe=True, device_steps=2).model
    torch.manual_seed(0)
    model = GatedLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 64))
    cpu = run_probes(model, tokens).summary
    device = "cuda" if torch.cuda.is_available() else "cpu"
    other = run_probes(model.to(device), tokens).summary
    worst = max(abs(cpu[k] - other[k]) / max(abs(cpu[k]), 1e-6) for k in cpu)
    if worst > 1e-3:
        raise AssertionError(f"probes on {device} differ from the CPU's by {worst:.2e} (relative)")
    return f"{len(cpu)} probe metrics on {device} within {worst:.1e} of the CPU's"


def compiled_step() -> str:
    cfg = micro_config(moe=False, device_steps=2)
    module, opt, batch = setup(cfg)
    eager = float(module.loss(batch))
    compiled = torch.compile(module.model)
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available()):
        logits = compiled(batch[:, :-1])
    loss = float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()))
    if abs(loss - eager) > 5e-2 * abs(eager):
        raise AssertionError(f"compiled loss {loss:.4f} against eager {eager:.4f}")
    return f"compiled in {time.perf_counter() - start:.0f} s; loss {loss:.4f} against eager {eager:.4f}"


def speed(scale: str, steps: int) -> str:
    peak = peak_flops()
    lines = []
    for grid_file, rows in ROWS.items():
        grid = load_grid(grid_file)
        for cell in grid.cells(scale, seeds=[0], rows=rows):
            module, opt, batch = setup(cell.config)
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                step(module, opt, batch)
            sync()
            tokens_s = steps * batch[:, 1:].numel() / (time.perf_counter() - start)
            mfu = f", MFU {tokens_s * flops_per_token(cell.config) / peak:.1%}" if peak else ""
            lines.append(f"{grid.name} {cell.row.id} {tokens_s:,.0f} tok/s{mfu}")
            del module, opt, batch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, scale tiny, a few steps: check the script")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 2
    cache = Path(os.environ["GATED_ATTN_CACHE"]) if os.environ.get("GATED_ATTN_CACHE") else None
    where = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"gpu-check on {where}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    results = [
        args.dry_run or check("GPU tests", gpu_tests),
        check("bf16-mixed training", lambda: bf16_training(cache)),
        check("MoE experts", grouped_experts),
        check("probes", probes_match),
        args.dry_run or check("torch.compile", compiled_step),  # minutes to compile on a CPU
        check("speed", lambda: speed("tiny" if args.dry_run else "small", 2 if args.dry_run else 20)),
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
