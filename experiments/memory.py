"""Per-GPU memory of a training run, planned before it starts (``make memory``, docs/scales.md).

A :class:`MemoryPlan` adds up, in GiB a GPU, what one rank of ``cfg`` holds at its peak on a GPU
(``train.precision: auto`` is bf16-mixed there):

- **weights, gradients, optimizer**: fp32, 4, 4 and 8 bytes a parameter (AdamW's two moments),
  divided over the ranks under FSDP. DDP adds its gradient buckets (4 bytes a parameter). Under
  FSDP with ``grad_sync: step`` and ``grad_accum > 1`` each rank also holds the whole model's
  unsharded gradient between micro-batches, in fp32 (FSDP2 accumulates in the reduce dtype).
- **gathered** (FSDP): whole weights in the compute dtype of the root (embedding, LM head) and
  of two blocks (the running one and the next, prefetched); the root's unsharded gradients
  through the backward pass; one block's unsharded gradient and its fp32 reduce-scatter input.
- **activations**: the bytes the forward pass saves for the backward at the micro-batch
  (``train.device_batch`` x ``train.seq_len`` tokens), measured by running the model on the meta
  device (shapes only, no memory) with a saved-tensor hook, tensors that share storage counted
  once; attention saved as flash attention saves it (q, k, v, output, log-sum-exp), not the
  (B, H, T, T) map. Plus the loss's backward transient: the logits' gradient, fp32 and
  compute-dtype. With per-block checkpointing: what the forward saves outside the blocks, each
  block's input, and the one block recomputed at a time.
- **runtime**: :data:`RUNTIME_GIB` for the CUDA context and NCCL's buffers (an allowance, not
  measured).

Each part is counted at its own peak, so the total is an upper bound of the eager step; a
compiled step saves less (fused elementwise ops). A row fits a GPU of ``train.gpu_memory_gib``
when the total is at most :data:`USABLE` of it, the rest left to the allocator's fragmentation.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from experiments.config import ModelConfig, RunConfig, TrainConfig
from experiments.model import GatedLM
from experiments.sharding import apply_fsdp, checkpoint_blocks, clip_sharded_grad_norm, shard_numel

GIB = 2**30
RUNTIME_GIB = 2.0  # CUDA context and NCCL buffers: an allowance
USABLE = 0.9  # of train.gpu_memory_gib; the rest for the allocator's fragmentation


@dataclass(frozen=True)
class MemoryPlan:
    """GiB a GPU of one training rank, by part (module docstring)."""

    strategy: str
    precision: str
    weights: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float
    activations_checkpointed: float
    checkpointing: bool

    @property
    def total(self) -> float:
        """The peak a GPU, with the run's own checkpointing setting, runtime included."""
        act = self.activations_checkpointed if self.checkpointing else self.activations
        return self.weights + self.gradients + self.optimizer + self.gathered + act + RUNTIME_GIB


def gpu_precision(t: TrainConfig) -> str:
    """The precision ``t`` trains in on a current GPU: ``auto`` is ``bf16-mixed``."""
    return "bf16-mixed" if t.precision == "auto" else t.precision


def memory_plan(cfg: RunConfig) -> MemoryPlan:
    """The per-GPU memory of one rank of ``cfg`` (module docstring)."""
    t, precision = cfg.train, gpu_precision(cfg.train)
    compute = 2 if precision == "bf16-mixed" else 4
    saved = saved_activations(cfg.model, t.device_batch, t.seq_len, compute, t.loss_chunk)
    n_params, root, block = saved.params, saved.root_params, saved.block_params
    shards = t.world_size if t.strategy == "fsdp" else 1
    held = sum(shard_numel(shape, shards) for shape in saved.shapes)  # padded where uneven
    gradients = 4 * held
    gathered = 0.0
    if t.strategy == "fsdp":
        gathered = compute * (root + 2 * block) + compute * root + (compute + 4) * block
        if t.grad_sync == "step" and t.grad_accum > 1:
            gradients += 4 * n_params
    elif t.world_size > 1:
        gradients += 4 * n_params  # DDP's buckets
    tokens = t.device_batch * t.seq_len
    # the logits' gradient, fp32 and compute-dtype; chunked, a chunk's recomputed logits with it
    chunk = min(t.loss_chunk or tokens, tokens)
    loss_grad = chunk * cfg.model.vocab_size * (4 + compute + (4 + compute if t.loss_chunk else 0))
    inputs = cfg.model.n_layers * tokens * cfg.model.d_model * compute
    return MemoryPlan(
        strategy=t.strategy,
        precision=precision,
        weights=4 * held / GIB,
        gradients=gradients / GIB,
        optimizer=8 * held / GIB,
        gathered=gathered / GIB,
        activations=(saved.total + loss_grad) / GIB,
        activations_checkpointed=(saved.outside + inputs + max(saved.per_block) + loss_grad) / GIB,
        checkpointing=t.activation_checkpointing,
    )


