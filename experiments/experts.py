"""How a MoE layer's experts run on their tokens: counting, the grouped kernel, the loop, the combine.

:class:`~experiments.moe.MoEFFN` sorts its ``N * k`` token assignments by expert (a stable sort),
so each expert's tokens are one contiguous slice. This module computes the experts' SwiGLU on those
slices and adds each token's ``k`` outputs back together, with three properties the training step
relies on:

- **No host syncs.** Per-expert counts come from a fixed-size ``scatter_add`` (``bincount``'s
  output size depends on the data, so it waits for the device), and the grouped path sizes every
  buffer from shapes alone. Only the looped fallback reads the counts on the host.
- **One arithmetic everywhere.** The grouped path (``torch.nn.functional.grouped_mm``: two kernel
  launches for all experts) equals the per-expert loop in forward and backward, on random,
  unaligned counts with empty experts (``tests/test_moe.py``; on CUDA in ``make gpu-check``).
- **Deterministic combine.** Each token's ``k`` outputs are added in ascending expert order, one
  addition after the other: the order ``index_add_`` used on one CPU thread (so no number moved),
  without the atomics that make ``index_add_`` order-dependent on a GPU.

**Alignment on CUDA.** Older CUDA builds of ``grouped_mm`` asserted that every group's rows start
at a multiple of 16 bytes (8 bf16 rows), and MoE codebases (torchtitan until 2026) pad each
expert's group for it. Groups are padded to :data:`CUDA_GROUP_ALIGN` rows there, empty experts
included, at a cost of at most ``E * 8`` zero rows; on the CPU nothing is padded. Whether the
padding still pays on sm_90 with torch 2.10 and later (whose 2-D x 3-D forward checks no group
alignment) is what ``make gpu-check`` times, padded against unpadded.

**Which kernel.** ``torch.nn.functional.grouped_mm`` from torch 2.10 (the project's floor), else the
private ``torch._grouped_mm`` it wraps (torch 2.8 and 2.9, a machine's own Python), else the loop;
the run's log and ``moe_experts`` tag name the path either way.

**Under torch.compile** ``grouped_mm``'s meta function accepts bf16 only, so a float32 compiled
graph runs it as the opaque custom op ``gated_attn::grouped_mm`` (its eager kernel, its own
backward): no graph break in either dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Rows each expert's group is padded to on CUDA: 16 bytes of bf16 (see the module docstring).
CUDA_GROUP_ALIGN = 8
#: The grouped kernel: ``torch.nn.functional.grouped_mm`` (public from torch 2.10), else the private
#: ``torch._grouped_mm`` it wraps (torch 2.8 and 2.9); None where neither exists (the loop runs).
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
#: How the experts' path names the kernel in a run's log and tag.
GROUPED_MM_NAME = "grouped_mm" if hasattr(F, "grouped_mm") else "grouped_mm (torch._grouped_mm)"


def expert_counts(assigned: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(N*k,) expert ids -> (E,) int64 assignments per expert, with no host sync (unlike
    ``bincount``, whose output length depends on the values)."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=assigned.device)
    return counts.scatter_add_(0, assigned, torch.ones_like(assigned))


def group_align(device: torch.device) -> int:
    """Rows per group boundary the grouped kernel gets on ``device``: 1 (no padding) on the CPU."""
    return CUDA_GROUP_ALIGN if device.type == "cuda" else 1


@torch.library.custom_op("gated_attn::grouped_mm", mutates_args=())
def _opaque_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return GROUPED_MM(x, w, offs=offs)


@_opaque_grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


def _opaque_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    x, w, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = _opaque_grouped_mm(grad, w.transpose(-2, -1).contiguous(), offs)
    grad_w = _opaque_weight_grad(x, grad, offs)
    return grad_x, grad_w, None


@torch.library.custom_op("gated_attn::grouped_mm_weight_grad", mutates_args=())
def _opaque_weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # The 2-D x 2-D form: one (K, N) product per group of rows, what grouped_mm's own backward does.
    return GROUPED_MM(x.t(), grad, offs=offs)


@_opaque_weight_grad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offs.shape[0], x.shape[1], grad.shape[1])


def _save(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


_opaque_grouped_mm.register_autograd(_opaque_backward, setup_context=_save)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(x (M, K), w (G, K, N), offs (G,) int32) -> (M, N)`` (:data:`GROUPED_MM`), as
    an opaque op inside a float32 (or float16) compiled graph (module docstring), and on float32
    meta tensors (the memory plan, ``experiments.memory``: the kernel's meta function takes bf16
    only); rows past ``offs[-1]`` are undefined."""
    if (torch.compiler.is_compiling() or x.is_meta) and x.dtype != torch.bfloat16:
        return _opaque_grouped_mm(x, w, offs)
    return GROUPED_MM(x, w, offs=offs)


