"""The MoE FFN against a naive per-token reference, and its routing losses by hand."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from experiments.moe import MoEFFN, balancing_losses, route


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


def test_moe_equals_the_per_token_reference() -> None:
    torch.manual_seed(0)
    moe = MoEFFN(d_model=16, n_experts=8, top_k=3, expert_dim=12)
    x = torch.randn(2, 5, 16)
    assert torch.allclose(moe(x), naive(moe, x.reshape(-1, 16)).reshape(2, 5, 16), atol=1e-5)


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
    assert math.isclose(stats.load_cv, float(torch.tensor([3.0, 1.0, 0.0]).std(unbiased=False) / (4 / 3)))


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
