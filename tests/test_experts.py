"""The MoE experts' kernels (issue 44): the grouped path, padded as on CUDA or not, equals the
per-expert loop in forward and backward on random unaligned counts; the combine adds in the order
``index_add_`` did; the router stays fp32 under autocast; the path taken is recorded with its
reason. ``make gpu-check`` runs the same parity on CUDA (``test_experts_on_cuda_*``)."""

from __future__ import annotations

import pytest
import torch

from experiments.experts import (
    CUDA_GROUP_ALIGN,
    combine,
    expert_counts,
    grouped_mm,
    grouped_swiglu,
    looped_swiglu,
)
from experiments.moe import MoEFFN, choose_experts_path


def random_groups(seed: int, n_experts: int = 16, tokens: int = 53, d: int = 16, f: int = 8):
    """Unaligned counts with empty experts: (grouped, counts, scale, w_gate_up, w_down, assigned_sorted)."""
    g = torch.Generator().manual_seed(seed)
    assigned = torch.randint(0, n_experts // 2, (tokens,), generator=g) * 2  # every odd expert empty
    assigned = assigned.sort().values
    counts = expert_counts(assigned, n_experts)
    x = torch.randn(tokens, d, generator=g)
    scale = torch.rand(tokens, 1, generator=g)
    w1 = torch.randn(n_experts, d, 2 * f, generator=g) / d**0.5
    w2 = torch.randn(n_experts, f, d, generator=g) / f**0.5
    return x, counts, scale, w1, w2, assigned


def _forward_backward(path: str, inputs: tuple) -> list[torch.Tensor]:
    x, counts, scale, w1, w2, assigned = inputs
    leaves = [t.clone().requires_grad_() for t in (x, scale, w1, w2)]
    if path == "loop":
        out = looped_swiglu(leaves[0], counts, leaves[1], leaves[2], leaves[3])
    else:
        align = CUDA_GROUP_ALIGN if path == "grouped, padded" else 1
        out = grouped_swiglu(leaves[0], counts, leaves[1], leaves[2], leaves[3], assigned, align)
    out.mul(torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("path", ["grouped", "grouped, padded"])
def test_grouped_experts_equal_the_loop_forward_and_backward(path: str, seed: int) -> None:
    inputs = random_groups(seed)
    assert (inputs[1] % CUDA_GROUP_ALIGN != 0).any() and (inputs[1] == 0).any()  # unaligned, empty
    want = _forward_backward("loop", inputs)
    got = _forward_backward(path, inputs)
    for name, a, b in zip(("output", "x grad", "scale grad", "w_gate_up grad", "w_down grad"), got, want):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, float((a - b).abs().max()))


def test_counts_are_bincount_without_a_sync() -> None:
    ids = torch.tensor([3, 0, 3, 5, 3, 0])
    assert torch.equal(expert_counts(ids, 7), torch.bincount(ids, minlength=7))


def test_combine_adds_in_index_add_order_bitwise() -> None:
    """The combine replaced ``zeros.index_add_(0, token_of, outputs)``; the numbers did not move."""
    g = torch.Generator().manual_seed(0)
    n, k, e, d = 40, 8, 128, 24
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])  # (N, k), best first
    assigned = experts.flatten()
    order = assigned.argsort(stable=True)
    outputs = torch.randn(n * k, d, generator=g) * 10.0 ** torch.randint(-3, 4, (n * k, 1), generator=g)
    old = torch.zeros(n, d).index_add_(0, order // k, outputs)
    new = combine(outputs, order, assigned.index_select(0, order), k, e)
    assert torch.equal(new, old)


def test_the_router_and_its_losses_stay_fp32_under_autocast() -> None:
    torch.manual_seed(0)
    moe = MoEFFN(d_model=64, n_experts=16, top_k=4, expert_dim=16)
    x = torch.randn(128, 64)
    fp32 = moe(x)
    experts_fp32 = moe.router(x).topk(4).indices.sort().values
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
        assert moe.stats.lb_loss.dtype == moe.stats.z_loss.dtype == torch.float32
        logits = torch.nn.functional.linear(x.bfloat16(), moe.router.weight.bfloat16())
    assert out.dtype == torch.float32  # the combine adds in the input's dtype
    experts_bf16 = logits.float().topk(4).indices.sort().values
    assert (experts_bf16 != experts_fp32).any(), "bf16 routing would differ: this test shows nothing"
    # the layer's own routing under autocast is the fp32 routing (same experts, same weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
    assert torch.equal(moe.stats.load, torch.bincount(experts_fp32.flatten(), minlength=16).float())
    assert torch.allclose(out, fp32, rtol=0.05, atol=0.05 * float(fp32.detach().abs().max()))


def test_the_path_taken_is_recorded_with_its_reason() -> None:
    wide = MoEFFN(d_model=16, n_experts=4, top_k=2, expert_dim=8)
    assert choose_experts_path(wide, torch.device("cpu"), torch.float32) == "grouped_mm"
    narrow = MoEFFN(d_model=2, n_experts=4, top_k=1, expert_dim=2)  # rows of 8 bytes: the kernel refuses
    path = choose_experts_path(narrow, torch.device("cpu"), torch.float32)
    assert path.startswith("looped: grouped_mm failed on cpu in torch.float32") and not narrow.use_grouped_mm
    narrow(torch.randn(3, 2))  # and the loop runs
    off = MoEFFN(d_model=16, n_experts=4, top_k=2, expert_dim=8)
    off.use_grouped_mm = False
    path = choose_experts_path(off, torch.device("cpu"), torch.float32)
    assert path == "looped: turned off (use_grouped_mm)"


def test_without_the_public_kernel_the_private_one_runs_and_the_path_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.8 and 2.9 have ``torch._grouped_mm`` only: it runs the experts, equal to the loop,
    and the path names it; a torch with neither loops, saying why."""
    from experiments import experts
    from experiments import moe as moe_module

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    monkeypatch.setattr(experts, "GROUPED_MM", torch._grouped_mm)
    monkeypatch.setattr(moe_module, "GROUPED_MM", torch._grouped_mm)
    monkeypatch.setattr(moe_module, "GROUPED_MM_NAME", "grouped_mm (torch._grouped_mm)")
    monkeypatch.setattr(moe_module, "_PATH_CHECKS", {})
    layer = MoEFFN(d_model=16, n_experts=4, top_k=2, expert_dim=8)
    assert choose_experts_path(layer, torch.device("cpu"), torch.float32) == "grouped_mm (torch._grouped_mm)"
    inputs = random_groups(4)
    for got, want in zip(_forward_backward("grouped", inputs), _forward_backward("loop", inputs)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(moe_module, "GROUPED_MM", None)
    monkeypatch.setattr(moe_module, "_PATH_CHECKS", {})
    path = choose_experts_path(
        MoEFFN(d_model=16, n_experts=4, top_k=2, expert_dim=8), torch.device("cpu"), torch.float32
    )
    neither = "has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    assert path == f"looped: torch {torch.__version__} {neither}"


def test_a_model_first_run_without_gradients_takes_the_grouped_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring a loaded checkpoint runs under ``no_grad``: the kernel's check (a backward) must
    not fail there and send the experts to the loop (a bench bpb 1e-8 off the committed one)."""
    from experiments import moe as moe_module

    monkeypatch.setattr(moe_module, "_PATH_CHECKS", {})
    layer = MoEFFN(d_model=16, n_experts=4, top_k=2, expert_dim=8)
    with torch.no_grad():
        layer(torch.randn(5, 16))
    assert layer.experts_path == "grouped_mm"


def test_the_fp32_compiled_kernel_has_grouped_mm_gradients() -> None:
    """The custom op a float32 compiled graph runs (grouped_mm's meta accepts bf16 only)."""
    x, counts, _, w1, _, _ = random_groups(3)
    offs = counts.cumsum(0).to(torch.int32)
    grads = []
    for opaque in (False, True):
        a, b = x.clone().requires_grad_(), w1.clone().requires_grad_()
        fn = torch.compile(grouped_mm, backend="aot_eager", fullgraph=True) if opaque else grouped_mm
        out = fn(a, b, offs)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads.append((out.detach(), a.grad, b.grad))
    for got, want in zip(*grads):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_on_cuda_equal_the_cpu_loop(dtype: torch.dtype) -> None:
    """On the GPU: the padded grouped kernel against the fp32 loop on the CPU, forward and backward."""
    inputs = random_groups(5, n_experts=32, tokens=301, d=64, f=32)
    want = _forward_backward("loop", inputs)
    x, counts, scale, w1, w2, assigned = (t.cuda() for t in inputs)
    leaves = [t.to(dtype).requires_grad_() for t in (x, scale, w1, w2)]
    out = grouped_swiglu(leaves[0], counts, leaves[1], leaves[2], leaves[3], assigned, CUDA_GROUP_ALIGN)
    out.float().mul(torch.linspace(-1, 1, out.shape[-1], device="cuda")).square().sum().backward()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for got, ref in zip([out.detach(), *(t.grad for t in leaves)], want):
        error = float((got.float().cpu() - ref).abs().max() / ref.abs().max())
        assert error < tol, error
