"""``make gpu-check`` cannot rot between GPU sessions: its dry run runs every check but the GPU
tests on the CPU (CPU autocast for the bf16 paths) and writes its report, and its FLOP count is
checked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.config import DataConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig
from tests.support import use_repo_cache
from tools.gpu_check import flops_per_token, main


def test_model_flops_count_active_matmul_parameters_and_attention() -> None:
    shape = {"vocab_size": 300, "d_model": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4}
    train, data = TrainConfig(seq_len=32, max_steps=10, warmup_steps=1), DataConfig(vocab_size=300)
    attention = 12 * 2 * 2 * 4 * 32  # 12 L H D T
    dense = RunConfig(model=ModelConfig(**shape, ffn_dim=16), train=train, data=data)
    total, _ = dense.model.param_counts()
    assert flops_per_token(dense) == 6 * (total - 300 * 8) + attention  # the embedding is a lookup
    moe = RunConfig(
        model=ModelConfig(**shape, moe=MoEConfig(n_experts=4, top_k=1, expert_dim=16)), train=train, data=data
    )
    _, active = moe.model.param_counts()
    assert flops_per_token(moe) == 6 * (active - 300 * 8) + attention  # unchosen experts cost nothing


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You called .self.log:UserWarning")
def test_the_dry_run_passes_every_check_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    use_repo_cache(monkeypatch)
    report = tmp_path / "gpu_check.md"
    assert main(["--dry-run", "--steps", "4", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    checks = ("expert kernels", "routing", "cell path, micro", "tiny, one cell", "packing cells on one GPU")
    for name in checks:
        assert f"[ok] {name}" in out
    text = report.read_text()
    assert "| host syncs per step between checks (micro MoE, bf16-mixed) | 0 |" in text
    assert "tiny baseline (eager): tokens/s" in text and "2 baseline cells on one GPU" in text
