"""Fine-grained mixture-of-experts SwiGLU FFN with top-k softmax routing (the paper's 15A2B base:
128 experts, top-8; Section 2.2 and Table 7), dropless, computed by grouping tokens per expert.

Auxiliary losses (Qwen MoE / Switch Transformer conventions):

- **Load-balancing loss** ``E * sum_e f_e * P_e``, with ``f_e`` the share of the top-k
  assignments that go to expert ``e`` and ``P_e`` its mean router probability. Both are computed
  over the *global* batch: the counts and probability sums are all-reduced across data-parallel
  ranks before the product, not averaged per rank or per micro-batch (global-batch balancing,
  Qiu et al. 2025, "Demons in the detail"). With one process, the global batch is the batch.
- **Micro-batches** (``train.grad_accum > 1``): a step's global batch arrives in parts, and ``f``
  of a later part is not known when an earlier one is routed. As Megatron-LM's global auxiliary
  loss does, the counts accumulate over the step's micro-batches (:func:`carry_balance`): micro-batch
  ``m`` uses ``f`` of micro-batches 1..m on all ranks (the last one the whole global batch's) with
  its own ``P``.
- **Router z-loss** ``mean_tokens(logsumexp(router_logits) ** 2)`` (ST-MoE).

Under data parallelism each rank's loss equals the global batch's loss, and its gradient is the
global batch's gradient on the rank's own tokens (``tests/test_moe.py``). DDP then *averages*
gradients over ranks, so the router's balancing gradient arrives divided by the world size:
:func:`auxiliary_loss` multiplies the balancing term by the world size to undo that.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from experiments.config import MoEConfig
from experiments.experts import (
    GROUPED_MM,
    GROUPED_MM_NAME,
    combine,
    expert_counts,
    group_align,
    grouped_swiglu,
    looped_swiglu,
)


@dataclass
class RouterStats:
    """What one MoE forward reports besides its output.

    ``lb_loss`` and ``z_loss`` are scalars with gradients; ``load`` is the (E,) number of
    assignments per expert in the global batch, and ``tokens`` (0-d) its tokens, both float
    without gradient and both over the optimiser step's micro-batches so far when it carries
    (:func:`carry_balance`).
    """

    lb_loss: torch.Tensor
    z_loss: torch.Tensor
    load: torch.Tensor
    tokens: torch.Tensor

    @property
    def load_cv(self) -> torch.Tensor:
        """Coefficient of variation of the expert load (0 = perfectly balanced), a 0-d tensor
        (no device sync until it is read)."""
        return self.load.std(unbiased=False) / self.load.mean().clamp(min=1e-9)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k softmax routing.

    Args:
        logits: (N, E) router logits.
        top_k: experts per token.

    Returns:
        probs (N, E) softmax over all experts; experts (N, k) the k most probable, best first;
        weights (N, k) their probabilities renormalised to sum to 1 per token.
    """
    probs = logits.float().softmax(dim=-1)
    top, experts = probs.topk(top_k, dim=-1)
    return probs, experts, top / top.sum(dim=-1, keepdim=True)


def balancing_losses(
    logits: torch.Tensor,
    probs: torch.Tensor,
    experts: torch.Tensor,
    global_batch: bool = True,
    before: RouterStats | None = None,
    counts: torch.Tensor | None = None,
) -> RouterStats:
    """Load-balancing loss and z-loss of one routing (see the module docstring).

    Args:
        logits: (N, E) router logits; probs: (N, E) their softmax; experts: (N, k) chosen experts.
        global_batch: all-reduce counts and probability sums across data-parallel ranks (when
            ``torch.distributed`` is initialised) before forming the loss.
        before: the routing of this optimiser step's earlier micro-batches: its counts and tokens
            join this one's in ``f`` (``P`` stays this micro-batch's).
        counts: (E,) assignments per expert of ``experts``, when the caller has them already.
    """
    n_experts = probs.shape[-1]
    if counts is None:
        counts = expert_counts(experts.flatten(), n_experts)
    counts = counts.to(probs.dtype)
    prob_sum = probs.sum(dim=0)
    tokens = probs.new_full((), float(probs.shape[0]))  # a fill, not a host-to-device copy
    if global_batch and dist.is_available() and dist.is_initialized():
        stacked = torch.cat([counts, tokens[None]]).detach()
        dist.all_reduce(stacked)
        counts, tokens = stacked[:-1], stacked[-1]
        # The probability sum keeps its gradient: all-reduce a detached copy, add the local part back.
        total = prob_sum.detach().clone()
        dist.all_reduce(total)
        prob_sum = prob_sum + (total - prob_sum.detach())
    p = prob_sum / tokens
    if before is not None:
        counts, tokens = counts + before.load, tokens + before.tokens
    f = counts / (tokens * experts.shape[-1])
    lb = n_experts * (f.detach() * p).sum()
    z = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
    return RouterStats(lb, z, counts.detach(), tokens.detach())


