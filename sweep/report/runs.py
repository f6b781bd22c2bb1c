"""Store queries for the report: the runs that are a grid's current results, as a pandas frame."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from experiments import names as N
from experiments.config import GateConfig, to_dict
from experiments.names import Status, current_key
from sweep.evalspec import LONGCTX_TAG
from sweep.fingerprints import expect_local_corpora, on_current_bytes
from sweep.grid import Grid, Row
from sweep.store import Tracker, experiment_name, flatten, started_from
from sweep.store_urls import tracking_uri


def finished_runs(grid: Grid, scale: str, results_dir: Path, seeds: list[int] | None = None) -> pd.DataFrame:
    """One line per current cell with a result: ``row``, ``seed``, ``run_id``, ``status``
    (``finished`` or ``diverged``) and every metric of the run.

    A run counts only when its ``run_key`` is the one the grid gives a row and seed today, so
    runs of an edited grid (or of rows since removed) never mix into the table, and, where its
    corpus is built here, when it trained on that corpus's bytes (``sweep.fingerprints``); of
    several runs of one key the newest wins. The run may have been trained for another grid (the same cell):
    its ``row`` and ``label`` here are this grid's. ``seeds`` restricts the seeds (default: every
    seed found).
    """
    tracker = Tracker(
        tracking_uri(results_dir), experiment_name(grid.name, scale), results_dir / "mlartifacts"
    )
    expect_local_corpora(tracker, grid.cells(scale))
    runs = [r for r in tracker.cell_runs(Status.DONE) if on_current_bytes(tracker.corpus_fingerprints, r)]
    return current_runs(grid, scale, runs, seeds)


def current_runs(grid: Grid, scale: str, runs: list, seeds: list[int] | None = None) -> pd.DataFrame:
    """:func:`runs_frame` of the runs that are the grid's current result: for each (row, seed),
    the newest run whose ``run_key`` is the one the grid gives it today and whose status is a
    result. Two rows of one config (one ``run_key``) both show its run."""
    cells: dict[str, list] = {}  # run_key -> the (row, seed) cells of this grid with that key
    for row in grid.rows:
        for seed in {int(r.data.tags.get("seed", -1)) for r in runs}:
            if seed >= 0 and (seeds is None or seed in seeds):
                cells.setdefault(_key(grid, scale, row, seed), []).append((row, seed))
    newest = sorted(
        (r for r in runs if r.data.tags.get("status") in Status.DONE),
        key=lambda r: r.info.start_time,
        reverse=True,
    )
    current, seen = [], set()
    for r in newest:
        key = r.data.tags.get("run_key")
        if key in seen or key not in cells:
            continue
        seen.add(key)
        current += [(r, row, seed) for row, seed in cells[key]]
    current = _trained_from_current_parents(grid, current)
    return runs_frame([r for r, _, _ in current], _stale_scores(grid, scale)).assign(
        row=[row.id for _, row, _ in current],
        label=[row.label for _, row, _ in current],
        seed=[seed for _, _, seed in current],
    )


def _stale_scores(grid: Grid, scale: str) -> Callable[[Any], set[str]]:
    """The metric keys of a run that are benchmark or long-context scores made with another recipe
    than the grid's (``sweep.evalspec.EvalConfig.recipe``, ``LongContextSpec.recipe``): left out
    of the tables until ``make eval`` scores the run again."""
    spec = grid.eval.for_scale(scale)
    recipes = {task: spec.recipe(task) for task in spec.tasks}
    longctx = grid.longctx.recipe() if grid.longctx is not None else None  # LongContextSpec.recipe

    def stale(run: Any) -> set[str]:
        tags = run.data.tags
        old = [N.bench_prefix(t) for t, made in recipes.items() if tags.get(N.bench_recipe_tag(t)) != made]
        if longctx is not None and tags.get(LONGCTX_TAG) != longctx:  # another YaRN factor, other lengths
            old.append(N.LONGCTX_PREFIX)
        return {k for k in run.data.metrics if k.startswith(tuple(old))} if old else set()

    return stale


def _trained_from_current_parents(grid: Grid, current: list) -> list:
    """``current`` ((run, row, seed) lines) without the later stages whose run started from
    another run than their parent's current one (the parent retrained, or deleted and retrained):
    such a stage is stale until it trains again (``sweep.store.Tracker.current_state``)."""
    order = {row.id: i for i, row in enumerate(grid.rows)}  # a parent is an earlier row
    kept: dict[tuple[str, int], object] = {}
    for r, row, seed in sorted(current, key=lambda line: order[line[1].id]):
        if row.parent is None or started_from(r, kept.get((row.parent, seed))):
            kept[(row.id, seed)] = r
    return [(r, row, seed) for r, row, seed in current if (row.id, seed) in kept]


def _key(grid: Grid, scale: str, row: Row, seed: int) -> str:
    return grid.cells(scale, seeds=[seed], rows=[row.id])[-1].run_key  # a later stage's key has its parent's


FRAME_COLUMNS = [
    "row", "label", "seed", "run_id", "status", "gate", "arithmetic", "git_commit", "numbers",
    "corpus_fingerprint",
]  # fmt: skip


def arithmetic(tags: dict[str, str]) -> str:
    """What computed a run, as its tags say: ``cpu (avx2, mkl AVX2, GenuineIntel), 1 thread, torch
    2.13.0+cpu``, ``NVIDIA H200 (cuda 12.8, sm_90, bf16-mixed), 1 thread, torch 2.13.0+cu128``; a
    CPU run from before the ``cpu_arith`` tag reads ``cpu, 1 thread, ...`` and one from before any
    tag ``unrecorded``. Two runs of one config agree to the last bit only when this agrees (torch's
    CPU kernels split sums by thread, each instruction set sums in its own order
    (:mod:`experiments.numerics`), and each torch build has its own kernels)."""
    if "device" not in tags:
        return "unrecorded"
    threads = tags.get("threads", "?")
    device = tags["device"]
    if device == "cpu" and tags.get("cpu_arith"):
        device = f"cpu ({tags['cpu_arith']})"
    elif tags.get("gpu_arith"):  # a GPU run: its CUDA build and capability, and its precision
        device = f"{device} ({tags['gpu_arith']}, {tags.get('precision', 'precision unrecorded')})"
    torch = f", torch {tags['torch']}" if tags.get("torch") else ""
    return f"{device}, {threads} thread{'' if threads == '1' else 's'}{torch}"


def one_arithmetic(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``runs`` split into those of the most common :func:`arithmetic` (a tie: the one seen
    first) and the others, which a table leaves out rather than mix numbers of different
    arithmetic in one column."""
    if runs.empty or runs["arithmetic"].nunique() <= 1:
        return runs, runs.iloc[0:0]
    kept = runs["arithmetic"].value_counts().index[0]
    return runs[runs["arithmetic"] == kept], runs[runs["arithmetic"] != kept]


