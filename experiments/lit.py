"""The LightningModule: next-token loss, AdamW, warmup + cosine decay, per-domain validation PPL."""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl
import torch
from torch import nn

from experiments import names as N
from experiments.config import RunConfig, TrainConfig
from experiments.devices import autocast_dtype, rng_state, scoring_precision, set_rng_state
from experiments.init_stats import init_statistics
from experiments.loss import next_token_loss
from experiments.meta_init import record_build
from experiments.model import GatedLM, count_active_parameters, count_parameters
from experiments.moe import (
    MoEFFN,
    RouterStats,
    auxiliary_loss,
    carry_balance,
    choose_experts_path,
    mean_load_cv,
    router_stats,
)
from experiments.probes import ProbeResult, run_probes
from experiments.sharding import checkpoint_blocks, clip_sharded_grad_norm, is_sharded, shard_model
from experiments.stability import DeferredChecks, SpikeDetector, divergence_bound

INIT_PROBE_SEQS = 8  # probe sequences the step-0 gate statistics read


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate at optimiser step ``step`` (0-based), Section 2.2.

    Linear warmup to ``max_lr`` over ``warmup_steps`` (step 0 already takes a warm-up step's
    share, so no step is wasted at LR 0), then cosine decay to ``min_lr`` at ``max_steps``.
    """
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.max_lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


class LMModule(pl.LightningModule):
    """Trains :class:`GatedLM` on next-token prediction.

    Logs ``train/loss``, ``train/lr``, ``train/grad_norm`` (before clipping) and
    ``train/tokens_per_s`` every ``train.log_every`` steps, and for a MoE model
    ``train/lb_loss`` and ``train/z_loss`` (means over layers, before their coefficients; the
    training loss adds them, see :func:`experiments.moe.auxiliary_loss`) and ``moe/load_cv``
    (mean over layers of the expert load's coefficient of variation); after each validation,
    ``val/ppl/<domain>``, ``val/ppl/avg`` (the mean of the domain PPLs, the paper's "Avg PPL")
    and ``val/loss`` (token-weighted mean NLL in nats). The last validation's figures stay in
    ``self.last_val``.

    Steps: a metric's MLflow step is the number of optimiser updates the measured weights have
    had. ``train/loss`` at step k is the loss of the weights after k updates (on the batch of the
    next one); a validation or probe after k updates is at step k, the last at ``train.max_steps``.

    Every step's loss is checked (:class:`~experiments.stability.DeferredChecks`): a loss spike
    (``experiments.stability``) is logged as ``stability/spike`` (value: the loss, step: the
    step); a diverged loss or a non-finite gradient norm raises
    :class:`~experiments.stability.Diverged`. The figures stay on the device between checks, read
    together every ``train.log_every`` steps (no host sync in between): at ``log_every: 1`` a
    diverged loss raises before its backward pass and a non-finite gradient before its optimiser
    step; with larger values a non-finite gradient's update is skipped on the device and the
    divergence raised at the next check. With ``probe_tokens`` and
    ``train.probe_every`` > 0, the probes of ``experiments.probes`` run after every
    ``probe_every``-th validation and log beside its ``val/*`` metrics (same step), except at the
    last step, which the sweep probes once after training. With ``train.compile`` the loss (model
    and cross-entropy) is one ``torch.compile``d graph in training and validation; the probes
    and scores run the eager model.

    Under data parallelism (DDP ranks under torchrun, ``sweep.run.ranks``) the training figures are the global
    batch's (losses averaged over the ranks where they are read, at the checks: one all-reduce of
    the figures queued since the last, no barrier and no host read in between; so every rank
    takes the same divergence decision, and ``train/loss`` is logged at the checks' steps, where
    Lightning writes it; tokens/s of all ranks; with ``train.grad_accum`` micro-batches a step,
    the means over them), every rank validates and probes the same held-out windows (no
    collective: a MoE forward all-reduces in training only), and rank 0 alone logs.

    Under ``train.strategy: fsdp`` the model is built on the meta device and :meth:`configure_model`
    shards it (``experiments.sharding``): each rank holds its shards of the weights a one-process
    run starts from. Every forward of the harness goes through the root module (validation,
    probes) or gathers a block's weights first (the step-0 statistics), on every rank.

    Args:
        cfg: the run configuration.
        domains: validation domain names, in the order of the validation dataloaders.
        probe_tokens: (N, T) the probe batch, or None.
    """

    def __init__(self, cfg: RunConfig, domains: list[str], probe_tokens: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg, self.domains = cfg, list(domains)
        sharded = cfg.train.strategy == "fsdp"
        #: Under FSDP, until configure_model: the generator state a CPU build would start from,
        #: and how that build initialises each parameter (experiments.meta_init).
        self._init_rng = self._init_plan = None
        if sharded:
            self._init_rng = torch.get_rng_state()
            self.model, self._init_plan = record_build(lambda: GatedLM(cfg.model))
        else:
            self.model, self._init_plan = GatedLM(cfg.model), None
            if cfg.train.activation_checkpointing:
                checkpoint_blocks(self.model)
        #: A finished run's weights to start from (Training.start_from), loaded once sharded.
        self.start_weights: dict[str, torch.Tensor] | None = None
        self.probe_tokens = probe_tokens
        self.spikes = SpikeDetector(cfg.train.spike_window, cfg.train.spike_z)
        self.diverge_bound = divergence_bound(cfg.model.vocab_size, cfg.train.diverge_factor)
        self.checks = DeferredChecks(self.spikes, self.diverge_bound)
        #: Moving average (weight 0.9 on the past) of the training losses read so far, for progress lines.
        self.loss_ema: float | None = None
        #: Seconds of this fit's first step (with ``train.compile``, mostly compiling); None before it.
        self.first_step_seconds: float | None = None
        if cfg.train.compile:  # dynamo caches on next_token_loss's code: 8 graphs, then eager for good
            torch._dynamo.reset()  # so a worker's fifth model would run eager; one cell at a time
        # Under FSDP each block is compiled instead (experiments.sharding).
        self._compiled = torch.compile(next_token_loss) if cfg.train.compile and not sharded else None
        self.validations = 0
        self.n_params = count_parameters(self.model)
        self.n_active_params = count_active_parameters(self.model)
        self.last_val: dict[str, float] = {}
        self.last_val_step = -1
        self._nll_sum = torch.zeros(len(self.domains), dtype=torch.float64)
        self._tok_count = torch.zeros(len(self.domains), dtype=torch.float64)
        self._val_nll: list[list[torch.Tensor]] = []  # per domain, each batch's summed NLL on the device
        self._step_clock = 0.0
        self._window: tuple[float, int] | None = None  # (clock, steps) since the last check
        self._pending: dict[str, torch.Tensor] = {}  # the optimiser step's figures so far
        #: (step, this rank's figures) not yet averaged over the ranks (:meth:`_reduce_queued`).
        self._queued: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._resumed_rng: dict | None = None

    def configure_model(self) -> None:
        """Under ``train.strategy: fsdp``, once: shard the meta-device model over the ranks and
        initialise each rank's shards as one process's build would be (``experiments.sharding``),
        then load :attr:`start_weights` if set. Nothing for another strategy (its model exists)."""
        if self._init_plan is None:
            return
        t = self.cfg.train
        if t.activation_checkpointing:
            checkpoint_blocks(self.model)
        device, mesh = self.trainer.strategy.root_device, self.device_mesh["data_parallel"]
        shard_model(
            self.model, mesh, self.trainer.precision, self._init_plan, self._init_rng, device, t.compile
        )
        self._init_plan = None
        if self.start_weights is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            # rank 0 read the file; the others get their shards from it
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, self.start_weights, options=options)
            self.start_weights = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, V) logits."""
        return self.model(tokens)

    def loss(self, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Next-token cross-entropy (nats) of (B, T + 1) token windows: mean, or ``sum`` over tokens;
        compiled with ``train.compile``, ``train.loss_chunk`` tokens at a time when set
        (:func:`experiments.loss.next_token_loss`)."""
        return (self._compiled or next_token_loss)(self.model, batch, reduction, self.cfg.train.loss_chunk)

    def auxiliary(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[RouterStats]] | None:
        """The MoE router losses of the last forward (:func:`~experiments.moe.auxiliary_loss`:
        total, load-balancing and z-loss means) and the layers' statistics; None for a dense model."""
        stats = router_stats(self.model)
        if not stats:
            return None
        world = self.trainer.world_size if self._trainer is not None else self.cfg.train.world_size
        return (*auxiliary_loss(stats, self.cfg.model.moe, world), stats)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        accum = self.trainer.accumulate_grad_batches
        carry_balance(self.model, batch_idx % accum > 0)  # the step's global-batch f (moe.py)
        loss = self.loss(batch)
        aux = self.auxiliary()
        figures = (
            {N.TRAIN_LOSS: loss}
            if aux is None
            else {N.TRAIN_LOSS: loss, N.TRAIN_LB_LOSS: aux[1], N.TRAIN_Z_LOSS: aux[2]}
        )
        step = self._step_means(figures, batch_idx)
        if step is not None:  # the step's last micro-batch: this rank's means over its micro-batches
            self._step_lr = self.lr_schedulers().get_last_lr()[0]  # Lightning steps it before batch end
            self._queued.append((self.global_step, step))
            due = self.check_due()  # where Lightning logs: the global batch's figures, every rank
            means = self._reduce_queued() if due or self.trainer.world_size == 1 else None
            if due:  # every rank reads the same values: all stop together
                self._check()
            for name, mean in (means or {}).items():
                self.log(name, mean, on_step=True, logger=True)
            if aux is not None:
                self.log(N.MOE_LOAD_CV, mean_load_cv(aux[3]), on_step=True, logger=True)
        return loss if aux is None else loss + aux[0]

    def check_due(self) -> bool:
        """Whether this optimiser step reads the queued figures: the last of every
        ``train.log_every`` steps (where Lightning logs), and the last step."""
        step = self.global_step + 1
        return step % self.cfg.train.log_every == 0 or step >= self.cfg.train.max_steps

    def _check(self, strict: bool = True) -> None:
        """Average the queued figures over the ranks, read and check them
        (:class:`~experiments.stability.DeferredChecks`), log the spikes among them at their steps,
        and update :attr:`loss_ema`."""
        self._reduce_queued()
        seen = len(self.spikes.spikes)
        try:
            for _, value in self.checks.check(strict):
                self.loss_ema = value if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * value
        finally:  # the spikes before a divergence are data too
            for spike_step, value in self.spikes.spikes[seen:]:
                self._log_at_step({N.SPIKE: value}, spike_step)

    def check_now(self) -> None:
        """Read and check every queued figure now (the checkpoint callbacks call it before they
        flush the logger, so a checkpoint never holds a spike the store lacks).

        Raises:
            experiments.stability.Diverged: a queued loss or gradient norm diverged.
        """
        self._check()

    def flush_checks(self) -> None:
        """Feed every figure still queued to the spike detector, without raising (a fit that
        ended by an exception: its spikes so far are data). Figures of several ranks not yet
        averaged are dropped: averaging is a collective, which ranks that stopped apart never join."""
        self._queued = []
        self._check(strict=False)

    def _step_means(self, figures: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor] | None:
        """Add a micro-batch's 0-d ``figures`` to its optimiser step's; at the step's last
        micro-batch, this rank's means over the step's micro-batches, else None. With one
        micro-batch a step, the figures themselves. No collective: :meth:`_reduce_queued`."""
        accum = self.trainer.accumulate_grad_batches
        for name, v in figures.items():
            self._pending[name] = self._pending.get(name, 0.0) + v.detach() / accum
        if (batch_idx + 1) % accum:
            return None
        step, self._pending = self._pending, {}
        return step

    def _reduce_queued(self) -> dict[str, torch.Tensor] | None:
        """The queued steps' figures as the global batch's (each rank holds an equal share of it,
        so the mean of the ranks' means), each step's loss queued for the checks; returns the
        last step's, None when none was queued. Several ranks: one all-reduce of all of them,
        stacked, with no barrier (Lightning's ``strategy.reduce`` runs one before each
        all-reduce, which under NCCL waits for the GPU), every ``train.log_every`` steps."""
        if not self._queued:
            return None
        queued, self._queued = self._queued, []
        world = self.trainer.world_size
        if world > 1:
            stacked = torch.stack([v for _, figures in queued for v in figures.values()])
            torch.distributed.all_reduce(stacked)
            means = iter((stacked / world).unbind())
            queued = [(step, {name: next(means) for name in figures}) for step, figures in queued]
        for step, figures in queued:
            self.checks.add_loss(step, figures[N.TRAIN_LOSS])
        return queued[-1][1]

    def on_fit_start(self) -> None:
        """Log the gate's statistics at initialisation (``experiments.init_stats``) at step 0, on
        the first :data:`INIT_PROBE_SEQS` probe sequences; a resumed fit has logged them already."""
        dtype = autocast_dtype(self.trainer.precision) or torch.float32
        for m in self.model.modules():  # before any compiled forward: the path is fixed in the graph
            if isinstance(m, MoEFFN) and m.experts_path is None:
                choose_experts_path(m, self.device, dtype)
        slow = [p for p in self.experts_paths() if p.startswith("looped") or "fallback" in p]
        if slow and self.trainer.is_global_zero:  # slower, never silent (and the run's moe_experts tag)
            print(f"note: the MoE experts run one expert at a time ({slow[0]})", flush=True)
        # Rank 0's logger decides for all: every rank must take a sharded model's forward.
        wanted = self.trainer.strategy.broadcast(self.logger is not None)
        if self.global_step == 0 and self.probe_tokens is not None and wanted:
            tokens = self.probe_tokens[:INIT_PROBE_SEQS].to(self.device)
            with scoring_precision(self.device, str(self.trainer.precision)):  # every rank: MoE all-reduces
                stats = init_statistics(self.model, tokens)
            if stats:
                self._log_at_step(stats)

    def experts_paths(self) -> list[str]:
        """How the MoE layers' experts ran (``grouped_mm``, or ``looped: <why>``); [] for a dense model."""
        layers = [m for m in self.model.modules() if isinstance(m, MoEFFN)]
        return sorted({m.experts_path for m in layers if m.experts_path})

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self._resumed_rng is not None:  # the state saved at the start of this same step
            set_rng_state(self._resumed_rng)
            self._resumed_rng = None
        if batch_idx % self.trainer.accumulate_grad_batches == 0:  # a step's first micro-batch
            self._pending = {}
            self._step_clock = time.perf_counter()
            if self._window is None:  # per window of steps, so validation time is never counted
                self._window = (self._step_clock, 0)

    def on_train_batch_end(self, outputs, batch: torch.Tensor, batch_idx: int) -> None:
        accum = self.trainer.accumulate_grad_batches
        if (batch_idx + 1) % accum:
            return
        step = self.global_step - 1  # the optimiser step just taken
        if self.first_step_seconds is None:
            self.first_step_seconds = time.perf_counter() - self._step_clock
        start, steps = self._window
        self._window = (start, steps + 1)
        if not (step + 1) % self.cfg.train.log_every or step + 1 >= self.cfg.train.max_steps:
            if self.device.type == "cuda":  # the clock after the queued kernels, once a window
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            tokens = batch[:, 1:].numel() * self.trainer.world_size * accum * (steps + 1)  # global batches
            speed = tokens / max(seconds, 1e-9)
            self._log_at_step({N.TRAIN_LR: self._step_lr, N.TRAIN_TOKENS_PER_S: speed}, step)
            self._window = None

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, *args: object, **kwargs: object
    ) -> None:
        """Clip the gradients' global norm at ``train.grad_clip`` (0: no clipping) and log the norm
        before clipping: one pass over the gradients computes both (the trainer clips nothing).
        A fused AdamW skips its update on the device when the norm is not finite (its
        ``found_inf``, as AMP's grad scaler sets it), so no check has to wait for the GPU."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if is_sharded(self.model):  # each rank holds a shard: the norm over all of them
            grad_norm = clip_sharded_grad_norm(params, self.cfg.train.grad_clip or math.inf)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip or math.inf)
        inner = getattr(optimizer, "_optimizer", optimizer)
        fused = bool(inner.defaults.get("fused"))  # fp16's grad scaler sets found_inf itself:
        skips_on_device = fused and str(self.trainer.precision) not in ("16-mixed", "16")
        if skips_on_device:  # (fp16 is never auto's choice)
            inner.found_inf = (~torch.isfinite(grad_norm)).float()
        self.checks.add_grad_norm(self.global_step, grad_norm)
        if not skips_on_device or self.check_due():  # the step would write non-finite weights
            self._check()
        self.log(N.TRAIN_GRAD_NORM, grad_norm, on_step=True, logger=True)

    def on_validation_epoch_start(self) -> None:
        self._check()  # the figures of the steps before this validation, in step order
        self._window = None  # a tokens/s window never spans a validation
        self._nll_sum.zero_()
        self._tok_count.zero_()
        self._val_nll = [[] for _ in self.domains]

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._val_nll[dataloader_idx].append(self.loss(batch, reduction="sum").detach())
        self._tok_count[dataloader_idx] += batch[:, 1:].numel()

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        for d, sums in enumerate(self._val_nll):  # one read of the device; summed in float64 in order
            for value in torch.stack(sums).tolist() if sums else []:
                self._nll_sum[d] += value
        mean_nll = self._nll_sum / self._tok_count.clamp(min=1)
        ppl = {d: math.exp(v) for d, v in zip(self.domains, mean_nll.tolist())}
        figures = {N.val_ppl(d): p for d, p in ppl.items()}
        figures[N.VAL_PPL_AVG] = sum(ppl.values()) / len(ppl)
        figures[N.VAL_LOSS] = float(self._nll_sum.sum() / self._tok_count.sum())
        self.last_val, self.last_val_step = figures, self.global_step
        # At the optimiser steps taken (Lightning's own step for a validation inside fit is one
        # lower, outside it not), so every validation and probe of the weights after k steps is
        # at step k, as train/loss at step k is the loss of those same weights.
        self._log_at_step(figures)
        self.validations += 1
        every = self.cfg.train.probe_every
        last = self.global_step >= self.cfg.train.max_steps
        if every and self.validations % every == 0 and self.probe_tokens is not None and not last:
            self._log_at_step(self.probe().metrics())

    def _log_at_step(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log ``metrics`` at ``step`` (default: the optimiser steps taken), from rank 0 only
        (every rank computed them)."""
        if self.logger is not None and self.trainer.is_global_zero:
            self.logger.log_metrics(metrics, step=self.global_step if step is None else step)

    def probe(self) -> ProbeResult:
        """Run the probes on the probe batch (see ``experiments.probes``), under
        :func:`~experiments.devices.scoring_precision` on the model's device."""
        precision = str(self.trainer.precision) if self._trainer is not None else self.cfg.train.precision
        with scoring_precision(self.device, precision):
            return run_probes(self.model, self.probe_tokens, seed=self.cfg.seed)

    def on_train_end(self) -> None:
        self._check()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self._check()  # the spike window and the divergence verdict as of this step
        checkpoint["stability"] = self.spikes.state_dict()
        checkpoint["validations"] = self.validations
        checkpoint["last_val"] = {"figures": dict(self.last_val), "step": self.last_val_step}
        checkpoint["rng"] = rng_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "stability" in checkpoint:
            self.spikes.load_state_dict(checkpoint["stability"])
            self.validations = checkpoint["validations"]
        if "last_val" in checkpoint:
            self.last_val = dict(checkpoint["last_val"]["figures"])
            self.last_val_step = checkpoint["last_val"]["step"]
        if "rng" in checkpoint:  # set at the first step: creating the loaders draws from it
            self._resumed_rng = checkpoint["rng"]

    def configure_optimizers(self):
        t = self.cfg.train
        optimizer = adamw(self.model, t)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, t) / t.max_lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def adamw(model: nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW at ``max_lr`` (Section 2.2) with weight decay on the projection, expert and embedding
    matrices only; norm gains and static gate logits get none. The fused kernel where the
    parameters' device has one (CPU, CUDA): it pays on a GPU; on this project's CPU, one thread,
    fused, foreach and the plain loop took the same 12-13 ms a step on the tiny MoE's 10.3M
    parameters."""
    matrices = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    for m in model.modules():
        if isinstance(m, MoEFFN):
            matrices |= {id(m.w_gate_up), id(m.w_down)}
    decay = [p for p in model.parameters() if id(p) in matrices]
    no_decay = [p for p in model.parameters() if id(p) not in matrices]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in model.parameters())
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.max_lr,
        betas=(t.beta1, t.beta2),
        fused=fused or None,
    )
