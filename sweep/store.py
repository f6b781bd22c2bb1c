"""MLflow glue shared by running, reporting and scoring: explicit store URIs, one experiment per
(grid, scale), one run per cell; the string literals of MLflow's search filters.

Default store: SQLite at ``results/mlflow.db`` with artifacts under ``results/mlartifacts``
(never the deprecated file store); ``MLFLOW_TRACKING_URI`` overrides it (e.g. a tracking server
on PostgreSQL for many machines). A cell's run is found by its ``run_key`` in any experiment of
the store, so a cell two grids share is trained once and both grids' tables read it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from experiments.config import to_dict
from experiments.names import Kind, Status
from sweep.fingerprints import CorpusHere, on_current_bytes
from sweep.grid import Cell
from sweep.sqlite_lock import creation_lock, sqlite_file
from sweep.store_urls import TrackingError, check_reachable
from sweep.ui_view import experiment_tags


def quoted(value: str) -> str:
    """``value`` as a string literal of an MLflow search filter (single quotes, else double).

    Raises:
        ValueError: ``value`` holds both quote characters (the filter grammar has no escape).
    """
    for quote in ("'", '"'):
        if quote not in value:
            return f"{quote}{value}{quote}"
    raise ValueError(f"{value!r} cannot be quoted in an MLflow filter: it holds both quote characters")


def first_line(err: BaseException) -> str:
    """``TypeName: first line of the message``: an exception as one line for the user."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


_MLFLOW_END = {Status.FINISHED: "FINISHED", Status.DIVERGED: "FINISHED", Status.KILLED: "KILLED"}


@contextlib.contextmanager
def user_tracking_env() -> Iterator[None]:
    """Put ``MLFLOW_TRACKING_URI`` back as it was on leaving. MLflow's ``set_tracking_uri`` (which
    Lightning's logger calls) writes the store it is given into the environment, so without this a
    later sweep in the same process would read the last store used, not the user's setting."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


def experiment_name(grid: str, scale: str) -> str:
    """One experiment per grid and scale, e.g. ``table1-tiny``."""
    return f"{grid}-{scale}"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"model": {"gate": {"position": "sdpa"}}}`` -> ``{"model.gate.position": "sdpa"}``."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = (
                "none"
                if value is None
                else ",".join(map(str, value))
                if isinstance(value, list)
                else str(value)
            )
    return out


def _file_id(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of ``path``, or None when there is no such file."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def runtime_tags() -> dict[str, str]:
    """What computed a run: the device, torch's intra-op threads, its arithmetic (on the CPU
    ``cpu_arith``, :func:`experiments.numerics.cpu_arithmetic`; on a GPU ``gpu_arith``,
    :func:`experiments.devices.gpu_arithmetic`, beside the run's ``precision`` tag), the numbers
    version, the git commit (``git_commit``, ``+dirty`` with uncommitted changes; absent outside a
    checkout) and the library versions."""
    import lightning
    import torch

    from experiments.devices import gpu_arithmetic
    from experiments.numerics import NUMBERS_VERSION, cpu_arithmetic

    gpu = gpu_arithmetic()
    tags = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "threads": str(torch.get_num_threads()),
        **({"gpu_arith": gpu} if gpu else {"cpu_arith": cpu_arithmetic()}),
        "numbers": str(NUMBERS_VERSION),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }
    commit = code_commit()
    if commit:
        tags["git_commit"] = commit
    return tags


CODE_PATHS = ("experiments", "sweep", "pyproject.toml")  # what a run's numbers come from


def code_commit() -> str | None:
    """The git commit of the code this process runs (``<sha>+dirty`` when the code, ``experiments/``,
    ``sweep/`` or ``pyproject.toml``, differs from it; results and docs do not count), or None
    outside a git checkout or without git."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", *CODE_PATHS],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def started_from(run: Any | None, parent: Any | None) -> bool:
    """Whether the later stage's ``run`` started from the ``parent`` run (its tag ``parent_run``)."""
    return run is not None and parent is not None and run.data.tags.get("parent_run") == parent.info.run_id