class MoEFFN(nn.Module):
    """Dropless top-k mixture of SwiGLU experts.

    Args:
        d_model: model width.
        n_experts: experts (128 in the paper's 15A2B).
        top_k: experts per token (8).
        expert_dim: hidden width of each expert (768 at 15A2B: fine-grained).
        global_batch: balance over the global batch (see :func:`balancing_losses`).

    Shapes: ``forward`` takes (..., d_model) and returns the same shape; the routing statistics of
    the last call are in ``self.stats``.
    """

    def __init__(
        self, d_model: int, n_experts: int, top_k: int, expert_dim: int, global_batch: bool = True
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in 1..{n_experts}, got {top_k}")
        self.n_experts, self.top_k, self.global_batch = n_experts, top_k, global_batch
        self.router = nn.Linear(d_model, n_experts, bias=False)
        scale = d_model**-0.5  # GatedLM re-initialises these with its init_std
        self.w_gate_up = nn.Parameter(torch.randn(n_experts, d_model, 2 * expert_dim) * scale)
        self.w_down = nn.Parameter(torch.randn(n_experts, expert_dim, d_model) * expert_dim**-0.5)
        self.stats: RouterStats | None = None
        #: Set by :func:`carry_balance`: the next forward continues the last one's optimiser step.
        self.carry = False
        self._step_so_far: RouterStats | None = None  # the last training forward's routing
        self._carried: RouterStats | None = None  # the routing this micro-batch's forward adds to
        #: ``torch.nn.functional.grouped_mm`` for the experts; :func:`choose_experts_path` turns it
        #: off where the kernel fails its check, and ``experts_path`` says which path runs and why.
        self.use_grouped_mm = True
        self.experts_path: str | None = None

    def inactive_parameters(self) -> int:
        """Expert parameters a token does not use: those of ``n_experts - top_k`` experts."""
        per_expert = (self.w_gate_up.numel() + self.w_down.numel()) // self.n_experts
        return (self.n_experts - self.top_k) * per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        # Routing in fp32 under any autocast (meta tensors, the memory plan's, have none).
        with contextlib.nullcontext() if flat.is_meta else torch.autocast(flat.device.type, enabled=False):
            # A module call where the weight is fp32, so a sharded router (its own fp32 FSDP
            # unit, experiments.sharding) is gathered for it; a cast copy of any other weight.
            weight = self.router.weight
            float_weight = weight.dtype == torch.float32
            logits = self.router(flat.float()) if float_weight else F.linear(flat.float(), weight.float())
        probs, experts, weights = route(logits, self.top_k)
        # Group the N*k assignments by expert (a stable sort); each expert runs once on its slice.
        assigned = experts.flatten()  # (N*k,)
        order = assigned.argsort(stable=True)
        assigned_sorted = assigned.index_select(0, order)
        counts = expert_counts(assigned, self.n_experts)  # (E,), once per layer, no host sync
        # Outside training: no collective (the ranks validate different numbers of batches), and
        # nothing carried to or from the training step's micro-batches.
        # As carry_balance left it: a recomputation of this forward (activation checkpointing)
        # must add to the same earlier micro-batches, not to itself.
        before = self._carried if self.carry and self.training else None
        stats = balancing_losses(
            logits, probs, experts, self.global_batch and self.training, before, counts=counts
        )
        # A recomputation (activation checkpointing, inside the backward pass) computes the same
        # statistics again, and must: the checkpoint wants every tensor the forward saved. Kept
        # on the module they would hold the recomputed block's graph, its activations with it,
        # through the backward and past it; the forward's own statistics are the ones the loss used.
        if not recomputing():
            self.stats = stats
            if self.training:
                self._step_so_far = stats
        # (N*k, d), expert 0's tokens first. Repeat, then permute: the backward of a permutation
        # adds nothing twice, so the gradient is bitwise reproducible (flat[token_of] is not on CPU:
        # its backward accumulates a token's k copies in whatever order the threads run).
        grouped = flat.repeat_interleave(self.top_k, dim=0).index_select(0, order)
        # The routing weight scales the expert's hidden layer (width f), not its output (width d):
        # the same product, as the down projection is linear, on fewer numbers.
        scale = weights.flatten()[order, None]
        if self.experts_path is None and not torch.compiler.is_compiling():
            choose_experts_path(self, flat.device, compute_dtype(flat))
        outputs = self._experts(grouped, counts, scale, assigned_sorted)
        out = combine(outputs.to(flat.dtype), order, assigned_sorted, self.top_k, self.n_experts)
        return out.reshape(shape)

    def _experts(
        self, grouped: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor, assigned_sorted: torch.Tensor
    ) -> torch.Tensor:
        """Every expert's SwiGLU on its rows of ``grouped`` (N*k, d), sorted by expert; in the
        autocast dtype, as autocast casts the dense path's matmuls (``grouped_mm`` has no autocast
        rule)."""
        dtype = compute_dtype(grouped)
        grouped, scale = grouped.to(dtype), scale.to(dtype)
        w_gate_up, w_down = self.w_gate_up.to(dtype), self.w_down.to(dtype)
        if self.use_grouped_mm:
            align = group_align(grouped.device)
            return grouped_swiglu(grouped, counts, scale, w_gate_up, w_down, assigned_sorted, align)
        return looped_swiglu(grouped, counts, scale, w_gate_up, w_down)


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: an activation checkpoint's recomputation
    (torch runs it eagerly, outside any compiled graph; a compiled forward is never inside one)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on ``x``'s device run in: autocast's, else ``x``'s own."""
    device = x.device.type
    if device == "meta":
        return x.dtype
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


#: (device type, dtype, d, f) -> why the looped experts run there ("" where grouped_mm passed).
_PATH_CHECKS: dict[tuple[str, torch.dtype, int, int], str] = {}


def grouped_mm_problem(device: torch.device, dtype: torch.dtype, d_model: int, expert_dim: int) -> str:
    """Why ``grouped_mm`` cannot run experts of width ``d_model`` -> ``expert_dim`` on ``device``
    in ``dtype`` ("" when it can): its forward and backward against the per-expert loop on
    unaligned counts with an empty expert, once per device type, dtype and shape in a process (a
    few milliseconds). The kernel needs rows of a multiple of 16 bytes, among others."""
    key = (device.type, dtype, d_model, expert_dim)
    if key not in _PATH_CHECKS:  # a backward: with gradients even when the caller scores without
        with torch.autocast(device.type, enabled=False), torch.enable_grad():
            _PATH_CHECKS[key] = _check_grouped_mm(device, dtype, d_model, expert_dim)
    return _PATH_CHECKS[key]


def _check_grouped_mm(device: torch.device, dtype: torch.dtype, d: int, f: int) -> str:
    if GROUPED_MM is None:
        return f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 13, 1], device=device)
    assigned = torch.repeat_interleave(torch.arange(4, device=device), counts)
    x = torch.randn(17, d, generator=gen).to(device, dtype)
    scale = torch.rand(17, 1, generator=gen).to(device, dtype)
    shapes = ((d, 2 * f), (f, d))
    weights = [(torch.randn(4, *s, generator=gen) / s[0] ** 0.5).to(device, dtype) for s in shapes]
    results = []
    try:
        for grouped in (True, False):
            inputs = [t.clone().requires_grad_() for t in (x, *weights)]
            if grouped:
                out = grouped_swiglu(inputs[0], counts, scale, *inputs[1:], assigned, group_align(device))
            else:
                out = looped_swiglu(inputs[0], counts, scale, *inputs[1:])
            out.float().square().sum().backward()
            results.append([out.detach().float(), *(t.grad.float() for t in inputs)])
    except (RuntimeError, NotImplementedError, TypeError) as err:  # e.g. a GPU without the kernel
        return f"grouped_mm failed on {device.type} in {dtype}: {type(err).__name__}: {str(err)[:160]}"
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want, name in zip(*results, ("output", "input grad", "w_gate_up grad", "w_down grad")):
        error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))
        if not error <= tolerance:
            return f"grouped_mm's {name} on {device.type} in {dtype} is off the loop's by {error:.1e}"
    return ""


