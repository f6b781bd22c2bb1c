"""The MoE FFN against a naive per-token reference, and its routing losses by hand."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from experiments.config import MoEConfig
from experiments.moe import (
    MoEFFN,
    RouterStats,
    auxiliary_loss,
    balancing_losses,
    carry_balance,
    mean_load_cv,
    route,
    router_stats,
)


def naive(moe: MoEFFN, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the renormalised top-k experts' SwiGLU outputs, weighted."""
    out = torch.zeros_like(x)
    probs = moe.router(x).softmax(-1)
    for i in range(x.shape[0]):
        top, idx = probs[i].topk(moe.top_k)
        for w, e in zip(top / top.sum(), idx.tolist()):
            gate, up = (x[i] @ moe.w_gate_up[e]).chunk(2)
            out[i] += w * ((F.silu(gate) * up) @ moe.w_down[e])
    return out


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop_over_experts"])
def test_moe_equals_the_per_token_reference(grouped_mm: bool) -> None:
    torch.manual_seed(0)
    moe = MoEFFN(d_model=16, n_experts=8, top_k=3, expert_dim=12)
    moe.use_grouped_mm = grouped_mm
    x = torch.randn(2, 5, 16)
    assert torch.allclose(moe(x), naive(moe, x.reshape(-1, 16)).reshape(2, 5, 16), atol=1e-5)
    assert moe.use_grouped_mm == grouped_mm  # this build runs grouped_mm on the CPU: no fallback


def test_grouped_mm_and_the_loop_give_the_same_gradients() -> None:
    """Including experts that receive no token (8 tokens x top-1 over 16 experts)."""
    torch.manual_seed(2)
    grads = []
    for grouped_mm in (True, False):
        torch.manual_seed(2)
        moe = MoEFFN(d_model=8, n_experts=16, top_k=1, expert_dim=4)
        moe.use_grouped_mm = grouped_mm
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
        (moe(x) * torch.linspace(-1, 1, 8)[:, None]).sum().backward()
        grads.append([p.grad.clone() for p in (moe.w_gate_up, moe.w_down, moe.router.weight)])
        assert (moe.stats.load == 0).any()
        assert moe.use_grouped_mm == grouped_mm  # no silent fallback: two different paths compared
    for grouped, looped in zip(*grads):
        assert torch.allclose(grouped, looped, atol=1e-6)


def test_auxiliary_loss_weights_layer_means_and_undoes_ddp_averaging() -> None:
    stats = [
        RouterStats(torch.tensor(1.2), torch.tensor(20.0), torch.ones(4), torch.tensor(4.0)),
        RouterStats(
            torch.tensor(1.0), torch.tensor(10.0), torch.tensor([2.0, 0.0, 1.0, 1.0]), torch.tensor(4.0)
        ),
    ]
    cfg = MoEConfig(n_experts=4, top_k=1, expert_dim=8, lb_coef=0.01, z_coef=0.001)
    total, lb, z = auxiliary_loss(stats, cfg, world_size=4)
    assert (lb.item(), z.item()) == (pytest.approx(1.1), pytest.approx(15.0))
    assert total.item() == pytest.approx(0.01 * 4 * 1.1 + 0.001 * 15.0)
    assert float(mean_load_cv(stats)) == pytest.approx((0.0 + math.sqrt(0.5)) / 2)  # std 0.707 / mean 1
    per_rank = dataclasses.replace(cfg, global_batch=False)  # DDP's average is already the gradient
    assert auxiliary_loss(stats, per_rank, world_size=4)[0].item() == pytest.approx(0.01 * 1.1 + 0.001 * 15.0)


def test_top_k_picks_the_k_most_probable_experts() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]])
    probs, experts, weights = route(logits, 2)
    assert experts.tolist() == [[1, 3], [0, 2]]
    p = logits.softmax(-1)
    assert torch.allclose(weights[0], torch.stack([p[0, 1], p[0, 3]]) / (p[0, 1] + p[0, 3]))
    assert torch.allclose(weights.sum(-1), torch.ones(2))


def test_losses_equal_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    probs, experts, _ = route(logits, 1)
    stats = balancing_losses(logits, probs, experts, global_batch=False)
    # top-1 picks: 0, 1, 0 (a tie goes to the lower index), 0 -> f = (3/4, 1/4, 0)
    assert experts.flatten().tolist() == [0, 1, 0, 0]
    f = torch.tensor([0.75, 0.25, 0.0])
    p = logits.softmax(-1).mean(0)
    assert math.isclose(stats.lb_loss.item(), 3 * float((f * p).sum()), rel_tol=1e-6)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 4
    assert math.isclose(stats.z_loss.item(), z, rel_tol=1e-6)
    assert stats.load.tolist() == [3.0, 1.0, 0.0]
    assert math.isclose(
        float(stats.load_cv), float(torch.tensor([3.0, 1.0, 0.0]).std(unbiased=False) / (4 / 3))
    )


