"""Where one training step's time goes: the attention blocks, the FFN or expert blocks, the rest of
the model (embedding, norms, LM head, loss), the optimiser and the metric logging."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from mlflow import MlflowClient
from mlflow.entities import Metric

from experiments.config import RunConfig
from tools.throughput.bare import device, setup, step, sync


def _seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _forward_backward(module: torch.nn.Module, *inputs: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of ``module`` on ``inputs`` (the first needs a gradient)."""

    def run() -> None:
        x = inputs[0].detach().requires_grad_()
        out = module(x, *inputs[1:])
        out.float().square().mean().backward()

    return run


def logging_seconds(metrics_per_step: int, steps: int, batched: int) -> tuple[float, float]:
    """Seconds per step to write ``metrics_per_step`` metrics to a fresh SQLite MLflow store: one
    ``log_batch`` per step, and one per ``batched`` steps (what the sweep's logger does)."""
    with tempfile.TemporaryDirectory() as tmp:
        client = MlflowClient(f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        exp = client.create_experiment("breakdown", artifact_location=Path(tmp).as_uri())
        run = client.create_run(exp).info.run_id
        keys = [f"m{i}" for i in range(metrics_per_step)]

        def points(s: int) -> list[Metric]:
            return [Metric(k, 1.0, 0, s) for k in keys]

        start = time.perf_counter()
        for s in range(steps):
            client.log_batch(run, metrics=points(s))
        per_step = (time.perf_counter() - start) / steps
        start = time.perf_counter()
        for s in range(0, steps, batched):
            client.log_batch(run, metrics=[m for t in range(s, s + batched) for m in points(t)])
        return per_step, (time.perf_counter() - start) / steps


def breakdown(cfg: RunConfig, repeats: int = 20) -> dict[str, float]:
    """Seconds per training step of the bare loop (``step``) and of its parts: ``attention`` and
    ``ffn`` (every layer's block, forward and backward, on the step's hidden-state shape),
    ``rest`` (what remains of forward and backward), ``optimizer`` (AdamW's step), and
    ``logging`` (the step's metrics to MLflow, batched as the sweep does; ``logging_each_step``:
    one write per step)."""
    module, opt, batch = setup(cfg)
    model, t = module.model, cfg.train
    x = torch.randn(t.batch_size, t.seq_len, cfg.model.d_model, device=device())
    block = model.blocks[0]
    out = {"step": _seconds(lambda: step(module, opt, batch), repeats)}
    out["optimizer"] = _seconds(opt.step, repeats)
    fwd_bwd = out["step"] - out["optimizer"]
    layers = len(model.blocks)
    out["attention"] = layers * _seconds(_forward_backward(block.attn, x, model.rope), repeats)
    out["ffn"] = layers * _seconds(_forward_backward(block.ffn, x), repeats)
    out["rest"] = max(0.0, fwd_bwd - out["attention"] - out["ffn"])
    opt.zero_grad(set_to_none=True)
    logged = 4 + (3 if cfg.model.moe is not None else 0)  # loss, lr, grad norm, tokens/s (+ MoE)
    out["logging_each_step"], out["logging"] = logging_seconds(logged, 100, 50)
    return out
