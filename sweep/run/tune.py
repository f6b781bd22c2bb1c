"""Optuna learning-rate search: one study per grid row, each trial one MLflow child run.

The paper claims SDPA gating trains stably at larger learning rates (Table 2 rows 5-14). A study
samples ``train.max_lr`` log-uniformly with a seeded TPE sampler, or walks a fixed ladder with
the grid sampler; its objective is the final validation Avg PPL (lower is better).

- **Pruning by step**: :class:`StepPruningCallback` reports ``val/loss`` at the trainer's global
  step after every validation, so a single-epoch LM run reports several times (Optuna's
  Lightning callback reports per epoch and never prunes here); a median pruner decides, from
  the third trial on and never in the first third of training. A ladder never prunes
  (:func:`make_pruner`): it exists to measure every rung, the stability ladder of
  ``make stability`` included, and a pruned rung has no final loss. A trial of several
  processes is pruned the same way (:class:`RankPruningCallback`).
- **Divergence is data**: a diverged trial is recorded as PRUNED with the user attribute
  ``diverged`` (its reason), and the study goes on. Other errors mark the trial FAIL and the
  study goes on too.
- **Storage**: ``results/optuna.db`` (SQLite, one machine) unless ``STORAGE`` names a PostgreSQL
  or MySQL URL that many workers share. A rerun continues the study: only the trials still
  missing from the budget run, and a study whose row's config has changed since is refused. A
  heartbeat fails the trials of dead workers and retries them once.
- **MLflow**: experiment ``<grid>-<scale>-lr``; one parent run per study (tag ``kind=study``),
  one child per trial (tag ``mlflow.parentRunId``, ``trial``, ``trial_state``); the parent gets
  ``best/max_lr`` and ``best/avg_ppl``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from pathlib import Path

import lightning.pytorch as pl
import optuna
from optuna.trial import TrialState

from experiments import names as N
from experiments.checkpointing import drop_step_checkpoints
from experiments.names import Kind, Status, TrialOutcome
from experiments.stability import Diverged
from sweep.grid import Cell, Grid, Row, run_key
from sweep.passwords import hide_password
from sweep.run.cell import StopOnRequest, checkpoint_dir, train_on_ranks
from sweep.run.ladder import COUNTED, enqueue_rungs, unvisited
from sweep.run.progress import ProgressPrinter, SweepClock
from sweep.run.quiet import pin_threads, quiet_lightning
from sweep.run.sysmetrics import system_metrics
from sweep.signals import Interrupted, StopRequest
from sweep.store import Tracker
from sweep.store_urls import tracking_uri
from sweep.studies import (
    DIVERGED_ATTR,
    ROW_KEY_ATTR,
    STOPPED_ATTR,
    STUDY_UID_ATTR,
    SURPLUS_ATTR,
    VAL_LOSS_ATTR,
    make_storage,
    storage_url,
    trial_outcome,
)


class StepPruningCallback(pl.Callback):
    """Reports the validation loss to ``trial`` at ``trainer.global_step`` after each validation
    and raises :class:`optuna.TrialPruned` when the pruner says so, except at the last step: a
    trial that has trained to the end is kept.

    Args:
        trial: the running trial.
        monitor: the key of ``LMModule.last_val`` to report (default ``val/loss``, nats).
        storage: the study's RDB storage URL, for :meth:`for_ranks`.
    """

    def __init__(
        self, trial: optuna.Trial | None, monitor: str = N.VAL_LOSS, storage: str | None = None
    ) -> None:
        self.trial, self.monitor, self.storage = trial, monitor, storage
        self.reported: list[int] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in pl_module.last_val:
            return
        step = trainer.global_step
        if step in self.reported:  # the post-fit validation repeats the last step
            return
        self.reported.append(step)
        if self._prune(trainer, pl_module.last_val[self.monitor], step):
            raise optuna.TrialPruned(f"pruned at step {step}")

    def _prune(self, trainer: pl.Trainer, value: float, step: int) -> bool:
        self.trial.report(value, step)
        return step < trainer.max_steps and self.trial.should_prune()  # a finished run is kept

    def for_ranks(self) -> RankPruningCallback:
        """This callback for the ranks of a multi-process trial (``sweep.run.cell.train_on_ranks``
        passes it on), reaching the study through its RDB storage URL (``storage``).

        Raises:
            ValueError: made without ``storage``."""
        if self.storage is None:
            raise ValueError("a trial of several processes is pruned through its study's storage URL")
        study = self.trial.study
        # Optuna's Trial(study, trial_id) needs the storage's id, which Trial keeps private.
        trial_id = self.trial._trial_id
        return RankPruningCallback(self.storage, study.study_name, study.pruner, trial_id, self.monitor)


class RankPruningCallback(StepPruningCallback):
    """:class:`StepPruningCallback` on every rank of a trial trained in several processes: it
    pickles (the storage URL, the study's name and pruner, the trial's id), global rank 0 opens
    the trial in the storage, reports and asks the pruner, and every rank gets its answer (a
    broadcast), so all stop at one step and the trial ends pruned as in one process.
    """

    def __init__(
        self, url: str, study: str, pruner: optuna.pruners.BasePruner, trial_id: int, monitor: str
    ) -> None:
        super().__init__(None, monitor, url)
        self.study, self.pruner, self.trial_id = study, pruner, trial_id

    def _prune(self, trainer: pl.Trainer, value: float, step: int) -> bool:
        prune = False
        if trainer.is_global_zero:
            if self.trial is None:
                storage = make_storage(self.storage)
                study = optuna.load_study(study_name=self.study, storage=storage, pruner=self.pruner)
                self.trial = optuna.Trial(study, self.trial_id)
            prune = super()._prune(trainer, value, step)
        return bool(trainer.strategy.broadcast(prune))


def study_name(grid: Grid, scale: str, row: Row, ladder: bool = False) -> str:
    """``<grid>-<scale>-<row>``, e.g. ``table1-tiny-baseline``; ``-ladder`` appended for a fixed
    ladder (another sampler, so another study)."""
    return f"{grid.name}-{scale}-{row.id}" + ("-ladder" if ladder else "")


def trial_cell(grid: Grid, scale: str, row: Row, lr: float, seed: int = 0) -> Cell:
    """The row's cell with ``train.max_lr = lr`` (``min_lr`` lowered to ``lr`` if above it)."""
    cfg = grid.resolve(scale, row, seed)
    train = dataclasses.replace(cfg.train, max_lr=lr, min_lr=min(cfg.train.min_lr, lr))
    cfg = dataclasses.replace(cfg, train=train)
    return Cell(grid.name, scale, row, seed, cfg, run_key(cfg))