def test_global_batch_balancing_differs_from_per_micro_batch() -> None:
    """Two micro-batches, each routed entirely to one expert: each is maximally unbalanced on its
    own, while together they are balanced."""
    a = torch.tensor([[4.0, 0.0]] * 4)
    b = torch.tensor([[0.0, 4.0]] * 4)
    per_micro = [balancing_losses(x, *route(x, 1)[:2], global_batch=False).lb_loss for x in (a, b)]
    both = torch.cat([a, b])
    whole = balancing_losses(both, *route(both, 1)[:2], global_batch=False).lb_loss
    p = a.softmax(-1)[0, 0].item()  # the router's confidence in the chosen expert
    assert math.isclose(sum(per_micro).item() / 2, 2 * p, rel_tol=1e-6)  # f = (1, 0) per micro-batch
    assert math.isclose(whole.item(), 1.0, rel_tol=1e-6)  # f = P = (1/2, 1/2): the balanced minimum
    assert whole.item() < sum(per_micro).item() / 2


def test_a_steps_later_micro_batch_balances_over_the_micro_batches_before_it() -> None:
    """``grad_accum: 2``: the second micro-batch's f is the whole global batch's (its counts equal
    one forward of both halves), its P its own; the first balances on its own; after
    ``carry_balance(False)`` a forward starts afresh."""
    torch.manual_seed(3)
    moe = MoEFFN(d_model=16, n_experts=6, top_k=2, expert_dim=8)
    x = torch.randn(4, 5, 16)
    moe(x)
    whole = moe.stats
    carry_balance(moe, False)
    moe(x[:2])
    first = moe.stats
    carry_balance(moe, True)
    moe(x[2:])
    second = moe.stats
    assert torch.equal(second.load, whole.load) and float(second.tokens) == float(whole.tokens) == 20
    assert float(first.tokens) == 10 and float(first.load.sum()) == 20  # 10 tokens x top-2
    f = whole.load / (20 * 2)
    p_second = moe.router(x[2:].reshape(-1, 16)).softmax(-1).mean(0).detach()
    assert math.isclose(second.lb_loss.item(), 6 * float((f * p_second).sum()), rel_tol=1e-6)
    carry_balance(moe, False)
    moe(x[2:])
    assert float(moe.stats.tokens) == 10 and not torch.equal(moe.stats.load, whole.load)


def test_gradients_reach_every_expert_that_received_tokens() -> None:
    torch.manual_seed(1)
    moe = MoEFFN(d_model=8, n_experts=6, top_k=2, expert_dim=4)
    x = torch.randn(10, 8)
    (moe(x).pow(2).sum() + moe.stats.lb_loss + moe.stats.z_loss).backward()
    used = moe.stats.load > 0
    grads = moe.w_down.grad.flatten(1).abs().sum(-1)
    assert used.any() and (grads[used] > 0).all()
    assert (grads[~used] == 0).all()
    assert moe.router.weight.grad.abs().sum() > 0


RANK_LOGITS = (
    [[4.0, 0.0]] * 4,  # rank 0: everything to expert 0
    [[4.0, 0.0]] * 2 + [[0.0, 4.0]] * 2,  # rank 1: half and half
)