def memory_problem(cfg: RunConfig) -> str:
    """Why ``cfg`` does not fit a GPU of ``train.gpu_memory_gib`` (one line), or "" when it does
    (or sets no budget)."""
    budget = cfg.train.gpu_memory_gib
    if not budget:
        return ""
    plan = memory_plan(cfg)
    if plan.total <= USABLE * budget:
        return ""
    t, hint = cfg.train, "" if plan.checkpointing else ", train.activation_checkpointing: true"
    return (
        f"needs {plan.total:.1f} GiB a GPU under {plan.strategy} ({plan.precision}, {t.device_batch} x "
        f"{t.seq_len} tokens a micro-batch), over {USABLE:.0%} of {budget:g} GiB: try fewer sequences a "
        f"micro-batch (train.micro_batch), more GPUs (train.devices, num_nodes){hint} (make params)"
    )


@dataclass(frozen=True)
class SavedBytes:
    """Bytes one forward pass saves for the backward, and the parameter counts they go with."""

    total: int
    outside: int  # saved outside the blocks (embedding, final norm, LM head, loss)
    per_block: tuple[int, ...]
    params: int
    root_params: int  # parameters outside the blocks
    block_params: int  # parameters of the largest block
    shapes: tuple[tuple[int, ...], ...] = ()  # every parameter's


@functools.lru_cache(maxsize=64)
def saved_activations(
    model_cfg: ModelConfig, batch: int, seq_len: int, compute_bytes: int, loss_chunk: int = 0
) -> SavedBytes:
    """Run ``model_cfg``'s model on a (``batch``, ``seq_len``) meta batch in the compute dtype of
    ``compute_bytes`` (2: bf16 weights but the router's, as FSDP gathers them; 4: fp32) and count
    the bytes it saves for the backward pass (:func:`count_saved`; the loss ``loss_chunk`` tokens
    at a time when set). Takes about a second at the paper's scale."""
    with torch.device("meta"):
        model = GatedLM(model_cfg)
    dtype = torch.bfloat16 if compute_bytes == 2 else torch.float32
    for name, p in model.named_parameters():
        if ".router." not in name:  # FSDP keeps the router in fp32 (experiments.sharding)
            p.data = p.data.to(dtype)
    batch_tokens = torch.zeros(batch, seq_len + 1, dtype=torch.long, device="meta")
    per_block, outside = count_saved(model, batch_tokens, loss_chunk)
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    n_params = sum(p.numel() for p in model.parameters())
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    return SavedBytes(sum(per_block) + outside, outside, tuple(per_block), n_params, root, block, shapes)