class Tracker:
    """Thin wrapper over ``MlflowClient`` for one experiment.

    A new SQLite store is set up under an inter-process lock (:mod:`sweep.sqlite_lock`): two
    sweeps started at once on a new results folder both get it whole. An experiment deleted in
    the MLflow UI (its lifecycle stage ``deleted``, until ``mlflow gc``) is restored with its
    runs, and a line says so: deleting it in the UI to tidy up must not cost its results. A run
    deleted on its own is another matter: its cell counts as never trained (see :meth:`runs_for`).

    Args:
        uri: tracking URI (see :func:`tracking_uri`).
        experiment: experiment name; created if missing (by the sweep driver, before any worker).
        artifact_root: where a new experiment stores artifacts when the store is local SQLite.
        out: where the line about a restored experiment goes.

    Raises:
        TrackingError: the store is unreachable or rejects the experiment, or the experiment was
            deleted and cannot be restored (the line says how to remove it for good).
    """

    def __init__(
        self,
        uri: str,
        experiment: str,
        artifact_root: Path | None = None,
        out: Callable[[str], None] = print,
    ) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import LifecycleStage

        self.uri, self.experiment, self.out = uri, experiment, out
        self.corpus_fingerprints: dict[str, CorpusHere] = {}  # recipe hash -> its bytes here
        check_reachable(uri)
        try:
            with creation_lock(uri):  # MLflow creates or migrates the schema on first use
                self.client = MlflowClient(tracking_uri=uri)
                found = self.client.get_experiment_by_name(experiment)
            if found is None:
                location = None
                if uri.startswith("sqlite:") and artifact_root is not None:
                    location = (artifact_root / experiment).resolve().as_uri()
                try:
                    self.experiment_id = self.client.create_experiment(
                        experiment, artifact_location=location, tags=experiment_tags()
                    )
                except Exception:  # another driver created it a moment ago
                    found = self.client.get_experiment_by_name(experiment)
                    if found is None:
                        raise
            if found is not None:
                self.experiment_id = found.experiment_id
        except Exception as err:  # MLflow raises many types for an unreachable store
            raise TrackingError(f"tracking store {uri} is not usable: {first_line(err)}") from None
        self._db = sqlite_file(uri)
        self._db_id = _file_id(self._db) if self._db else None
        if found is not None and found.lifecycle_stage == LifecycleStage.DELETED:
            self._restore()
        if found is not None:  # an experiment made before the UI tags (sweep.ui_view)
            for key, value in experiment_tags().items():
                if found.tags.get(key) != value:
                    self.client.set_experiment_tag(self.experiment_id, key, value)

    def check_store(self) -> None:
        """Fail on a SQLite store whose file was deleted (or replaced) since this tracker opened
        it: SQLite goes on reading the deleted file, and every write fails.

        Raises:
            TrackingError: one line, with what to do.
        """
        if self._db_id is not None and _file_id(self._db) != self._db_id:
            raise TrackingError(
                f"tracking store {self.uri} is gone: {self._db} was deleted or replaced while this "
                "process used it; run the same command again to train into a new store"
            )

    def ensure_active(self) -> None:
        """Check the store is still there (:meth:`check_store`) and restore the experiment if it
        was deleted in the MLflow UI since this tracker opened it (a sweep calls this before each
        cell).

        Raises:
            TrackingError: the store is gone, or the experiment cannot be restored.
        """
        from mlflow.entities import LifecycleStage

        self.check_store()
        if self.client.get_experiment(self.experiment_id).lifecycle_stage == LifecycleStage.DELETED:
            self._restore()

    def _restore(self) -> None:
        """Bring the deleted experiment back with its runs (MLflow restores them all), one line.

        Raises:
            TrackingError: MLflow refused; the line says how to remove it for good instead.
        """
        try:
            self.client.restore_experiment(self.experiment_id)
            runs = self.client.search_runs(
                [self.experiment_id], f"tags.kind = '{Kind.CELL}'", max_results=50000
            )
        except Exception as err:
            raise TrackingError(
                f"experiment {self.experiment} (id {self.experiment_id}) was deleted in the MLflow UI and "
                f"cannot be restored ({first_line(err)}); restore it in the UI, or remove it for good "
                f"with: mlflow gc --backend-store-uri '{self.uri}' --tracking-uri '{self.uri}' "
                f"--experiment-ids {self.experiment_id}"
            ) from None
        count = f"{len(runs)} cell run{'' if len(runs) == 1 else 's'}"
        self.out(
            f"experiment {self.experiment} was deleted in the MLflow UI; restored it with its {count} "
            f"(to discard them for good: delete it again, then "
            f"mlflow gc --backend-store-uri '{self.uri}' --tracking-uri '{self.uri}')"
        )

    def is_deleted(self, run_id: str) -> bool:
        """Whether ``run_id`` was deleted (in the UI, say) or is gone from the store."""
        from mlflow.entities import LifecycleStage

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == LifecycleStage.DELETED
        except Exception:  # no such run any more
            return True

    def experiment_ids(self) -> list[str]:
        """Every live experiment of the store (cells are looked up across all of them)."""
        return [e.experiment_id for e in self.client.search_experiments()]

    def experiment_name_of(self, run: Any) -> str:
        """The name of the experiment ``run`` belongs to (perhaps another grid's)."""
        if run.info.experiment_id == self.experiment_id:
            return self.experiment
        return self.client.get_experiment(run.info.experiment_id).name

    def runs_for(self, run_key: str) -> list[Any]:
        """Live cell runs tagged with ``run_key`` in any experiment of the store, newest first."""
        return self.client.search_runs(
            self.experiment_ids(),
            filter_string=f"tags.run_key = {quoted(run_key)} and tags.kind = {quoted(Kind.CELL)}",
            order_by=["attributes.start_time DESC"],
            max_results=1000,
        )

    def cell_runs(self, statuses: tuple[str, ...]) -> list[Any]:
        """Every cell run in the store whose ``status`` tag is one of ``statuses``."""
        return [  # MLflow's filter has no IN for tags
            r
            for status in statuses
            for r in self.client.search_runs(
                self.experiment_ids(),
                filter_string=f"tags.status = {quoted(status)} and tags.kind = {quoted(Kind.CELL)}",
                max_results=50000,
            )
        ]

    def cell_state(self, run_key: str) -> tuple[Any | None, Any | None]:
        """``(done_run, resumable_run)`` of ``run_key`` from one read of the store, so that a run
        another process finishes meanwhile is seen as one or the other, never as neither; a run on
        other bytes than its corpus's here is neither (``sweep.fingerprints``)."""
        runs = [r for r in self.runs_for(run_key) if on_current_bytes(self.corpus_fingerprints, r)]
        done = next((r for r in runs if r.data.tags.get("status") in Status.DONE), None)
        return done, next((r for r in runs if r.data.tags.get("status") in Status.RESUMABLE), None)

    def reopen(self, run_id: str) -> None:
        """Mark an unfinished run as running again, for a resumed attempt."""
        self.client.update_run(run_id, status="RUNNING")
        self.client.set_tag(run_id, "status", Status.RUNNING)
        resumes = int(self.client.get_run(run_id).data.tags.get("resumed", 0))
        self.client.set_tag(run_id, "resumed", str(resumes + 1))  # how many times it resumed

    def current_state(self, cell: Any) -> tuple[Any | None, Any | None]:
        """:meth:`cell_state` of a ``sweep.grid.Cell``; a later stage's runs count only while they
        :func:`started_from` its parent's current result (a retrained parent retrains the stage)."""
        runs = self.cell_state(cell.run_key)
        if cell.parent is None or runs == (None, None):
            return runs
        parent = self.current_result(cell.parent)
        return tuple(r if started_from(r, parent) else None for r in runs)

    def current_result(self, cell: Any) -> Any | None:
        """The cell's result run, if it is current (:meth:`current_state`), else None."""
        return self.current_state(cell)[0]

    def done_run(self, run_key: str) -> Any | None:
        """The newest run of ``run_key`` that is a result (``finished`` or ``diverged``), if any."""
        return self.cell_state(run_key)[0]

    def start_cell(self, cell: Cell, extra_tags: dict[str, str] | None = None) -> str:
        """Create the cell's run with its tags, flattened params and resolved config; return its id."""
        tags = {
            "grid": cell.grid,
            "scale": cell.scale,
            "row": cell.row.id,
            "label": cell.row.label,
            "seed": str(cell.seed),
            "run_key": cell.run_key,
            "status": Status.RUNNING,
            "kind": Kind.CELL,
            **runtime_tags(),
            **(extra_tags or {}),
        }
        run = self.client.create_run(self.experiment_id, run_name=f"{cell.row.id}-s{cell.seed}", tags=tags)
        run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in flatten(to_dict(cell.config)).items()]
        if cell.config.model.moe is None:  # what match_params left, which no config key holds
            params.append(Param("model.ffn_dim_effective", str(cell.config.model.effective_ffn_dim())))
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i : i + 100])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "config.yaml"
            path.write_text(yaml.safe_dump(to_dict(cell.config), sort_keys=False))
            self.client.log_artifact(run_id, str(path))
        return run_id

    def named_run(self, name: str, tags: dict[str, str]) -> str:
        """The experiment's run carrying all of ``tags``, created (as ``name``) on first use; for
        runs that are not cells: the ``report`` run, an Optuna study's parent run."""
        query = " and ".join(f"tags.{k} = {quoted(v)}" for k, v in tags.items())
        found = self.client.search_runs([self.experiment_id], filter_string=query)
        if found:
            return found[0].info.run_id
        return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id

    def report_run(self) -> str:
        """The experiment's one run tagged ``kind=report``; it holds the tables and figures as
        artifacts and never counts as a cell."""
        run_id = self.named_run("report", {"kind": Kind.REPORT})
        self.client.set_terminated(run_id, "FINISHED")
        return run_id

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """Log scalar metrics at ``step`` (batched: one request per 1000 metrics)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(run_id, metrics=batch[i : i + 1000])

    def log_files(self, run_id: str, paths: list[Path], folder: str | None = None) -> None:
        """Upload files as artifacts of ``run_id`` under ``folder``."""
        for path in paths:
            self.client.log_artifact(run_id, str(path), folder)

    def log_json(self, run_id: str, payload: Any, name: str) -> None:
        """Store ``payload`` as the JSON artifact ``name`` of ``run_id``."""
        self.client.log_dict(run_id, payload, name)

    def finish(self, run_id: str, status: str, note: str | None = None) -> None:
        """Set the ``status`` tag and end the run (MLflow FINISHED for a result, KILLED for
        ``killed``, FAILED otherwise)."""
        self.client.set_tag(run_id, "status", status)
        if note:
            self.client.set_tag(run_id, "status_note", note[:5000])
        self.client.set_terminated(run_id, _MLFLOW_END.get(status, "FAILED"))

    def delete(self, run_id: str) -> None:
        """Move a run to MLflow's deleted lifecycle stage (restorable until ``mlflow gc``)."""
        self.client.delete_run(run_id)
