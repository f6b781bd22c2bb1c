"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) for the paper's
scales, through Lightning's ``ModelParallelStrategy``.

:func:`shard_model` turns the meta-device :class:`~experiments.model.GatedLM` that
:class:`~experiments.lit.LMModule` builds under ``train.strategy: fsdp`` into a sharded one:

- **Units.** Every :class:`~experiments.model.Block` is one FSDP unit, then the root (embedding,
  final norm, LM head): a rank holds its 1/world share of every parameter, gradient and AdamW
  state, and the whole parameters of one block (and the next, prefetched) at a time. A MoE
  layer's router is a unit of its own, in fp32 (below).
- **Even shards.** FSDP2 splits a parameter's dim 0 over the ranks and pads it to a multiple of
  them: Table 1's "Add 4 experts" row has 132 experts on 128 ranks, so each rank would hold room
  for 2 experts, 1.9x the expert state and gather buffers the ranks need. A parameter whose dim 0
  does not split evenly is split on its first dim that does (:func:`even_shard`), as FSDP2's
  ``shard_placement_fn`` allows; padding remains only where no dim divides (:func:`shard_numel`
  counts it for the memory plan).
- **Initialisation.** Sharded on the meta device, then materialised: each rank writes its shards
  of the weights a one-process build draws from the same seed (:mod:`experiments.meta_init`),
  and builds the RoPE tables (buffers, never sharded) in fp32 itself.
- **Mixed precision** (``bf16-mixed``): parameters gathered in bf16 for compute, gradients
  reduced in fp32 into the fp32 shards AdamW steps on, buffers left in fp32. Lightning's FSDP1
  ``bf16-mixed`` reduced gradients and kept the RoPE tables in bf16, unlike one GPU's
  ``bf16-mixed``. The router keeps fp32 weights, as on one GPU: its logits, softmax and
  balancing losses are computed in fp32 (:mod:`experiments.moe`).
- **Activation checkpointing** (``train.activation_checkpointing``): each block keeps only its
  input for the backward pass and recomputes the rest (``torch.distributed._composable.checkpoint``,
  which leaves parameter names, so checkpoints and weights, as they are).
- **Compile** (``train.compile``): each block is compiled on its own (``nn.Module.compile``), as
  torchtitan does, since the loss function of one process spans FSDP's hooks.

:class:`ShardedStrategy` adds what the harness needs to Lightning's strategy: no reduction
between a step's micro-batches (``train.grad_sync: step``), and checkpoints written by
:mod:`experiments.sharded_checkpoints`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from experiments.meta_init import InitPlan
from experiments.model import GatedLM
from experiments.moe import MoEFFN