def choose_experts_path(moe: MoEFFN, device: torch.device, dtype: torch.dtype) -> str:
    """Set ``moe``'s experts path for ``device`` and ``dtype``: ``grouped_mm`` where it passes
    :func:`grouped_mm_problem`'s check (or was turned off by hand), else the loop, with the
    reason in ``moe.experts_path``. Returns the path."""
    d, f = moe.w_down.shape[-1], moe.w_down.shape[-2]
    problem = grouped_mm_problem(device, dtype, d, f) if moe.use_grouped_mm else "turned off (use_grouped_mm)"
    moe.use_grouped_mm = not problem
    moe.experts_path = GROUPED_MM_NAME if not problem else f"looped: {problem}"
    if not problem and device.type == "cuda":
        moe.experts_path += _cuda_kernel_note(dtype)
    return moe.experts_path


def _cuda_kernel_note(dtype: torch.dtype) -> str:
    """torch runs ``grouped_mm``'s one-kernel path for bf16 on Hopper and Blackwell (sm_90,
    sm_100) only; elsewhere its own fallback loops over the groups, reading the offsets on the
    host: correct (checked), but a host sync and a kernel per expert, so the run says so."""
    major, minor = torch.cuda.get_device_capability()
    if dtype == torch.bfloat16 and (major, minor) in ((9, 0), (10, 0)):
        return ""
    return f" (torch's per-group fallback loop on sm_{major}{minor} in {str(dtype).removeprefix('torch.')})"