def make_pruner(ladder: list[float] | None, max_steps: int) -> optuna.pruners.BasePruner:
    """The study's pruner: none for a fixed ladder (every rung trains to the end or diverges, so
    each has a final loss), else a median pruner that decides from the third trial on and never in
    the first third of ``max_steps`` (early losses mostly reflect the warmup ramp)."""
    if ladder:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=max_steps // 3)


def _sampler(ladder: list[float] | None, seed: int) -> optuna.samplers.BaseSampler:
    # A ladder's rungs are enqueued (:func:`sweep.run.ladder.enqueue_rungs`), so its sampler is never asked.
    # Optuna's GridSampler counts a failed trial's point as visited and stops the study once
    # every point was tried, so a rung whose trial a Ctrl-C failed was never trained again.
    return optuna.samplers.RandomSampler(seed=seed) if ladder else optuna.samplers.TPESampler(seed=seed)


def tune_row(
    grid: Grid,
    scale: str,
    row: Row,
    trials: int,
    results_dir: Path,
    storage: str | None = None,
    lr_range: tuple[float, float] = (1e-4, 1e-2),
    ladder: list[float] | None = None,
    cache_root: Path | None = None,
    out=print,
    stop: StopRequest | None = None,
) -> optuna.Study:
    """Run (or continue) the row's study until ``trials`` trials are complete or pruned.

    ``stop`` (armed by the caller) is the sweep's Ctrl-C / SIGTERM: a trial that gets it saves its
    step, is failed cleanly in Optuna (failed trials do not count, so a rerun completes the budget)
    and ``killed`` in MLflow, and the search ends with ``KeyboardInterrupt``.

    Returns:
        The study.

    Raises:
        ValueError: the study holds trials of another config of the row (the grid or its corpus
            changed since), or of another ladder.
    """
    quiet_lightning()
    pin_threads()
    name = study_name(grid, scale, row, ladder=bool(ladder))
    url = storage_url(results_dir, storage)
    shown = hide_password(url)
    config = grid.resolve(scale, row, 0)
    study = optuna.create_study(
        study_name=name,
        storage=make_storage(url),
        pruner=make_pruner(ladder, config.train.max_steps),
        direction="minimize",
        load_if_exists=True,
    )
    recorded = study.user_attrs.get(ROW_KEY_ATTR)
    if recorded is None:
        study.set_user_attr(ROW_KEY_ATTR, run_key(config))
        study.set_user_attr(STUDY_UID_ATTR, uuid.uuid4().hex)  # a study made anew under an old name
    elif recorded != run_key(config):  # a rerun would mix trials of two recipes in one study
        raise ValueError(
            f"study {name} holds trials of another config of row '{row.id}' (the grid or its corpus "
            f"changed); remove it with: optuna delete-study --study-name {name} --storage {shown}"
        )
    tracker = Tracker(tracking_uri(results_dir), f"{grid.name}-{scale}-lr", results_dir / "mlartifacts")
    uid = study.user_attrs.get(STUDY_UID_ATTR)  # None: a study older than the attribute
    parent = tracker.named_run(
        name, {"kind": Kind.STUDY, "optuna_study": name, **({"optuna_study_uid": uid} if uid else {})}
    )
    done = len(study.get_trials(deepcopy=False, states=COUNTED))
    todo = max(0, trials - done)
    # The sampler is set once the study's size is known: a fresh study draws with seed 0
    # (reproducible), a resumed one with its trial count, so a rerun does not propose again the
    # LRs it already tried.
    study.sampler = _sampler(ladder, seed=len(study.get_trials(deepcopy=False)))
    if ladder:
        todo = min(todo, len(unvisited(study, ladder)))
        enqueue_rungs(study, ladder)
    out(f"study {name}: {done} of {trials} trials done, {todo} to run; storage {shown}")
    clock = SweepClock(todo)

    def objective(trial: optuna.Trial) -> float:
        if beyond_budget(study, trial.number, trials):
            trial.set_user_attr(SURPLUS_ATTR, True)
            study.stop()
            out(f"[{name} #{trial.number}] not run: the other workers took the last of the {trials} trials")
            raise SurplusTrial(trial.number)
        lr = (
            trial.suggest_float("max_lr", *lr_range, log=True)
            if not ladder
            else trial.suggest_categorical("max_lr", ladder)
        )
        cell = trial_cell(grid, scale, row, lr)
        child = tracker.start_cell(
            cell,
            extra_tags={
                "kind": Kind.TRIAL,
                "mlflow.parentRunId": parent,
                "optuna_study": name,
                "trial": str(trial.number),
            },
        )
        trial.set_user_attr("mlflow_run_id", child)
        prefix = f"[{name} #{trial.number}] lr {lr:.2e}"
        started = time.perf_counter()
        checkpoints = checkpoint_dir(results_dir, tracker.experiment, child)
        try:
            with system_metrics(tracker.uri, child):  # the trial's run, as a cell's
                final = train_on_ranks(
                    cell,
                    tracker,
                    child,
                    0,
                    ProgressPrinter(prefix, clock, out),
                    cache_root,
                    checkpoints,
                    [
                        StepPruningCallback(trial, storage=url),
                        *([StopOnRequest(stop, checkpoints)] if stop else []),
                    ],
                )
        except optuna.TrialPruned as err:
            _close(tracker, child, Status.FINISHED, TrialOutcome.PRUNED, str(err))
            drop_step_checkpoints(checkpoints)  # a pruned trial is never resumed
            out(f"{prefix} pruned: {err}")
            raise
        except Diverged as err:  # a result: the LR was too large; pruned, with the reason kept
            trial.set_user_attr(DIVERGED_ATTR, str(err))
            _close(tracker, child, Status.DIVERGED, TrialOutcome.PRUNED, str(err))
            out(f"{prefix} diverged: {err}")
            raise optuna.TrialPruned(f"diverged: {err}") from None
        except Interrupted as err:  # the search's signal: this trial fails cleanly, the search ends
            trial.set_user_attr(STOPPED_ATTR, str(err))
            _close(tracker, child, Status.KILLED, TrialOutcome.FAIL, str(err))
            drop_step_checkpoints(checkpoints)  # a trial is never resumed: its rerun is a new trial
            out(f"{prefix} stopped: {err}; the trial does not count, a rerun trains another")
            raise KeyboardInterrupt from err  # Optuna marks it FAIL and lets it through
        except BaseException as err:  # a second Ctrl-C included: Optuna marks the trial FAIL, so does MLflow
            _close(tracker, child, Status.FAILED, TrialOutcome.FAIL, f"{type(err).__name__}: {err}")
            if isinstance(err, SystemExit):  # Lightning's answer to a KeyboardInterrupt in fit: Optuna
                raise KeyboardInterrupt from err  # would leave the trial RUNNING on a SystemExit
            raise
        finally:
            clock.cell_done(time.perf_counter() - started)
        value = final[N.VAL_PPL_AVG]
        trial.set_user_attr(VAL_LOSS_ATTR, final[N.VAL_LOSS])  # nats: the stability report's measure
        _close(tracker, child, Status.FINISHED, TrialOutcome.COMPLETE, None)
        drop_step_checkpoints(checkpoints)
        out(f"{prefix} done: Avg PPL {value:.2f}")
        return value

    for handler in logging.getLogger("optuna").handlers:
        if not any(isinstance(f, _HideSurplus) for f in handler.filters):
            handler.addFilter(_HideSurplus())
    if todo:
        study.optimize(
            objective,
            n_trials=todo,
            catch=(Exception,),
            callbacks=[
                optuna.study.MaxTrialsCallback(trials, states=(*COUNTED, TrialState.RUNNING)),
                lambda study, _trial: study.stop() if stop is not None and stop.signum else None,
            ],
        )
    _close_orphans(study, tracker)
    _summarise(study, tracker, parent)
    if stop is not None and stop.signum:  # came between trials, or in a trial's final probes
        raise KeyboardInterrupt
    return study


