"""One cell into one MLflow run: the training recipe (``experiments.train``) with the harness's
logger, checkpoints and artifacts around it, in this process or on torchrun's ranks
(``sweep.run.ranks``), and :class:`StopOnRequest`, the callback that stops it saved on a signal."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import optuna
import torch

from experiments import names as N
from experiments.checkpointing import (
    FINAL_CHECKPOINT,
    latest_checkpoint,
    save_at_step_start,
    step_checkpoint_name,
)
from experiments.checksums import file_sha256
from experiments.stability import Diverged
from experiments.train import Training
from sweep.grid import Cell
from sweep.run import ranks
from sweep.run.progress import ProgressPrinter, SweepClock
from sweep.run.resume import FlushBeforeCheckpoint, ResumingMLFlowLogger
from sweep.signals import Interrupted, StopRequest
from sweep.store import Tracker, user_tracking_env


def checkpoint_dir(results_dir: Path, experiment: str, run_id: str) -> Path:
    """Where one run's checkpoints live: ``results/checkpoints/<experiment>/<run_id>/``.

    Per run, not per cell: a FORCE retrain never touches the checkpoint of the result it may
    replace."""
    return results_dir / "checkpoints" / experiment / run_id


#: How every rank of a multi-process cell stops together short of a result: returned by each
#: rank as a value (:func:`_rank`), raised again in the worker.
RANK_STOPS = (Diverged, Interrupted, optuna.TrialPruned)


def train_on_ranks(
    cell: Cell,
    tracker: Tracker,
    run_id: str,
    reference_params: int,
    progress: ProgressPrinter,
    cache_root: Path | None,
    checkpoints: Path,
    extra_callbacks: list[pl.Callback] | None = None,
    resume_from: Path | None = None,
    replayed: dict[str, int] | None = None,
    start_weights: Path | None = None,
) -> dict[str, float]:
    """Train one cell into MLflow run ``run_id``, probe it, and return its final metrics.

    Beside what :class:`~experiments.lit.LMModule` logs while training, logs ``params/total``,
    ``params/active`` and ``params/added`` (total against the row's reference at this scale,
    ``reference_params``), ``stability/loss_spikes`` with a ``stability.json`` artifact (the spike
    steps), and the probes of ``experiments.probes`` (metrics at the last step, ``probes/``
    artifacts). The training state is checkpointed every ``train.checkpoint_every`` steps into
    ``checkpoints``; a finished cell also gets ``final.ckpt`` (its weights) before probing, and the
    caller removes the step files once the result is recorded. A probe that fails (out of memory,
    say) leaves a finished run without probe metrics and a ``probe_error`` tag.

    ``extra_callbacks`` join the trainer's (the LR search's pruning callback, say); whatever they
    raise ends the cell and propagates. ``resume_from`` continues from a training checkpoint
    (``step<N>.ckpt``); ``replayed`` (metric key -> highest step already in the run) keeps the
    replayed steps from being logged twice. ``start_weights`` (a later stage's parent's
    ``final.ckpt``) are the weights a fit from step 0 starts from; a resumed fit restores its own.

    A cell of ``train.world_size`` > 1 trains in that many processes, started by torchrun
    (:func:`sweep.run.ranks.launch`, Lightning DDP; on ``train.num_nodes`` machines, the nodes of
    this worker's cluster job): rank 0 records everything above through a :class:`Tracker` of
    its own on the same store and prints the progress lines; the other ranks train, validate and
    probe with it and record nothing. ``extra_callbacks`` are left out there (they live in this
    process), except that every rank runs the ``for_ranks()`` of a callback that has one (the LR
    search's pruning, ``sweep.run.tune.RankPruningCallback``), and a :class:`StopOnRequest`
    among them is remade in each rank on the rank's own signals: once this process's request
    holds a signal torchrun gets SIGTERM and passes it on, every rank stops at one step with a
    checkpoint, and the cell ends ``killed`` as in one process.

    Raises:
        experiments.stability.Diverged: the loss diverged; the last periodic checkpoint stays.
        sweep.run.ranks.RanksFailed: a rank of a multi-process cell failed (rank 0's own error
            is raised as it is).
        optuna.TrialPruned: an LR-search trial's pruner stopped it (its callback raised it).
    """
    args = (cell, run_id, reference_params, cache_root, checkpoints, resume_from, replayed, start_weights)
    t = cell.config.train
    if t.world_size == 1:
        return train_tracked(tracker, progress, extra_callbacks or [], *args)
    for_ranks = [c.for_ranks() for c in extra_callbacks or [] if hasattr(c, "for_ranks")]
    rank_args = (tracker.uri, tracker.experiment, progress.prefix, progress.clock, for_ranks, *args)
    request = next((c.request for c in extra_callbacks or [] if isinstance(c, StopOnRequest)), None)
    try:
        result = ranks.launch(
            _rank, t.devices, *rank_args, nodes=t.num_nodes, stop=request, folder=checkpoints
        )
    except ranks.RanksFailed:
        if request is None or request.signum is None:
            raise
        # torchrun ended the ranks 30 s after the signal, before a step start stopped them (or
        # a rank's first instant): killed, not failed; it resumes from its last checkpoint
        kept = latest_checkpoint(checkpoints)
        raise Interrupted(request.signum, int(kept.stem.removeprefix("step")) if kept else 0, kept) from None
    if isinstance(result, RANK_STOPS):  # every rank stopped at one step
        raise result
    return result


def _rank(
    uri: str, experiment: str, prefix: str, clock: SweepClock, for_ranks: list[pl.Callback], *args: Any
) -> dict[str, float] | Diverged | Interrupted | optuna.TrialPruned:
    """One rank of a multi-process cell (:func:`train_on_ranks`): rank 0 tracks, the others only
    train; a divergence, a stop on a signal or a pruned trial comes back as a value, which the
    worker raises."""
    request = ranks.rank_stop()
    assert request is not None, "_rank runs in sweep.run.ranks.main"
    stop = [StopOnRequest(request, args[4]), *for_ranks]
    try:
        if int(os.environ["RANK"]) == 0:
            return train_tracked(Tracker(uri, experiment), ProgressPrinter(prefix, clock), stop, *args)
        return train_tracked(None, None, stop, *args)
    except RANK_STOPS as err:
        return err


def train_tracked(
    tracker: Tracker | None,
    progress: ProgressPrinter | None,
    extra_callbacks: list[pl.Callback],
    cell: Cell,
    run_id: str,
    reference_params: int,
    cache_root: Path | None,
    checkpoints: Path,
    resume_from: Path | None,
    replayed: dict[str, int] | None,
    start_weights: Path | None,
) -> dict[str, float]:
    """:func:`train_on_ranks` in this process; with ``tracker`` None (a rank other than 0), nothing
    is recorded, but every collective step (fit, validation, weights, probes) is taken."""
    if tracker is None:
        run = Training(cell.config, cache_root, callbacks=extra_callbacks, checkpoints=checkpoints)
        if start_weights is not None and resume_from is None:
            run.start_from(start_weights)
        run.fit(resume_from)
        final = run.finish()
        run.save_weights(checkpoints / FINAL_CHECKPOINT)
        run.probe()
        return final
    with user_tracking_env():  # Lightning's logger rewrites MLFLOW_TRACKING_URI
        logger = ResumingMLFlowLogger(
            replayed, experiment_name=tracker.experiment, tracking_uri=tracker.uri, run_id=run_id
        )
        run = Training(
            cell.config,
            cache_root,
            logger=logger,
            callbacks=[progress, FlushBeforeCheckpoint(logger), *extra_callbacks],
            checkpoints=checkpoints,
        )
        tracker.log_json(run_id, run.probe_record, "probe_batch.json")
        corpus = run.datamodule.corpus
        tracker.log_json(run_id, corpus.provenance(), "corpus.json")
        tracker.client.set_tag(run_id, N.CORPUS_TAG, corpus.manifest["recipe_hash"])
        tracker.client.set_tag(run_id, N.CORPUS_FINGERPRINT_TAG, corpus.fingerprint)
        if tokenizer := corpus.manifest["tokenizer"]["file"]:  # what export ships; a synthetic task has none
            tracker.log_files(run_id, [corpus.root / tokenizer])  # first: a tagged run has the file
            tracker.client.set_tag(run_id, N.TOKENIZER_SHA256_TAG, file_sha256(corpus.root / tokenizer))
        tracker.client.set_tag(run_id, "probe_sha256", run.probe_record["sha256"])
        tracker.client.set_tag(run_id, N.METRIC_STEPS_TAG, N.METRIC_STEPS_UPDATES)
        tracker.client.set_tag(run_id, N.PRECISION_TAG, str(run.trainer.precision))  # auto, resolved
        logged = dict(replayed or {})

        def log_once(metrics: dict[str, float], step: int) -> None:
            """A resumed run replays its end: a key already logged at ``step`` is not logged again."""
            tracker.log_metrics(run_id, {k: v for k, v in metrics.items() if logged.get(k, -1) < step}, step)

        if start_weights is not None and resume_from is None:
            run.start_from(start_weights)
        try:
            run.fit(resume_from)
        finally:  # diverged or not, the spikes seen so far are data
            if run.experts_paths():  # grouped_mm, or the loop and why (chosen at the fit's start)
                tracker.client.set_tag(run_id, N.EXPERTS_PATH_TAG, "; ".join(run.experts_paths()))
            logger.flush()
            log_once({N.LOSS_SPIKES: len(run.spikes)}, step=run.step)
            spikes = [{"step": s, "loss": v} for s, v in run.spikes]
            tracker.log_json(run_id, {"rule": run.spike_rule(), "spikes": spikes}, "stability.json")
        final = run.finish()
        logger.flush()
        final[N.PARAMS_ADDED] = final[N.PARAMS_TOTAL] - reference_params
        log_once({k: final[k] for k in (N.PARAMS_TOTAL, N.PARAMS_ACTIVE, N.PARAMS_ADDED)}, step=0)
        run.save_weights(checkpoints / FINAL_CHECKPOINT)
        tracker.client.set_tag(run_id, "checkpoint", str(checkpoints / FINAL_CHECKPOINT))
        try:
            probes = run.probe()
        except (RuntimeError, ValueError) as err:  # torch reports out-of-memory as a RuntimeError
            tracker.client.set_tag(run_id, "probe_error", f"{type(err).__name__}: {err}"[:5000])
            return final
        log_once(probes.metrics(), step=run.step)
        with tempfile.TemporaryDirectory() as tmp:
            tracker.log_files(run_id, probes.save(Path(tmp)), "probes")
        final.update(probes.summary)
        return final


class StopOnRequest(pl.Callback):
    """Before each training step: if ``request`` holds a signal, save the full training state to
    ``folder/step<N>.ckpt`` and raise :class:`Interrupted`. Under DDP every rank stops at the
    same step (any rank's signal stops all: the others would wait in the step's all-reduce): the
    ranks share the signals they hold at each check (every ``train.log_every`` steps, where the
    step reads its figures anyway) and stop at the start of the step after it.

    Args:
        request: the process's :class:`StopRequest`.
        folder: the cell's checkpoint folder.
    """

    def __init__(self, request: StopRequest, folder: Path) -> None:
        self.request, self.folder = request, folder
        self._shared = 0  # the signal any rank held at the last check (several ranks)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.request.reclaim()
        # Lightning 2.5+ broadcasts its own SIGTERM flag from rank 0 and reads it every step, a
        # host sync each under NCCL (Lightning issue 21487); with our handler back that flag is
        # never set, and the ranks share ours at the checks (on_before_optimizer_step).
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.request.reclaim()  # the final trainer.validate() registers Lightning's handler again

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        # At a step's start, as PeriodicCheckpoint: the step before has logged everything. Not
        # between a step's micro-batches: their gradients would be lost, the resume misaligned.
        if batch_idx % trainer.accumulate_grad_batches:
            return
        signum = (self.request.signum or 0) if trainer.world_size == 1 else self._shared
        if not signum:
            return
        path = self.folder / step_checkpoint_name(trainer.global_step)
        save_at_step_start(trainer, path)
        raise Interrupted(signum, trainer.global_step, path)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: object
    ) -> None:
        # Several ranks: an all-reduce and a host read, only at a check (between checks a step
        # never waits for the GPU); Lightning's strategy.reduce would add a barrier.
        if trainer.world_size > 1 and pl_module.check_due():
            seen = torch.tensor(self.request.signum or 0, device=trainer.strategy.root_device)
            torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
            self._shared = int(seen)