def router_stats(model: nn.Module) -> list[RouterStats]:
    """The routing statistics of every :class:`MoEFFN` in ``model`` from its last forward."""
    return [m.stats for m in model.modules() if isinstance(m, MoEFFN) and m.stats is not None]


def carry_balance(model: nn.Module, carry: bool) -> None:
    """Whether each :class:`MoEFFN`'s next forward is a later micro-batch of the same optimiser
    step as its last one (its balancing ``f`` then counts both; module docstring). The training
    step sets it before every micro-batch; a forward outside training (validation, probes, in
    eval mode) never carries."""
    for m in model.modules():
        if isinstance(m, MoEFFN):
            m.carry = carry
            m._carried = m._step_so_far if carry else None


def auxiliary_loss(
    stats: list[RouterStats], cfg: MoEConfig, world_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router losses added to the LM loss: ``lb_coef * world_size * LB + z_coef * Z``.

    LB and Z are the means over layers of each layer's load-balancing loss and z-loss. With
    global-batch balancing the balancing term is multiplied by ``world_size``, because DDP
    averages gradients while each rank's balancing gradient is already the global batch's on its
    own tokens (module docstring). Per-rank balancing (``global_batch=False``) needs no factor:
    DDP's average of the per-rank gradients is the gradient of the mean per-rank loss.

    Returns:
        (total, lb_mean, z_mean): scalars; ``total`` carries the gradient.
    """
    lb = torch.stack([s.lb_loss for s in stats]).mean()
    z = torch.stack([s.z_loss for s in stats]).mean()
    factor = world_size if cfg.global_batch else 1
    return cfg.lb_coef * factor * lb + cfg.z_coef * z, lb, z


def mean_load_cv(stats: list[RouterStats]) -> torch.Tensor:
    """Mean over layers of the expert load's coefficient of variation (0 = balanced), 0-d."""
    return torch.stack([s.load_cv for s in stats]).mean()
