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

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from experiments.config import MoEConfig


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
) -> RouterStats:
    """Load-balancing loss and z-loss of one routing (see the module docstring).

    Args:
        logits: (N, E) router logits; probs: (N, E) their softmax; experts: (N, k) chosen experts.
        global_batch: all-reduce counts and probability sums across data-parallel ranks (when
            ``torch.distributed`` is initialised) before forming the loss.
        before: the routing of this optimiser step's earlier micro-batches: its counts and tokens
            join this one's in ``f`` (``P`` stays this micro-batch's).
    """
    n_experts = probs.shape[-1]
    counts = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype)
    prob_sum = probs.sum(dim=0)
    tokens = torch.tensor(float(probs.shape[0]), device=probs.device)
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
        #: ``torch.nn.functional.grouped_mm`` for the experts; turns itself off where unsupported.
        self.use_grouped_mm = True

    def inactive_parameters(self) -> int:
        """Expert parameters a token does not use: those of ``n_experts - top_k`` experts."""
        per_expert = (self.w_gate_up.numel() + self.w_down.numel()) // self.n_experts
        return (self.n_experts - self.top_k) * per_expert

    def expert(self, e: int, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Expert ``e`` on (M, d) tokens -> (M, d), its output scaled per token by ``scale`` (M, 1)."""
        gate, up = (x @ self.w_gate_up[e]).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        return (hidden if scale is None else hidden * scale) @ self.w_down[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        logits = self.router(flat)  # (N, E)
        probs, experts, weights = route(logits, self.top_k)
        # Outside training: no collective (the ranks validate different numbers of batches), and
        # nothing carried to or from the training step's micro-batches.
        before = self._step_so_far if self.carry and self.training else None
        self.stats = balancing_losses(logits, probs, experts, self.global_batch and self.training, before)
        if self.training:
            self._step_so_far = self.stats
        # Group the N*k assignments by expert (a stable sort); each expert runs once on its slice.
        assigned = experts.flatten()  # (N*k,)
        order = assigned.argsort(stable=True)
        token_of = order // self.top_k  # which token each sorted assignment came from
        counts = torch.bincount(assigned, minlength=self.n_experts)
        # (N*k, d), expert 0's tokens first. Repeat, then permute: the backward of a permutation
        # adds nothing twice, so the gradient is bitwise reproducible (flat[token_of] is not on CPU:
        # its backward accumulates a token's k copies in whatever order the threads run).
        grouped = flat.repeat_interleave(self.top_k, dim=0).index_select(0, order)
        # The routing weight scales the expert's hidden layer (width f), not its output (width d):
        # the same product, as the down projection is linear, on fewer numbers.
        scale = weights.flatten()[order, None]
        outputs = self._grouped_experts(grouped, counts, scale) if self.use_grouped_mm else None
        if outputs is None:
            outputs = self._looped_experts(grouped, counts, scale)
        out = torch.zeros_like(flat).index_add_(0, token_of, outputs.to(flat.dtype))
        return out.reshape(shape)

    def _grouped_experts(
        self, grouped: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor | None:
        """All experts in two ``grouped_mm`` calls (one kernel each instead of E small matmuls);
        None where this build or device cannot run them, and the layer falls back to the loop."""
        offsets = counts.cumsum(0).to(torch.int32)
        device = grouped.device.type
        # grouped_mm has no autocast rule: cast by hand, as autocast casts the dense path's matmuls
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else grouped.dtype
        grouped = grouped.to(dtype)
        w_gate_up, w_down = self.w_gate_up.to(dtype), self.w_down.to(dtype)
        try:
            gate, up = F.grouped_mm(grouped, w_gate_up, offs=offsets).chunk(2, dim=-1)
            hidden = F.silu(gate) * up * scale.to(dtype)
            return F.grouped_mm(hidden.contiguous(), w_down, offs=offsets)
        except torch.OutOfMemoryError:
            raise
        except (AttributeError, RuntimeError, NotImplementedError):  # e.g. a GPU without the kernel
            self.use_grouped_mm = False
            return None

    def _looped_experts(
        self, grouped: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """One matmul pair per expert on its contiguous slice: a loop over experts, never tokens."""
        outputs = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                outputs[start : start + n] = self.expert(
                    e, grouped[start : start + n], scale[start : start + n]
                )
            start += n
        return outputs


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