def _close(tracker: Tracker, run_id: str, status: str, trial_state: str, note: str | None) -> None:
    tracker.client.set_tag(run_id, "trial_state", trial_state)
    tracker.finish(run_id, status, note)


class SurplusTrial(Exception):
    """A trial asked for once the budget was taken (see :func:`beyond_budget`): it is failed
    untrained, marked ``SURPLUS_ATTR``, and its worker stops."""


class _HideSurplus(logging.Filter):
    """Drops Optuna's "Trial N failed ..." warning and traceback for a :class:`SurplusTrial` or a
    trial a Ctrl-C / SIGTERM stopped: the worker says why in one line of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        # a trial a signal stopped (KeyboardInterrupt) also says so in a line of its own
        return not (record.exc_info and isinstance(record.exc_info[1], (SurplusTrial, KeyboardInterrupt)))


def beyond_budget(study: optuna.Study, number: int, budget: int) -> bool:
    """Whether trial ``number`` started after ``budget`` others that use up the budget (complete,
    pruned, or running: each will count once it ends) had started.

    Optuna's ``MaxTrialsCallback`` looks at the count before a worker asks for its next trial, so
    two workers ending trials at the same moment both see room for one more and both ask for it
    (CI saw 5 trials for a budget of 4). Trials are ordered by when they started (a retried or
    enqueued trial keeps an old number but starts late), ties by number.
    """
    trials = study.get_trials(deepcopy=False)
    mine = next(t for t in trials if t.number == number)
    order = (mine.datetime_start, number)
    earlier = [
        t
        for t in trials
        if t.number != number
        and t.state in (*COUNTED, TrialState.RUNNING)
        and SURPLUS_ATTR not in t.user_attrs
        and t.datetime_start is not None
        and (t.datetime_start, t.number) < order
    ]
    return len(earlier) >= budget


def _close_orphans(study: optuna.Study, tracker: Tracker) -> None:
    """Child runs of trials that Optuna failed without us (a dead worker's) are closed as failed."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        run_id = t.user_attrs.get("mlflow_run_id")
        if run_id and tracker.client.get_run(run_id).info.status == "RUNNING":
            note = "the worker died; the heartbeat failed the trial"
            _close(tracker, run_id, Status.FAILED, TrialOutcome.FAIL, note)


def _summarise(study: optuna.Study, tracker: Tracker, parent: str) -> None:
    """Best LR and trial counts on the study's parent run."""
    trials = study.get_trials(deepcopy=False)
    states = [trial_outcome(t) for t in trials]
    counts = {key: states.count(state) for state, key in TrialOutcome.COUNT_KEYS.items()}
    if TrialOutcome.COMPLETE in states:
        counts[N.BEST_MAX_LR] = study.best_params["max_lr"]
        counts[N.BEST_AVG_PPL] = study.best_value
    tracker.log_metrics(parent, counts)
    tracker.client.set_terminated(parent, "FINISHED")
