"""What a training step keeps in memory, measured with torch's own trackers on the CPU: a
checkpointed MoE block keeps nothing past its backward pass, and the chunked loss equals the
whole one (issue 55)."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from experiments.config import ModelConfig, MoEConfig
from experiments.loss import chunked_cross_entropy, next_token_loss
from experiments.model import GatedLM
from experiments.moe import MoEFFN, auxiliary_loss, choose_experts_path, router_stats
from experiments.sharding import checkpoint_blocks

#: ``tiny``'s shape: 4 blocks of d 128, 128 experts of 48, top-8; the dense twin's FFN is the
#: width a token uses (8 x 48).
DENSE = ModelConfig(
    vocab_size=2048,
    d_model=128,
    n_layers=4,
    n_heads=16,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=384,
    max_seq_len=128,
)
MOE = dataclasses.replace(DENSE, moe=MoEConfig(n_experts=128, top_k=8, expert_dim=48))


def activations_after_backward(cfg: ModelConfig) -> tuple[int, int]:
    """Bytes of activations (torch's MemTracker: tensors the forward or a recomputation made) still
    alive after the backward pass of a per-block checkpointed model, its loss with the router
    losses; and the bytes of the routing statistics the MoE layers keep (the expert loads, the
    token count, the two losses: a few numbers a layer, rounded as MemTracker rounds)."""
    torch.manual_seed(0)
    model = GatedLM(cfg)
    for m in model.modules():
        if isinstance(m, MoEFFN):  # before the checkpointed forward, as a fit's start does
            choose_experts_path(m, torch.device("cpu"), torch.float32)
    checkpoint_blocks(model)
    tokens = torch.randint(0, cfg.vocab_size, (8, 129))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = next_token_loss(model, tokens)
        if stats := router_stats(model):
            loss = loss + auxiliary_loss(stats, cfg.moe)[0]
        loss.backward()
        del loss
        gc.collect()
        snapshot = tracker.get_tracker_snapshot("current")
    (device,) = snapshot
    kept = sum(
        -(-t.untyped_storage().nbytes() // 512) * 512
        for s in stats
        for t in {id(t): t for t in (s.load, s.tokens, s.lb_loss, s.z_loss)}.values()
    )
    return next(v for k, v in snapshot[device].items() if str(k).endswith("ACT")), kept


def test_a_checkpointed_moe_block_keeps_no_more_after_backward_than_its_dense_twin() -> None:
    """Before the fix the recomputed routing statistics stayed on the module with the recomputed
    block's graph: 34.6 MiB of activations alive after the backward, against the dense twin's
    8 KiB (its RoPE tables' views). Now only the statistics themselves (2 KiB over 4 layers)."""
    (dense, _), (moe, statistics) = activations_after_backward(DENSE), activations_after_backward(MOE)
    assert dense < 2**14 and statistics <= 4 * 4 * 512
    assert moe <= dense + statistics


@pytest.mark.parametrize("chunk", [7, 32, 1000])
def test_the_chunked_loss_equals_the_whole_loss_and_its_gradients(chunk: int) -> None:
    """Chunks of 7 (uneven), 32 and more than the 4 x 32 tokens: the mean and the sum and every
    gradient equal the whole loss's to 1e-6 (relative), untied and tied."""
    for tied in (False, True):
        cfg = dataclasses.replace(DENSE, d_model=32, n_layers=2, n_heads=4, head_dim=8, ffn_dim=64,
                                  tie_embeddings=tied, vocab_size=512)  # fmt: skip
        torch.manual_seed(0)
        model = GatedLM(cfg)
        batch = torch.randint(0, 512, (4, 33))
        got = []
        for size in (0, chunk):
            model.zero_grad()
            mean = next_token_loss(model, batch, "mean", size)
            mean.backward()
            total = next_token_loss(model, batch, "sum", size).detach()
            got.append((mean.detach(), total, [p.grad.clone() for p in model.parameters()]))
        (whole_mean, whole_sum, whole_grads), (mean, total, grads) = got
        assert mean == pytest.approx(float(whole_mean), rel=1e-6)
        assert total == pytest.approx(float(whole_sum), rel=1e-6)
        for g, w in zip(grads, whole_grads):
            assert float((g - w).abs().max()) <= 1e-6 * float(w.abs().max())


def test_a_chunk_keeps_its_logits_for_the_backward_pass_only_as_its_inputs() -> None:
    """The chunked loss saves nothing of size tokens x vocabulary for the backward pass (each
    chunk's logits are recomputed there): the whole loss saves the fp32 logits, the chunked one
    only the hidden states and the weight it had anyway."""
    hidden = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(1000, 16, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    for chunked in (False, True):
        sizes: list[int] = []

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if chunked:
                chunked_cross_entropy(hidden, weight, targets, 16)
            else:
                F.cross_entropy(F.linear(hidden, weight).float(), targets)
        assert (max(sizes) >= 64 * 1000) is not chunked, sizes
