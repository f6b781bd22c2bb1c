"""The expert kernels and the routing as ``make gpu-check`` checks them (``tools/gpu_check.py``):
``small``'s MoE layer on the GPU it finds, each figure into the report as it is measured."""

from __future__ import annotations

import time
from typing import Any

import torch

from experiments.experts import CUDA_GROUP_ALIGN, expert_counts, grouped_swiglu, looped_swiglu
from experiments.moe import MoEFFN, choose_experts_path

#: The ways the experts run, timed against each other: rows padded per expert group as on CUDA,
#: unpadded (torch >= 2.10's 2-D x 3-D forward checks no group alignment), one expert at a time.
PADDED, UNPADDED = f"grouped_mm, groups padded to {CUDA_GROUP_ALIGN}", "grouped_mm, unpadded"
PATHS = {PADDED: CUDA_GROUP_ALIGN, UNPADDED: 1, "loop": 0}


def expert_kernels(device: str, report: Any) -> str:
    """``small``'s MoE layer (d 512, 128 experts of 192, top-8) on 4,096 tokens (on a CPU, a
    rehearsal: ``tiny``'s, d 128 and experts of 48, on 64), routed by a random router (unbalanced,
    unaligned counts): each grouped path against the loop, forward and backward, bf16 and fp32,
    with each one's milliseconds (the second of two runs)."""
    torch.manual_seed(0)
    d, f, tokens = (512, 192, 4096) if device == "cuda" else (128, 48, 64)
    moe = MoEFFN(d, 128, 8, f).to(device)
    x = torch.randn(tokens, d, device=device)
    experts = moe.router(x).topk(8).indices.flatten()
    order = experts.argsort(stable=True)
    sorted_experts = experts.index_select(0, order)
    counts = expert_counts(experts, 128)
    grouped = x.repeat_interleave(8, dim=0).index_select(0, order)
    scale = torch.rand(grouped.shape[0], 1, device=device)
    layer = (counts, scale, moe.w_gate_up, moe.w_down, sorted_experts)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        results, ms = {}, {}
        for path, align in PATHS.items():
            _once(align, grouped, layer, dtype, device)  # a warm-up: kernels load, memory settles
            took, results[path] = _once(align, grouped, layer, dtype, device)
            ms[path] = took * 1e3
            report.figure(f"experts fwd+bwd, {name}, {path} (ms)", f"{ms[path]:.2f}")
        tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
        for path in (PADDED, UNPADDED):
            worst = max(
                float((a - b).abs().max() / b.abs().max()) for a, b in zip(results[path], results["loop"])
            )
            if not worst <= tolerance:
                raise AssertionError(f"{dtype}: {path} against the loop off by {worst:.1e} (relative)")
        out.append(f"{name}: padded {ms[PADDED]:.1f} ms, unpadded {ms[UNPADDED]:.1f}, loop {ms['loop']:.1f}")
    path = choose_experts_path(moe, torch.device(device), torch.bfloat16)
    report.figure("experts path (bf16)", path)
    return f"path {path}; each grouped path equals the loop forward and backward; {'; '.join(out)}"


def _once(
    align: int, grouped: torch.Tensor, layer: tuple, dtype: torch.dtype, device: str
) -> tuple[float, list]:
    """One forward and backward of the experts (``align`` 0: the loop): seconds, output, gradients."""
    counts, scale, w_gate_up, w_down, sorted_experts = layer
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (grouped, w_gate_up, w_down)]
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if align:
        y = grouped_swiglu(leaves[0], counts, scale.to(dtype), leaves[1], leaves[2], sorted_experts, align)
    else:
        y = looped_swiglu(leaves[0], counts, scale.to(dtype), leaves[1], leaves[2])
    y.float().square().mean().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, [y.detach().float(), *(t.grad.float() for t in leaves)]


def routing(device: str, report: Any) -> str:
    """How many of 8,192 tokens' top-8 sets (1,024 on a CPU) a bf16 router would change, and that
    the layer routes in fp32."""
    torch.manual_seed(1)
    moe = MoEFFN(512, 128, 8, 192).to(device)
    x = torch.randn(8192 if device == "cuda" else 1024, 512, device=device)
    with torch.no_grad():
        fp32 = moe.router(x).topk(8).indices.sort(-1).values
        rounded = (x.bfloat16() @ moe.router.weight.bfloat16().T).float().topk(8).indices.sort(-1).values
        with torch.autocast(device, dtype=torch.bfloat16):
            moe(x)
    moved = float((rounded != fp32).any(-1).float().mean())
    layer = expert_counts(fp32.flatten(), 128).float()
    if not torch.equal(moe.stats.load, layer):
        raise AssertionError("the layer's routing under autocast differs from fp32 routing")
    report.figure("tokens a bf16 router would route elsewhere", f"{moved:.1%}")
    return f"a bf16 router would move {moved:.1%} of the tokens' top-8 sets; the layer routes in fp32"
