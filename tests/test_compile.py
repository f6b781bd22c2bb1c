"""Compiled training (issue 44): the model and its loss are one graph with no break in fp32 or
bf16 (``torch._dynamo.explain``), a compiled cell's losses equal eager ones, and a bf16-mixed cell
trains, validates and probes on the CPU (CPU autocast standing in for a GPU's)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from experiments.config import DataConfig, GateConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig
from experiments.lit import LMModule, next_token_loss
from experiments.model import GatedLM
from experiments.train import Training
from sweep.grid import load_grid
from tests.support import MICRO, use_repo_cache, write_grid

GATES = {
    "baseline": None,
    "G1 elementwise": GateConfig(position="sdpa"),
    "G2 headwise": GateConfig(position="value", granularity="headwise"),
    "G5 dense": GateConfig(position="dense"),
}


def _model(gate: GateConfig | None, moe: bool) -> GatedLM:
    torch.manual_seed(0)
    return GatedLM(ModelConfig(
        vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
        max_seq_len=32, gate=gate, moe=MoEConfig(n_experts=8, top_k=2, expert_dim=16) if moe else None,
    ))  # fmt: skip


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("gate", list(GATES), ids=list(GATES))
def test_the_loss_compiles_without_a_graph_break(gate: str, moe: bool, dtype: torch.dtype | None) -> None:
    model = _model(GATES[gate], moe)
    batch = torch.randint(0, 256, (2, 17))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
        explained = torch._dynamo.explain(next_token_loss)(model, batch)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_each_compiled_cell_starts_with_an_empty_compile_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo keeps ``next_token_loss``'s graphs on its code object, across modules, and runs it
    eager for good past 8 of them: a worker training a sixth model would not be compiled."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", **kw))
    batch = torch.randint(0, 256, (2, 17))
    code = next_token_loss.__code__
    for width in (16, 24, 32, 40, 48, 56):
        model = dataclasses.replace(_model(None, False).cfg, d_model=width, vocab_size=512)
        train = TrainConfig(max_steps=4, warmup_steps=1, batch_size=2, seq_len=16, val_tokens=64)
        train = dataclasses.replace(train, compile=True)
        module = LMModule(RunConfig(model=model, train=train, data=DataConfig(vocab_size=512)), ["x"])
        module.loss(batch)
        module.eval()
        with torch.no_grad():
            module.loss(batch, reduction="sum")
        assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) == 2  # this model's alone


def _cell(tmp_path: Path, row: str, **train: object):
    (cell,) = load_grid(write_grid(tmp_path, MICRO)).cells("tiny", rows=[row])
    return dataclasses.replace(cell.config, train=dataclasses.replace(cell.config.train, **train))


def _losses(tmp_path: Path, cfg, name: str) -> tuple[list[float], dict[str, float]]:
    run = Training(cfg, logger=CSVLogger(tmp_path / name))
    run.fit()
    final = run.finish()
    lines = (tmp_path / name / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    col = header.index("train/loss")
    return [float(r.split(",")[col]) for r in lines[1:] if r.split(",")[col]], final


@pytest.mark.slow
@pytest.mark.parametrize("row", ["sdpa_elementwise", "moe"])
def test_a_compiled_cell_trains_as_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: str) -> None:
    use_repo_cache(monkeypatch)
    torch._dynamo.reset()
    eager, eager_final = _losses(tmp_path, _cell(tmp_path, row), "eager")
    compiled, compiled_final = _losses(tmp_path, _cell(tmp_path, row, compile=True), "compiled")
    assert len(compiled) == len(eager) == 8
    assert compiled == pytest.approx(eager, rel=1e-4)  # float tolerance: fused kernels sum otherwise
    assert compiled_final["val/ppl/avg"] == pytest.approx(eager_final["val/ppl/avg"], rel=1e-4)


@pytest.mark.filterwarnings("ignore:You called .self.log:UserWarning")
@pytest.mark.parametrize("row", ["sdpa_elementwise", "moe"])
def test_a_bf16_mixed_cell_trains_validates_and_probes_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: str
) -> None:
    use_repo_cache(monkeypatch)
    cfg = _cell(tmp_path, row, precision="bf16-mixed")
    run = Training(cfg, logger=CSVLogger(tmp_path / "bf16"))
    run.fit()
    assert run.trainer.precision == "bf16-mixed"
    final = run.finish()
    fp32 = Training(_cell(tmp_path, row), logger=False)
    fp32.fit()
    reference = fp32.finish()["val/ppl/avg"]
    assert final["val/ppl/avg"] == pytest.approx(reference, rel=0.02)  # bf16 rounding, not another model
    assert final["val/ppl/avg"] != reference
    probes = run.probe()
    assert 0 < probes.summary["sink/first_token_attn"] < 1
    if row == "moe":
        assert run.experts_paths() == ["grouped_mm"]  # chosen for bf16 at the fit's start