def runs_frame(runs: list, left_out: Callable[[Any], set[str]] | None = None) -> pd.DataFrame:
    """MLflow runs (``mlflow.search_runs(..., output_format="list")`` or the client's) as one
    line per run: ``row``, ``label``, ``seed``, ``run_id``, ``status``, ``gate`` (see
    :func:`gate_signature`), ``arithmetic``, ``git_commit`` and ``numbers`` (None when the run
    has no such tag) and every metric under its MLflow key (older runs' per-layer keys
    renamed, ``experiments.names.current_key``), but those ``left_out(run)`` names."""
    records = [
        {
            "row": r.data.tags.get("row"),
            "label": r.data.tags.get("label"),
            "seed": int(r.data.tags.get("seed", -1)),
            "run_id": r.info.run_id,
            "status": r.data.tags.get("status"),
            "gate": gate_signature(r.data.params),
            "arithmetic": arithmetic(r.data.tags),
            "git_commit": r.data.tags.get("git_commit"),  # the code it was trained with
            "numbers": r.data.tags.get("numbers"),  # experiments.numerics.NUMBERS_VERSION then
            "corpus_fingerprint": r.data.tags.get(N.CORPUS_FINGERPRINT_TAG),  # the bytes it trained on
            **{current_key(k): v for k, v in r.data.metrics.items() if k not in dropped},
        }
        for r in runs
        for dropped in [left_out(r) if left_out else set()]
    ]
    return pd.DataFrame.from_records(records, columns=FRAME_COLUMNS if not records else None)


def gate_signature(params: dict[str, str] | GateConfig | None) -> str:
    """A run's gate as one comparable string, from its flattened params (``model.gate.*``) or
    from a :class:`GateConfig`; ``"none"`` for the ungated baseline."""
    if params is None or isinstance(params, GateConfig):
        params = flatten({"model": {"gate": to_dict(params)}})
    gate = _gate_fields(params)
    if gate:  # a field added after the run was logged (static_init) is the default it trained with
        gate = {**_gate_fields(flatten({"model": {"gate": to_dict(GateConfig())}})), **gate}
    return ",".join(f"{k}={v}" for k, v in sorted(gate.items())) or "none"


def _gate_fields(params: dict[str, str]) -> dict[str, str]:
    return {k.removeprefix("model.gate."): v for k, v in params.items() if k.startswith("model.gate.")}
