"""The training recipe: a :class:`RunConfig` in, a trained and probed model out.

:class:`Training` builds, in a fixed order (the seed first, so a config always gives the same
run), the data module, the fixed probe batch, the :class:`LMModule` and the Lightning ``Trainer``
with the devices, nodes and strategy the config names. ``fit``, ``finish``, ``save_weights`` and
``probe`` take it to the end. Where the metrics go (MLflow, nowhere) and which callbacks watch the
run are the caller's choice::

    run = Training(cfg)              # logger=False: nothing logged
    run.fit()
    final = run.finish()             # {"val/ppl/avg": ..., "val/ppl/<domain>": ..., "val/loss": ...}
    probes = run.probe()             # experiments.probes.ProbeResult
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from experiments import names as N
from experiments.checkpointing import AtomicCheckpointIO, PeriodicCheckpoint, load_weights
from experiments.config import RunConfig, TrainConfig
from experiments.data import CorpusDataModule
from experiments.devices import auto_precision
from experiments.lit import LMModule
from experiments.probes import ProbeResult, probe_batch


def lightning_strategy(t: TrainConfig) -> str | pl.strategies.Strategy:
    """Lightning's strategy for ``t.strategy``: ``auto`` and ``ddp`` by name; ``fsdp`` as the paper
    scale needs it, Lightning's ``ModelParallelStrategy`` with FSDP2 over all ``t.world_size``
    ranks (:class:`experiments.sharding.ShardedStrategy`): every :class:`~experiments.model.Block`
    one unit, parameters, gradients and AdamW state split over the ranks (15.6B parameters x 16
    bytes over 128 GPUs is 1.9 GB each), the training state saved as a folder of shards, the final
    weights gathered whole on rank 0 (the file one process writes). It runs on CPU ranks (gloo) too."""
    if t.strategy != "fsdp":
        return t.strategy
    from experiments.sharding import ShardedStrategy

    return ShardedStrategy(t.world_size, defer_grad_sync=t.grad_sync == "step")


def build_trainer(t: TrainConfig, logger: Any = False, callbacks: Sequence[pl.Callback] = ()) -> pl.Trainer:
    """The Lightning ``Trainer`` of a run: ``t.max_steps`` steps on ``t.devices`` x ``t.num_nodes``
    devices with ``t.strategy``, validating every ``t.val_every`` steps, crash-safe checkpoint
    files, no progress bar (the caller prints its own). ``LMModule`` clips the gradients itself.

    The data module shards each global batch over the processes itself (``ResumingSampler``), so
    Lightning's distributed sampler is off; each process takes ``t.grad_accum`` micro-batches of
    ``t.device_batch`` sequences per optimiser step.
    """
    return pl.Trainer(
        accelerator="auto",
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=lightning_strategy(t),
        max_steps=t.max_steps,
        accumulate_grad_batches=t.grad_accum,
        precision=auto_precision(t.precision),
        val_check_interval=min(t.val_every, t.max_steps) * t.grad_accum,  # Lightning counts micro-batches
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every,
        logger=logger,
        callbacks=list(callbacks),
        enable_checkpointing=False,  # PeriodicCheckpoint instead of ModelCheckpoint
        plugins=[AtomicCheckpointIO()],
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


class Training:
    """One run of ``cfg``: data, probe batch, module and trainer, ready to ``fit``.

    Args:
        cfg: the run configuration.
        cache_root: the corpus cache (default ``experiments.corpus.default_cache_root()``).
        logger: a Lightning logger, or False for none.
        callbacks: extra Lightning callbacks (progress, pruning, interrupts).
        checkpoints: the folder of the periodic ``step<N>.ckpt`` files
            (``experiments.checkpointing``); None (or ``train.checkpoint_every: 0``) saves none.

    Raises:
        experiments.corpus.CorpusError: the corpus cannot be built.
    """

    def __init__(
        self,
        cfg: RunConfig,
        cache_root: Path | None = None,
        logger: Any = False,
        callbacks: Sequence[pl.Callback] = (),
        checkpoints: Path | None = None,
    ) -> None:
        self.cfg = cfg
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        self.datamodule = CorpusDataModule(cfg.data, cfg.train, cfg.seed, cache_root)
        self.datamodule.setup()
        #: (N, T) tokens and their record (split, windows per domain, sha256).
        self.probe_tokens, self.probe_record = probe_batch(
            self.datamodule.corpus, cfg.train.seq_len, cfg.train.probe_seqs
        )
        self.module = LMModule(cfg, self.datamodule.domains, self.probe_tokens)
        callbacks = list(callbacks)
        if checkpoints is not None and cfg.train.checkpoint_every:
            callbacks.append(PeriodicCheckpoint(checkpoints, cfg.train.checkpoint_every))
        self.trainer = build_trainer(cfg.train, logger, callbacks)

    def start_from(self, weights: Path) -> None:
        """Start from the weights of a finished run (a later training stage, Table 5's continued
        long-context training): ``weights`` is a :meth:`save_weights` file whose model has the
        same parameter shapes. Only the weights carry over; the optimiser, the LR schedule and the
        step count start afresh. Call before :meth:`fit` (a resumed fit then restores its own).

        Under FSDP rank 0 reads the file and every rank takes its shards of it once the model is
        sharded (``LMModule.configure_model``).

        Raises:
            FileNotFoundError: no such file.
            experiments.checkpointing.CheckpointDamaged: its bytes are not the ones written.
            RuntimeError: the weights do not fit this model (torch's ``load_state_dict``).
        """
        if self.cfg.train.strategy != "fsdp":
            self.module.load_state_dict(load_weights(weights))
            return
        state = load_weights(weights) if self.trainer.global_rank == 0 else {}
        self.module.start_weights = {k.removeprefix("model."): v for k, v in state.items()}

    def fit(self, resume_from: Path | None = None) -> None:
        """Train to ``train.max_steps``, from step 0 or from a ``step<N>.ckpt`` training state.

        Raises:
            experiments.stability.Diverged: the loss or the gradient diverged (read at the next check,
                every ``train.log_every`` steps: at 1, before any step was taken on it; a
                non-finite gradient's update is always skipped). The last checkpoint predates it.
        """
        self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=resume_from, weights_only=False)

    @property
    def step(self) -> int:
        """Optimiser steps taken so far."""
        return self.trainer.global_step

    @property
    def spikes(self) -> list[tuple[int, float]]:
        """(step, loss) of each loss spike so far (``experiments.stability``), the steps not yet
        checked included (a fit that ended by an exception)."""
        self.module.flush_checks()
        return list(self.module.spikes.spikes)

    def experts_paths(self) -> list[str]:
        """How the MoE layers' experts ran (``grouped_mm`` or ``looped: <why>``); [] for a dense model."""
        return self.module.experts_paths()

    def spike_rule(self) -> dict[str, float]:
        """The spike and divergence rule this run used: window, z, and the divergence bound (nats)."""
        t = self.cfg.train
        return {"window": t.spike_window, "z": t.spike_z, "diverge_bound": self.module.diverge_bound}

    def finish(self) -> dict[str, float]:
        """The final validation's figures (``val/ppl/<domain>``, ``val/ppl/avg``, ``val/loss``) and
        the parameter counts (``params/total``, ``params/active``); validates once more when the
        last in-fit validation did not fall on the last step."""
        if self.module.last_val_step != self.trainer.global_step:
            self.trainer.validate(self.module, datamodule=self.datamodule, verbose=False)
        final = dict(self.module.last_val)
        final[N.PARAMS_TOTAL] = self.module.n_params
        final[N.PARAMS_ACTIVE] = self.module.n_active_params
        return final

    def save_weights(self, path: Path) -> None:
        """The trained weights as a Lightning checkpoint (``state_dict`` under ``model.``), one
        file; under FSDP gathered whole on rank 0 (every rank must call it)."""
        full_weights = getattr(self.trainer.strategy, "full_weights", contextlib.nullcontext)
        with full_weights():
            self.trainer.save_checkpoint(path, weights_only=True)

    def probe(self) -> ProbeResult:
        """The probes of ``experiments.probes`` on the fixed probe batch, on the training device.

        Raises:
            RuntimeError: out of memory (torch reports it so), among others.
        """
        self.module.to(self.trainer.strategy.root_device)  # Lightning's teardown moved it to the CPU
        return self.module.probe()