#: The router's policy under ``bf16-mixed``: fp32 weights for fp32 routing.
FP32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a Lightning precision: ``bf16-mixed`` gathers bf16 parameters and
    reduces fp32 gradients; ``32-true`` is fp32 throughout.

    Raises:
        ValueError: another precision (``16-mixed`` needs a gradient scaler FSDP2 has not).
    """
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "32-true":
        return MixedPrecisionPolicy()
    raise ValueError(f"train.strategy fsdp trains in bf16-mixed or 32-true, not {precision}")


def checkpoint_blocks(model: GatedLM) -> None:
    """Per-block activation checkpointing: each block saves its input only and recomputes its
    activations in the backward pass (the parameter names stay)."""
    from torch.distributed._composable import checkpoint

    for block in model.blocks:
        checkpoint(block)


def even_shard(param: nn.Parameter, world: int) -> Shard:
    """The dim FSDP2 splits ``param`` on over ``world`` ranks: dim 0 when it splits evenly, else
    the first dim that does, else dim 0 (padded)."""
    return Shard(next((d for d, size in enumerate(param.shape) if size % world == 0), 0))


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """Numbers each of ``world`` ranks holds of a parameter of ``shape`` (:func:`even_shard`'s
    dim, padded to a multiple of ``world`` where none splits evenly)."""
    if not shape:
        return 1
    dim = next((d for d, size in enumerate(shape) if size % world == 0), 0)
    return math.prod(shape) // shape[dim] * -(-shape[dim] // world)


def apply_fsdp(model: GatedLM, mesh: Any, precision: str, compile_blocks: bool = False) -> None:
    """Every block one FSDP2 unit (a MoE router its own, in fp32), then the root; even shards
    (:func:`even_shard`). The model stays on its device (meta): :func:`shard_model` materialises it."""
    policy, world = mixed_precision(precision), mesh.size()

    def placement(param: nn.Parameter) -> Shard:
        return even_shard(param, world)

    for block in model.blocks:
        if compile_blocks:
            block.compile()
        if isinstance(block.ffn, MoEFFN) and policy.param_dtype is not None:
            fully_shard(block.ffn.router, mesh=mesh, mp_policy=FP32, shard_placement_fn=placement)
        fully_shard(block, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)


def shard_model(
    model: GatedLM,
    mesh: Any,
    precision: str,
    plan: InitPlan,
    rng_state: torch.Tensor,
    device: torch.device,
    compile_blocks: bool = False,
) -> None:
    """Shard the meta-device ``model`` over ``mesh`` (the data-parallel ranks) in place, then
    materialise each rank's shards on ``device`` with the weights a one-process build from the
    generator state ``rng_state`` has (``plan``, :func:`experiments.meta_init.record_build`).

    Activation checkpointing, if wanted, is applied before (:func:`checkpoint_blocks`).
    """
    apply_fsdp(model, mesh, precision, compile_blocks)
    model.to_empty(device=device)
    plan.replay(model, rng_state)
    model.set_rope()  # the config's RoPE tables, fp32, on this device


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module (its parameters are DTensor shards)."""
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """Whole parameters for calls into ``module``'s submodules that bypass its forward (the
    step-0 statistics call each block's attention on its own): FSDP's unshard, and reshard after.
    Nothing for a module that is not an FSDP unit."""
    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def clip_sharded_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The global gradient norm of sharded ``params`` (all ranks' shards: one all-reduce) as a
    plain 0-d tensor, after clipping the gradients to ``max_norm`` (``math.inf``: no clipping)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):  # a partial sum on each rank until reduced
        norm = norm.full_tensor()
    if max_norm != math.inf:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class ShardedStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as ``train.strategy: fsdp`` uses it: every rank one
    data-parallel shard (no tensor parallelism), checkpoints as :mod:`experiments.sharded_checkpoints`
    writes them.

    Args:
        world_size: processes that train together (``train.world_size``).
        defer_grad_sync: reduce the gradients once a step, after its last micro-batch
            (``train.grad_sync: step``); False reduce-scatters after every micro-batch.
    """

    def __init__(self, world_size: int, defer_grad_sync: bool) -> None:
        super().__init__(data_parallel_size=world_size, tensor_parallel_size=1)
        self.defer_grad_sync = defer_grad_sync

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning enters this for a step's micro-batches but its last: with ``defer_grad_sync``
        FSDP accumulates unsharded gradients and skips their reduce-scatter."""
        model = self.lightning_module.model if self.lightning_module is not None else None
        if not self.defer_grad_sync or not isinstance(model, FSDPModule):
            yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """The training state as a folder of shards
        (:func:`experiments.sharded_checkpoints.save_sharded`); weights gathered whole
        (:meth:`full_weights`) go through the checkpoint IO as one file."""
        from experiments.sharded_checkpoints import save_sharded

        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        save_sharded(self, checkpoint, filepath)

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        """Within: the model's state dict is gathered whole on rank 0 (on its CPU) and a save
        writes one file, as one process writes it (the ``final`` weights for scoring and export)."""
        was = self._save_distributed_checkpoint
        self._save_distributed_checkpoint = False
        try:
            yield
        finally:
            self._save_distributed_checkpoint = was