def _padded_positions(
    assigned_sorted: torch.Tensor, counts: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each sorted assignment goes when every expert's group starts at a multiple of
    ``align`` rows and holds at least ``align`` rows: (N*k,) row positions, (E,) int32 group ends,
    and the buffer's rows ``N*k + E*align`` (a bound fixed by the shapes: no sync)."""
    padded = ((counts + align - 1) // align * align).clamp(min=align)
    ends = padded.cumsum(0)
    first_sorted = counts.cumsum(0) - counts  # each expert's first row in the unpadded order
    rank = torch.arange(assigned_sorted.shape[0], device=counts.device) - first_sorted[assigned_sorted]
    positions = (ends - padded)[assigned_sorted] + rank
    return positions, ends.to(torch.int32), assigned_sorted.shape[0] + counts.shape[0] * align


def grouped_swiglu(
    grouped: torch.Tensor,
    counts: torch.Tensor,
    scale: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    assigned_sorted: torch.Tensor,
    align: int = 1,
) -> torch.Tensor:
    """Every expert's SwiGLU on its slice of ``grouped`` in two ``grouped_mm`` calls.

    Args:
        grouped: (N*k, d) token copies sorted by expert; counts: (E,) int64 rows per expert;
        scale: (N*k, 1) routing weights, multiplied into the hidden layer (width f);
        w_gate_up: (E, d, 2f); w_down: (E, f, d), already in the compute dtype;
        assigned_sorted: (N*k,) the expert of each sorted row (for padding);
        align: pad each group to a multiple of this many rows (1: no padding).

    Returns:
        (N*k, d) outputs in the sorted order, ``grouped``'s dtype.
    """
    if align > 1:
        positions, ends, rows = _padded_positions(assigned_sorted, counts, align)
        x = grouped.new_zeros(rows, grouped.shape[1]).index_copy(0, positions, grouped)
        s = scale.new_zeros(rows, 1).index_copy(0, positions, scale)
    else:
        x, s, ends = grouped, scale, counts.cumsum(0).to(torch.int32)
    gate, up = grouped_mm(x, w_gate_up, ends).chunk(2, dim=-1)
    out = grouped_mm((F.silu(gate) * up * s).contiguous(), w_down, ends)
    return out.index_select(0, positions) if align > 1 else out


def looped_swiglu(
    grouped: torch.Tensor,
    counts: torch.Tensor,
    scale: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The reference: one matmul pair per expert on its contiguous slice (a loop over experts,
    never tokens). Reads the counts on the host: one sync per layer. Same arguments as
    :func:`grouped_swiglu`."""
    outputs = torch.empty_like(grouped)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = slice(start, start + n)
            gate, up = (grouped[rows] @ w_gate_up[e]).chunk(2, dim=-1)
            outputs[rows] = (F.silu(gate) * up * scale[rows]) @ w_down[e]
        start += n
    return outputs


def combine(
    outputs: torch.Tensor, order: torch.Tensor, assigned_sorted: torch.Tensor, top_k: int, n_experts: int
) -> torch.Tensor:
    """Each token's ``k`` expert outputs summed: (N*k, d) in the sorted order -> (N, d).

    ``order`` (N*k,) is the sort that grouped the flat assignments ``n * k + j`` by expert and
    ``assigned_sorted`` (N*k,) their experts in that order. A token's outputs are added in
    ascending expert order, one after the other (module docstring). Gathering by a permutation
    moves each row once, so the backward adds nothing twice either.
    """
    token_of = order // top_k
    by_token = (token_of * n_experts + assigned_sorted).argsort()  # token-major, experts ascending
    parts = outputs.index_select(0, by_token).view(-1, top_k, outputs.shape[-1])
    total = parts[:, 0]
    for j in range(1, top_k):
        total = total + parts[:, j]
    return total