def count_saved(model: GatedLM, batch: torch.Tensor, loss_chunk: int = 0) -> tuple[list[int], int]:
    """Bytes ``model``'s forward and loss (``loss_chunk`` tokens at a time when set) on the
    (B, T + 1) token windows ``batch`` save for the backward pass: per block, and outside the
    blocks. Tensors that share storage count once, the weights not at all; attention counts what
    flash attention saves. On any device (the meta device: shapes only); a MoE's experts take the
    grouped kernel."""
    from experiments.loss import next_token_loss

    _grouped_experts(model)
    seen = {p.untyped_storage()._cdata for p in model.parameters()}  # held anyway: not activations
    where, counts = [-1], [0] * (len(model.blocks) + 1)  # per block, then outside

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (storage := t.untyped_storage())._cdata not in seen:
            seen.add(storage._cdata)
            counts[where[0]] += storage.nbytes()
        return t

    hooks = []
    for i, block in enumerate(model.blocks):
        hooks.append(block.register_forward_pre_hook(lambda *_, i=i: where.__setitem__(0, i)))
        hooks.append(block.register_forward_hook(lambda *_: where.__setitem__(0, -1)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FlashLikeAttention():
            next_token_loss(model, batch, "mean", loss_chunk)
    finally:
        for h in hooks:
            h.remove()
    return counts[:-1], counts[-1]


class _FlashAttention(torch.autograd.Function):
    """Attention's output with what flash attention saves: q, k, v, the output, and the
    (B, H, T) fp32 log-sum-exp (meta tensors: shapes only)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(q.shape)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, *_ = ctx.saved_tensors
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _FlashLikeAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is F.scaled_dot_product_attention:
            return _FlashAttention.apply(*args[:3])
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class MeasuredMemory:
    """One rank's peak memory in a training step, measured by torch's memory tracker (GiB).

    ``parts`` is the peak's breakdown by the tracker's categories (sharded and unsharded
    parameters and gradients, activations, temporaries, all-gather and reduce-scatter buffers,
    optimizer state, inputs), the ones above zero."""

    peak: float
    parts: dict[str, float]

    @property
    def total(self) -> float:
        """The peak with :data:`RUNTIME_GIB` of runtime, comparable with :attr:`MemoryPlan.total`."""
        return self.peak + RUNTIME_GIB


@functools.lru_cache(maxsize=32)
def measured_memory(cfg: RunConfig) -> MeasuredMemory:
    """Rank 0's peak of a ``train.strategy: fsdp`` step of ``cfg`` on a GPU, measured, not planned:
    torch's ``FSDPMemTracker`` (the tool torchtitan's memory estimator uses) follows every tensor
    of one optimiser step (``train.grad_accum`` micro-batches of ``train.device_batch`` x
    ``train.seq_len`` tokens, the router losses, per-block checkpointing, gradient clipping and
    AdamW's update, its moments made beforehand) of the sharded model, built and run under
    ``FakeTensorMode`` (shapes, no memory) on a fake process group of ``train.world_size`` ranks,
    in bf16 autocast on fake CPU tensors: attention takes torch's CPU flash kernel, which keeps
    what CUDA's keeps (output and log-sum-exp). About a minute a row at the paper's scale on a
    CPU core. Differences from a GPU: AdamW is the plain loop (under FakeTensorMode the fused
    kernel was reported with unsharded moments), the experts' groups are not padded to 8 rows (at
    most ``E x 8`` rows a layer), the step is eager (a compiled one keeps less), and the CUDA
    context and NCCL's buffers are not in it (:attr:`MeasuredMemory.total` adds :data:`RUNTIME_GIB`).

    Raises:
        ValueError: another strategy than ``fsdp`` (one process is measured on its GPU).
        RuntimeError: this process already has a process group.
    """
    return _measure(cfg, fake=True)


def _measure(cfg: RunConfig, fake: bool) -> MeasuredMemory:
    """:func:`measured_memory`; with ``fake`` False on real CPU tensors (a test's reference)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    t = cfg.train
    if t.strategy != "fsdp":
        raise ValueError(f"measured_memory measures train.strategy fsdp, not {t.strategy}")
    tensors = FakeTensorMode() if fake else contextlib.nullcontext()
    with _fake_ranks(t.world_size) as mesh, _untracked_sharding_propagation(), tensors:
        with torch.device("meta"):
            model = GatedLM(cfg.model)
        _grouped_experts(model)
        if t.activation_checkpointing:
            checkpoint_blocks(model)
        apply_fsdp(model, mesh, gpu_precision(t))
        model.to_empty(device="cpu")
        model.set_rope()
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.max_lr, foreach=False, fused=False)
        batch = torch.zeros(t.device_batch, t.seq_len + 1, dtype=torch.long)
        tracker = FSDPMemTracker(mod=model, optm=optimizer)
        tracker.track_inputs((batch,))
        with tracker:
            _train_step(model, optimizer, batch, cfg, tracker)
        (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    parts = {str(k).rsplit(".", 1)[-1].lower(): v / GIB for k, v in snapshot.items() if v and k != "Total"}
    return MeasuredMemory(snapshot["Total"] / GIB, parts)


def _train_step(
    model: GatedLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor, cfg: RunConfig, tracker: object
) -> None:
    """AdamW's moments first (a step on zero gradients), then one step of ``train.grad_accum``
    micro-batches as :class:`~experiments.lit.LMModule` takes it."""
    from experiments.loss import next_token_loss
    from experiments.moe import auxiliary_loss, router_stats

    t = cfg.train
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for micro in range(t.grad_accum):
        if t.grad_sync == "step":  # the unsharded gradients stay until the last micro-batch
            model.set_requires_gradient_sync(micro == t.grad_accum - 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=gpu_precision(t) == "bf16-mixed"):
            loss = next_token_loss(model, batch, "mean", t.loss_chunk)
            if stats := router_stats(model):
                loss = loss + auxiliary_loss(stats, cfg.model.moe, t.world_size)[0]
        (loss / t.grad_accum).backward()
        del loss, stats
        tracker.reset_mod_stats()  # per-module figures are per forward; the peak stays
    clip_sharded_grad_norm([p for p in params if p.grad is not None], t.grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _grouped_experts(model: GatedLM) -> None:
    """The experts' kernel of every GPU the measures are for, without its check (no real tensor)."""
    from experiments.moe import MoEFFN

    for m in model.modules():
        if isinstance(m, MoEFFN):
            m.use_grouped_mm, m.experts_path = True, "grouped_mm"


@contextlib.contextmanager
def _fake_ranks(world: int) -> Iterator[object]:
    """A fake process group of ``world`` ranks (no communication; this process is rank 0) and its
    CPU device mesh, for the length of the block."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("measured_memory needs a process without a process group")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _untracked_sharding_propagation() -> Iterator[None]:
    """DTensor finds each op's output shape by running the op on fake tensors of the global shape,
    in the active FakeTensorMode; a memory tracker there counts them as allocations: the whole
    model's fp32 gradients at the clipping (58 GiB at Table 1's ``paper``), its moments at AdamW's
    step. No GPU allocates them (the kernels run on the shards; pytorch PR 183970 leaves them
    out of the tracker in eager mode). Within: that propagation runs without the tracker."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self: ShardingPropagator, op_schema: object) -> object:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
