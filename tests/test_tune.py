"""The Optuna LR search on micro studies: step pruning, divergence as data, workers, MLflow links."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pandas as pd
import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState

import sweep.studies
from experiments.lit import LMModule
from sweep.cli import main
from sweep.grid import load_grid
from sweep.run import ladder, search, tune
from sweep.run.tune import StepPruningCallback, study_name, tune_row
from sweep.store import Tracker
from sweep.store_urls import tracking_uri
from sweep.studies import make_storage, storage_url
from tests.support import ROOT, start_slow_cli, use_repo_cache, wait_for_checkpoint

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults

TUNE = """\
name: micro
title: "Micro LR search"
base:
  model: {vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}
  train: {max_steps: 8, batch_size: 4, seq_len: 32, warmup_steps: 2, val_every: 2, val_tokens: 512,
          max_lr: 2e-3, min_lr: 1e-6}
  data: {vocab_size: 512, max_chars_per_source: 200000}
scales: {tiny: {}}
rows:
  - {id: baseline, label: "Baseline"}
"""


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    use_repo_cache(monkeypatch)
    path = tmp_path / "micro.yaml"
    path.write_text(TUNE)
    grid = load_grid(path)
    return {"grid": grid, "row": grid.rows[0], "results": tmp_path / "results", "path": path}


def _enqueued(s: dict, lrs: list[float]) -> optuna.Study:
    """The row's study with trials of these LRs queued first, in order (as a driver would)."""
    s["results"].mkdir(exist_ok=True)
    study = optuna.create_study(
        study_name=study_name(s["grid"], "tiny", s["row"]),
        storage=storage_url(s["results"], None),
        direction="minimize",
    )
    for lr in lrs:
        study.enqueue_trial({"max_lr": lr})
    return study


@pytest.mark.parametrize("devices", [1, 2], ids=["one_process", "two_ranks"])
def test_a_bad_trial_is_pruned_by_step_and_trials_link_to_their_study_run(setup: dict, devices: int) -> None:
    """With ``devices: 2`` every trial trains on two DDP ranks; rank 0 reports to the study and
    the ranks stop together on the pruner's word (``RankPruningCallback``)."""
    if devices > 1:
        setup["path"].write_text(TUNE.replace("max_lr: 2e-3,", "max_lr: 2e-3, devices: 2, strategy: ddp,"))
        setup["grid"] = load_grid(setup["path"])
        setup["row"] = setup["grid"].rows[0]
        assert setup["grid"].resolve("tiny", setup["row"], 0).train.world_size == 2
    _enqueued(setup, [5e-3, 4e-3, 1e-6])
    study = tune_row(
        setup["grid"], "tiny", setup["row"], 3, setup["results"], lr_range=(1e-6, 1e-2), out=print
    )
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    assert sorted(trials[0].intermediate_values) == [2, 4, 6, 8]  # four reports inside one epoch
    assert list(trials[2].intermediate_values) == [2]  # 1e-6 barely trains: pruned at its first report

    client = MlflowClient(tracking_uri=f"sqlite:///{setup['results'] / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny-lr")
    (parent,) = client.search_runs([exp.experiment_id], "tags.kind = 'study'")
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_trial = {int(c.data.tags["trial"]): c for c in children}
    assert sorted(by_trial) == [0, 1, 2]
    assert [by_trial[i].data.tags["trial_state"] for i in range(3)] == ["complete", "complete", "pruned"]
    assert by_trial[2].data.params["train.max_lr"] == "1e-06"
    assert parent.data.metrics["best/max_lr"] == study.best_params["max_lr"]
    assert parent.data.metrics["trials/pruned"] == 1

    again = tune_row(setup["grid"], "tiny", setup["row"], 3, setup["results"], out=lambda _: None)
    assert len(again.get_trials()) == 3  # the budget is met: a rerun adds nothing