def _rank_loss(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    logits = torch.tensor(RANK_LOGITS[rank], requires_grad=True)
    probs, experts, _ = route(logits, 1)
    stats = balancing_losses(logits, probs, experts, global_batch=True)
    stats.lb_loss.backward()
    out[rank] = (stats.lb_loss.item(), stats.load.tolist(), logits.grad.tolist())
    dist.destroy_process_group()


@pytest.mark.slow
def test_global_batch_balancing_across_two_gloo_processes() -> None:
    """Two data-parallel ranks: with the all-reduce, each rank's loss is the loss of the whole
    global batch in one process, and its gradient is that batch's gradient on its own tokens;
    without it, each rank balances only its own micro-batch."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_loss, args=(2, port, out), nprocs=2, join=True)
        results = dict(out)
    whole = torch.tensor(RANK_LOGITS[0] + RANK_LOGITS[1], requires_grad=True)
    probs, experts, _ = route(whole, 1)
    reference = balancing_losses(whole, probs, experts, global_batch=False)
    reference.lb_loss.backward()
    for rank in (0, 1):
        loss, load, grad = results[rank]
        assert math.isclose(loss, reference.lb_loss.item(), rel_tol=1e-6)
        assert load == [6.0, 2.0]  # the global counts
        mine = whole.grad[4 * rank : 4 * rank + 4]
        assert torch.allclose(torch.tensor(grad), mine, atol=1e-7)  # the global batch's gradient
    local = torch.tensor(RANK_LOGITS[0])
    alone = balancing_losses(local, *route(local, 1)[:2], global_batch=False).lb_loss.item()
    assert alone > results[0][0]  # rank 0 alone looks far less balanced than the global batch


class _RouterModule(pl.LightningModule):
    """One MoE layer trained by Lightning on fixed per-rank batches; only the balancing loss."""

    def __init__(self, global_batch: bool, out_dir: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.moe = MoEFFN(d_model=2, n_experts=2, top_k=1, expert_dim=2, global_batch=global_batch)
        with torch.no_grad():
            self.moe.router.weight.copy_(torch.eye(2))
        self.cfg = MoEConfig(
            n_experts=2, top_k=1, expert_dim=2, lb_coef=1.0, z_coef=0.0, global_batch=global_batch
        )
        self.out_dir = out_dir

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = torch.tensor(RANK_LOGITS[self.global_rank]) / 4  # the router is the identity
        out = self.moe(x)
        total, lb, _ = auxiliary_loss(router_stats(self), self.cfg, self.trainer.world_size)
        self.lb = lb.item()
        return total + 0.0 * out.sum()  # every parameter in the graph, as DDP's reducer expects

    def on_after_backward(self) -> None:  # DDP has all-reduced (averaged) the gradients here
        grad = self.moe.router.weight.grad.tolist()
        torch.save({"lb": self.lb, "grad": grad}, f"{self.out_dir}/rank{self.global_rank}.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)


def _lightning_ddp(global_batch: bool, out_dir: Path) -> list[dict]:
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_RouterModule(global_batch, str(out_dir)))
    return [torch.load(out_dir / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.slow
def test_global_batch_balancing_under_lightning_ddp_on_gloo(tmp_path: Path) -> None:
    """Lightning's DDP, two CPU processes (gloo). With global-batch balancing both ranks see the
    global batch's loss and, after DDP's gradient averaging and ``auxiliary_loss``'s world-size
    factor, the router gets exactly the gradient of that loss on the whole batch in one process.
    Per-rank balancing gives each rank its own, larger, loss and a different gradient."""
    whole = torch.tensor(RANK_LOGITS[0] + RANK_LOGITS[1]) / 4
    ref = MoEFFN(d_model=2, n_experts=2, top_k=1, expert_dim=2, global_batch=False)
    with torch.no_grad():
        ref.router.weight.copy_(torch.eye(2))
    ref(whole)
    ref.stats.lb_loss.backward()

    (tmp_path / "global").mkdir()
    (tmp_path / "local").mkdir()
    global_ranks = _lightning_ddp(True, tmp_path / "global")
    local_ranks = _lightning_ddp(False, tmp_path / "local")
    for rank in global_ranks:
        assert rank["lb"] == pytest.approx(ref.stats.lb_loss.item())
        assert torch.allclose(torch.tensor(rank["grad"]), ref.router.weight.grad, atol=1e-6)
    local_losses, local_grads = [r["lb"] for r in local_ranks], []
    for rank, batch in enumerate(RANK_LOGITS):
        alone = MoEFFN(d_model=2, n_experts=2, top_k=1, expert_dim=2, global_batch=False)
        with torch.no_grad():
            alone.router.weight.copy_(torch.eye(2))
        alone(torch.tensor(batch) / 4)
        alone.stats.lb_loss.backward()
        assert local_losses[rank] == pytest.approx(alone.stats.lb_loss.item())
        local_grads.append(alone.router.weight.grad)
    assert local_losses[0] > global_ranks[0]["lb"]  # rank 0 alone: everything on one expert
    for rank in local_ranks:  # per-rank balancing: DDP's average of each rank's own gradient, no factor
        assert torch.allclose(torch.tensor(rank["grad"]), (local_grads[0] + local_grads[1]) / 2, atol=1e-6)
    assert not torch.allclose(torch.tensor(local_ranks[0]["grad"]), ref.router.weight.grad, atol=1e-4)


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop_over_experts"])
def test_moe_gradients_are_bitwise_reproducible_with_several_threads(grouped_mm: bool) -> None:
    """The same batch twice gives the same bits: a token's k copies meet in its gradient in a
    fixed order. (Gathering them with ``flat[token_of]`` did not on CPU: its backward accumulated
    the copies in thread order, so two runs of one cell at Table 1's tiny shape drifted apart.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        grads = []
        for _ in range(3):
            torch.manual_seed(0)
            moe = MoEFFN(128, 128, 8, 48)
            moe.use_grouped_mm = grouped_mm
            x = torch.randn(1016, 128, requires_grad=True)  # 8 sequences of 127 tokens
            moe(x).square().sum().backward()
            grads.append([x.grad, moe.router.weight.grad, moe.w_gate_up.grad, moe.w_down.grad])
    finally:
        torch.set_num_threads(threads)
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)
