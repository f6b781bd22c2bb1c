"""The training recipe's configuration (:class:`TrainConfig`): optimiser, schedule, budget,
validation, probes, the loss-spike and divergence rules, checkpoints, and where a run trains
(devices, nodes, strategy), which is left out of its run key.

``experiments.config`` re-exports it; :class:`ConfigError` names the offending field's key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from experiments.strict import ConfigError, check_literals

MAX_STEPS = 10**8  # the paper's runs take about 10^5; every step's windows are drawn at the start


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule and budget (Section 2.2: AdamW, warmup to max LR, cosine to min LR)."""

    max_steps: int = 300
    """Optimiser steps."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 128
    """Tokens per sequence."""
    max_lr: float = 2e-3
    """Peak learning rate after warmup (paper MoE: 2e-3)."""
    min_lr: float = 3e-5
    """Floor of the cosine decay (paper MoE: 3e-5)."""
    warmup_steps: int = 30
    """Linear warmup from 0 to ``max_lr`` (paper: 1k of 100k steps)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (norm gains and 1-D tensors get none)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Gradient-norm clipping threshold (0 turns it off)."""
    val_every: int = 100
    """Validate every N steps (and always at the end)."""
    val_tokens: int = 16384
    """Held-out tokens per domain per validation."""
    log_every: int = 1
    """Log training metrics every N steps. More than ``max_steps`` is clamped to it: Lightning logs
    the loss only at every N-th step, so a run would otherwise end with no ``train/loss`` point
    (the grid's loader says so in one line, ``sweep.grid.Grid.log_every_notes``)."""
    precision: Literal["auto", "32-true", "bf16-mixed"] = "auto"
    """``auto``: bf16-mixed on a CUDA GPU with native bf16, fp32 on an older GPU and on the CPU
    (``experiments.devices.auto_precision``)."""
    compile: bool = False
    """Train and validate through ``torch.compile`` (the model and its loss as one graph, no graph
    breaks in bf16 or fp32). On at the GPU scales; off at the CPU scales, where compiling costs
    more than it saves (docs/performance.md) and would move the committed numbers."""
    probe_seqs: int = 4
    """Probe batch: this many ``seq_len`` windows from the start of each domain's test split."""
    probe_every: int = 0
    """Also probe after every N-th validation (0: only once, after training)."""
    spike_window: int = 50
    """Loss-spike rule: the running window of previous training losses (steps)."""
    spike_z: float = 6.0
    """Loss-spike rule: a loss above the window's mean by more than this many standard deviations."""
    diverge_factor: float = 2.0
    """Divergence: a non-finite loss, or one above ``diverge_factor * ln(vocab_size)`` (uniform
    prediction costs ``ln V`` nats, the loss at initialisation)."""
    checkpoint_every: int = 100
    """Save the training state every N steps (only the latest is kept; 0 turns it off)."""
    devices: int = 1
    """Devices per node that train the run together (Lightning's ``devices``)."""
    num_nodes: int = 1
    """Machines that train the run together (Lightning's ``num_nodes``)."""
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    """Lightning's distribution strategy; ``auto`` on one device."""
    grad_accum: int = 1
    """Micro-batches each process accumulates per optimiser step (``accumulate_grad_batches``). A
    MoE's global-batch balancing then spans one micro-batch of every rank, not the whole step."""
    micro_batch: int = 0
    """Sequences each process takes per forward; when set, ``grad_accum`` follows from the global
    batch (``batch_size / (world_size * micro_batch)``), so a row that doubles the batch doubles
    the micro-batches, not the memory (the paper scales). 0: ``grad_accum`` as set."""
    grad_sync: Literal["step", "micro_batch"] = "step"
    """When the ranks reduce the gradients of a step of ``grad_accum`` micro-batches: ``step``,
    once, after the last (no communication in between; under FSDP each rank then holds the whole
    model's unsharded fp32 gradient between micro-batches, 4 bytes a parameter); ``micro_batch``,
    after each (FSDP reduce-scatters every micro-batch's and keeps only its shard: the paper rows'
    choice, docs/scales.md). DDP always reduces once a step."""
    activation_checkpointing: bool = False
    """Keep only each block's input for the backward pass and recompute its activations there:
    about a third more compute for a fraction of the activation memory (``make memory``)."""
    loss_chunk: int = 0
    """Tokens the LM head and the loss take at a time (``experiments.loss``; 0: all of a
    micro-batch's at once). Chunks never hold the whole (tokens, vocabulary) logits in fp32, for
    one more LM-head matmul in the backward pass; the loss is the same within float rounding."""
    gpu_memory_gib: float = 0
    """The memory of the GPUs a row is meant for (GiB; 0: not checked). A row whose estimated
    peak a GPU exceeds it is refused before anything trains (``make memory``, docs/scales.md)."""

    #: Where and how a run trains, not what it trains: left out of the cell's ``run_key``, so one
    #: grid names the same cells on a laptop and on a cluster (the global batch is what counts).
    PLACEMENT: ClassVar[tuple[str, ...]] = (
        "devices", "num_nodes", "strategy", "grad_accum", "micro_batch", "compile", "grad_sync",
        "activation_checkpointing", "gpu_memory_gib", "loss_chunk",
    )  # fmt: skip

    def _derive_grad_accum(self) -> None:
        parts = self.world_size * self.micro_batch
        if self.batch_size % parts:
            raise ConfigError(
                "micro_batch",
                f"the global batch {self.batch_size} does not split into micro-batches of {self.micro_batch} "
                f"on train.devices x num_nodes = {self.world_size} processes",
            )
        accum = self.batch_size // parts
        if self.grad_accum not in (1, accum):
            raise ConfigError(
                "grad_accum",
                f"set grad_accum or micro_batch, not both (micro_batch {self.micro_batch} makes it {accum})",
            )
        object.__setattr__(self, "grad_accum", accum)  # frozen: set once, here

    @property
    def world_size(self) -> int:
        """Processes that train the run together: ``devices * num_nodes``."""
        return self.devices * self.num_nodes

    @property
    def device_batch(self) -> int:
        """Sequences per process per forward: ``batch_size / (world_size * grad_accum)``."""
        return self.batch_size // (self.world_size * self.grad_accum)

    def __post_init__(self) -> None:
        check_literals(self)
        for name in (
            "max_steps", "batch_size", "seq_len", "val_every", "val_tokens", "log_every", "probe_seqs",
            "spike_window", "spike_z", "diverge_factor", "devices", "num_nodes", "grad_accum", "max_lr",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.log_every > self.max_steps:  # a smoke-test budget under a scale's log_every: log at the end
            object.__setattr__(self, "log_every", self.max_steps)  # frozen: set once, here
        for name in (
            "probe_every",
            "checkpoint_every",
            "grad_clip",
            "weight_decay",
            "gpu_memory_gib",
            "micro_batch",
            "loss_chunk",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be 0 or more, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):  # AdamW's moving averages: a factor of 1 or more never forgets
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.spike_window < 2:
            raise ConfigError(
                "spike_window", f"must be at least 2 (a standard deviation), got {self.spike_window}"
            )
        if self.diverge_factor <= 1:
            raise ConfigError(
                "diverge_factor",
                f"must exceed 1 (the loss at initialisation is ln V), got {self.diverge_factor}",
            )
        if self.max_steps > MAX_STEPS:  # each step's windows are drawn up front (experiments.data)
            raise ConfigError("max_steps", f"must be at most {MAX_STEPS:,}, got {self.max_steps:,}")
        if not 0 < self.min_lr <= self.max_lr:
            raise ConfigError("min_lr", f"must be in (0, max_lr={self.max_lr}], got {self.min_lr}")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ConfigError(
                "warmup_steps", f"must be in [0, max_steps={self.max_steps}), got {self.warmup_steps}"
            )
        if self.val_tokens < self.seq_len + 1:
            raise ConfigError("val_tokens", f"must be at least seq_len + 1 = {self.seq_len + 1}")
        if self.micro_batch:
            self._derive_grad_accum()
        if self.grad_sync == "micro_batch" and self.strategy != "fsdp":
            raise ConfigError(
                "grad_sync", "micro_batch needs strategy fsdp (DDP reduces the gradients once a step)"
            )
        if self.batch_size % (parts := self.world_size * self.grad_accum):
            raise ConfigError(
                "batch_size",
                f"the global batch {self.batch_size} does not split into train.devices x num_nodes x "
                f"grad_accum = {self.devices} x {self.num_nodes} x {self.grad_accum} = {parts} equal batches",
            )