def test_a_nan_trial_is_recorded_as_diverged_and_the_study_goes_on(
    setup: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = LMModule.loss

    def planted(self: LMModule, batch, reduction: str = "mean"):
        loss = original(self, batch, reduction)
        return loss * float("nan") if self.training and self.cfg.train.max_lr > 4e-3 else loss

    monkeypatch.setattr(LMModule, "loss", planted)
    _enqueued(setup, [8e-3, 2e-3, 1e-3])
    args = ["tune", "--grid", str(setup["path"]), "--results", str(setup["results"]), "--trials", "3"]
    assert main(args) == 0
    table = pd.read_csv(setup["results"] / "micro_lr_search.csv").iloc[0]
    assert (table["n_complete"], table["n_diverged"], table["n_pruned"], table["n_fail"]) == (2, 1, 0, 0)
    assert table["best_max_lr"] in (2e-3, 1e-3)
    assert (setup["results"] / "figures" / "micro_lr_sensitivity.png").stat().st_size > 10_000


def test_a_trial_started_once_the_budget_was_taken_is_beyond_it() -> None:
    """Four trials running or ended for a budget of four: a fifth asked for is beyond it, until
    one of the four fails (a failed trial leaves its place)."""
    study = optuna.create_study()
    first = [study.ask() for _ in range(4)]
    assert not tune.beyond_budget(study, first[3].number, 4)
    study.tell(first[0], 3.0)
    study.tell(first[1], state=TrialState.PRUNED)
    fifth = study.ask()
    assert tune.beyond_budget(study, fifth.number, 4)
    assert not tune.beyond_budget(study, fifth.number, 5)
    study.tell(first[2], state=TrialState.FAIL)
    assert not tune.beyond_budget(study, fifth.number, 4)


def test_a_worker_that_asks_for_a_trial_beyond_the_budget_stops_without_training(setup: dict) -> None:
    """Three trials complete and another worker's still running: a budget of four is taken, so
    the trial this worker asks for is failed untrained (``surplus``), and nothing counts it."""
    study = _enqueued(setup, [])
    lr = optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    for value in (30.0, 20.0, 25.0):
        study.add_trial(
            optuna.trial.create_trial(params={"max_lr": 1e-3}, distributions={"max_lr": lr}, value=value)
        )
    running = study.ask()  # the other worker's
    lines: list[str] = []
    study = tune_row(setup["grid"], "tiny", setup["row"], 4, setup["results"], out=lines.append)
    surplus = study.get_trials()[-1]
    assert (surplus.number, surplus.state, surplus.user_attrs) == (4, TrialState.FAIL, {"surplus": True})
    assert f"[{study.study_name} #4] not run: the other workers took the last of the 4 trials" in lines
    assert search.unretried_failures(study) == [] and running.number == 3
    client = MlflowClient(tracking_uri=f"sqlite:///{setup['results'] / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny-lr")
    assert client.search_runs([exp.experiment_id], "tags.kind = 'trial'") == []  # nothing trained
    assert [r["state"] for r in sweep.studies.trial_table(study)] == ["complete"] * 3


def test_two_workers_on_one_storage_share_the_budget(setup: dict) -> None:
    env = {**os.environ, "GATED_ATTN_CACHE": str(ROOT / ".cache")}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "sweep.cli", "tune", "--grid", str(setup["path"])]
    cmd += ["--results", str(setup["results"]), "--trials", "4", "--lr-range", "1e-3,5e-3"]
    setup["results"].mkdir()
    # The driver creates both stores before the workers start (two processes creating one
    # SQLite MLflow store at once race in its schema migration).
    _enqueued(setup, [])
    Tracker(tracking_uri(setup["results"]), "micro-tiny-lr", setup["results"] / "mlartifacts")
    workers = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL) for _ in range(2)]
    assert [w.wait(timeout=600) for w in workers] == [0, 0]
    study = optuna.load_study(study_name="micro-tiny-baseline", storage=storage_url(setup["results"], None))
    trials = study.get_trials()
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    assert sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials) == 4


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # ask() simulates the dead worker
def test_a_dead_workers_trial_is_failed_and_retried(setup: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep.studies, "HEARTBEAT_S", 1)  # grace period 3 s instead of 90 s
    setup["results"].mkdir()
    storage = make_storage(storage_url(setup["results"], None))
    study = optuna.create_study(
        study_name=study_name(setup["grid"], "tiny", setup["row"]), storage=storage, direction="minimize"
    )
    dead = study.ask({"max_lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)})
    storage.record_heartbeat(dead._trial_id)  # a worker started this trial, then died
    time.sleep(4)
    study = tune_row(setup["grid"], "tiny", setup["row"], 1, setup["results"], out=lambda _: None)
    first, retry = study.get_trials()
    assert first.state == TrialState.FAIL  # no longer left RUNNING
    assert retry.state == TrialState.COMPLETE and retry.params == first.params
    assert retry.system_attrs["failed_trial"] == first.number
    assert search.unretried_failures(study) == []  # retried, so the command would still exit 0


class _Always:
    """A trial stub whose pruner always says prune; it records what was reported."""

    def __init__(self) -> None:
        self.reports: list[tuple[float, int]] = []

    def report(self, value: float, step: int) -> None:
        self.reports.append((value, step))

    def should_prune(self) -> bool:
        return True


def _validated(callback: StepPruningCallback, step: int, max_steps: int = 8) -> None:
    trainer = SimpleNamespace(sanity_checking=False, global_step=step, max_steps=max_steps)
    callback.on_validation_end(trainer, SimpleNamespace(last_val={"val/loss": 5.0 + step}))


def test_step_pruning_reports_each_step_once_and_never_prunes_a_finished_run() -> None:
    trial = _Always()
    callback = StepPruningCallback(trial)
    with pytest.raises(optuna.TrialPruned, match="pruned at step 4"):
        _validated(callback, 4)
    _validated(callback, 8)  # the last step: reported, not pruned
    _validated(callback, 8)  # the post-fit validation of the same step: not reported twice
    assert trial.reports == [(9.0, 4), (13.0, 8)]


def test_a_ladder_rerun_trains_only_missing_rungs_and_rejects_another_ladder() -> None:
    study = optuna.create_study(direction="minimize")
    rungs = optuna.distributions.CategoricalDistribution([2e-3, 4e-3, 8e-3])
    study.add_trial(
        optuna.trial.create_trial(params={"max_lr": 2e-3}, distributions={"max_lr": rungs}, value=1.0)
    )
    failed = optuna.trial.create_trial(
        params={"max_lr": 4e-3}, distributions={"max_lr": rungs}, state=TrialState.FAIL
    )
    study.add_trial(failed)
    assert ladder.unvisited(study, [2e-3, 4e-3, 8e-3]) == [4e-3, 8e-3]  # a failed rung is run again
    with pytest.raises(ValueError, match="another ladder"):
        ladder.unvisited(study, [1e-3, 8e-3])


@pytest.mark.parametrize("command", ["tune", "stability"])
def test_ctrl_c_in_an_lr_search_fails_the_trial_cleanly_and_a_rerun_completes_the_budget(
    setup: dict, command: str
) -> None:
    """The stability ladder's rerun once trained 2 of 3 rungs: Optuna's GridSampler counted the
    failed rung as visited and stopped the study."""
    import signal

    setup["path"].write_text(
        TUNE.replace("max_steps: 8,", "max_steps: 40,").replace(
            "min_lr: 1e-6}", "min_lr: 1e-6, checkpoint_every: 5}"
        )
    )
    results = setup["results"]
    args = [command, "--grid", str(setup["path"]), "--results", str(results)]
    args += ["--trials", "2"] if command == "tune" else ["--ladder", "2e-3,4e-3"]
    proc = start_slow_cli(args)
    wait_for_checkpoint(results, 5, [proc])
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert out.strip().splitlines()[-1] == (
        f"{command} interrupted: the running trial stopped and does not count; "
        "run the same command again to complete the budget"
    )
    assert "Traceback" not in out and "failed with parameters" not in out  # Optuna's own report
    grid = load_grid(setup["path"])
    name = study_name(grid, "tiny", grid.rows[0], ladder=command == "stability")
    study = optuna.load_study(study_name=name, storage=storage_url(results, None))
    queued = [TrialState.WAITING] if command == "stability" else []  # the ladder's next rung
    assert [t.state for t in study.trials] == [TrialState.FAIL, *queued]  # not left RUNNING
    run = MlflowClient(tracking_uri(results)).get_run(study.trials[0].user_attrs["mlflow_run_id"])
    assert (run.info.status, run.data.tags["status"]) == ("KILLED", "killed")
    assert main(args) == 0  # the rerun, at once: no stale RUNNING trial holds the budget
    trials = optuna.load_study(study_name=name, storage=storage_url(results, None)).trials
    states = [t.state for t in trials]
    assert states.count(TrialState.COMPLETE) + states.count(TrialState.PRUNED) == 2
    if command == "stability":  # every rung trained, the one the Ctrl-C failed included
        assert sorted(t.params["max_lr"] for t in trials if t.state != TrialState.FAIL) == [2e-3, 4e-3]


def test_a_study_made_anew_under_an_old_name_gets_a_parent_run_of_its_own(setup: dict) -> None:
    grid, row, results = setup["grid"], setup["row"], setup["results"]
    studies = []
    for _ in range(2):  # the second after the first was deleted, as the config-change error says to
        study = tune_row(grid, "tiny", row, 1, results, out=lambda _: None)
        studies.append((study.user_attrs["uid"], study.trials[0].user_attrs["mlflow_run_id"]))
        optuna.delete_study(study_name=study.study_name, storage=storage_url(results, None))
    assert studies[0][0] != studies[1][0]  # (SQLite gives the new study the old one's id)
    client = MlflowClient(tracking_uri=tracking_uri(results))
    exp = client.get_experiment_by_name("micro-tiny-lr")
    parents = {
        p.data.tags["optuna_study_uid"]: p
        for p in client.search_runs([exp.experiment_id], "tags.kind = 'study'")
    }
    assert sorted(parents) == sorted(uid for uid, _ in studies)
    for uid, trial_run in studies:
        query = f"tags.mlflow.parentRunId = '{parents[uid].info.run_id}'"
        assert [c.info.run_id for c in client.search_runs([exp.experiment_id], query)] == [trial_run]
