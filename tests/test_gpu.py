"""The tests that need CUDA (``make test-gpu``; ``make gpu-check`` runs them first): the model's
bf16 training step, the probes and a compiled MoE step on the GPU against the CPU or eager. They
import only torch, Lightning and ``experiments``, so a GPU image without MLflow or Optuna runs
them. Skipped without CUDA (``tests/conftest.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from experiments.config import GateConfig, ModelConfig, MoEConfig
from experiments.devices import scoring_precision
from experiments.lit import next_token_loss
from experiments.model import GatedLM
from experiments.probes import run_probes

pytestmark = pytest.mark.gpu


def _model(gate: GateConfig | None = None, moe: bool = False) -> GatedLM:
    torch.manual_seed(0)
    return GatedLM(ModelConfig(
        vocab_size=512, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, ffn_dim=128,
        max_seq_len=64, gate=gate, moe=MoEConfig(n_experts=16, top_k=4, expert_dim=32) if moe else None,
    ))  # fmt: skip


@pytest.mark.parametrize("gate", [None, GateConfig(position="sdpa"), GateConfig(granularity="headwise")])
def test_bf16_training_step_on_cuda(gate: GateConfig | None) -> None:
    model = _model(gate).cuda()
    tokens = torch.randint(0, 512, (4, 65), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    assert logits.dtype == torch.bfloat16
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_probes_on_cuda_match_the_cpu() -> None:
    model = _model(GateConfig(position="sdpa"))
    x = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    on_cpu = run_probes(model, x).summary
    on_gpu = run_probes(model.cuda(), x).summary  # fp32 on the GPU: the same numbers
    with scoring_precision("cuda"):
        in_bf16 = run_probes(model, x).summary  # as a cell probes on CUDA
    assert on_gpu.keys() == on_cpu.keys() == in_bf16.keys()
    for key, value in on_cpu.items():
        assert on_gpu[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
        assert in_bf16[key] == pytest.approx(value, rel=5e-2, abs=1e-3), key


def test_a_compiled_moe_step_on_cuda_equals_eager() -> None:
    batch = torch.randint(0, 512, (4, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    grads = []
    for fn in (next_token_loss, torch.compile(next_token_loss)):
        model = _model(GateConfig(position="sdpa"), moe=True).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(model, batch)
        loss.backward()
        grads.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (eager, g_eager), (compiled, g_compiled) = grads
    assert float(compiled) == pytest.approx(float(eager), rel=1e-2)
    assert float((g_compiled - g_eager).norm() / g_eager.norm()) < 5e-2
