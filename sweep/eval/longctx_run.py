"""The long-context evaluation of finished runs (a grid's ``longctx:`` section): the scores of
:func:`experiments.longctx.evaluate_long_context` and, opt-in, RULER's (``sweep.eval.ruler``),
each with the model's own RoPE and with YaRN, logged to the run as ``longctx/<task>/<len>[.yarn]``.
``make sweep`` runs it after training (as the benchmarks), ``make eval`` on demand; a run is
scored once for each recipe of the grid's section (tag ``longctx=<recipe>``,
:meth:`sweep.evalspec.LongContextSpec.recipe`): another YaRN factor or another length scores it
again. Source: Table 5 of Qiu et al. (2025), Section 4.4."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from experiments.checkpointing import load_weights
from experiments.corpus import Corpus, build_corpus
from experiments.longctx import evaluate_long_context
from experiments.model import GatedLM, YarnScaling
from experiments.names import Status
from sweep.evalspec import LONGCTX_RULER_TAG, LONGCTX_TAG, LongContextSpec
from sweep.fingerprints import expect_local_corpora
from sweep.grid import Cell, Grid
from sweep.store import Tracker

RULER_MIN_LEN = 256  # lm-eval's RULER generators need at least this many tokens


def score_long_context(
    model: GatedLM, corpus: Corpus, spec: LongContextSpec, base_len: int, train_len: int, seed: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """Score ``model`` at ``m * base_len`` tokens for ``m`` in ``spec.lengths``, with its RoPE and
    with YaRN x ``spec.yarn_factor`` over ``train_len`` (the context it was trained at).

    Args:
        model: the trained model (its RoPE and train mode are restored after).
        corpus: its corpus (held-out text for PPL, the tokenizer for the passkey and RULER).
        spec: the grid's ``longctx:`` section.
        base_len: the scale's context, tokens (the first stage's ``train.seq_len``).
        train_len: this cell's own ``train.seq_len``, tokens: YaRN's original context.
        seed: the cell's seed (the passkeys drawn).

    Returns:
        The metrics (``names.longctx_key`` names) and a JSON-ready record (``longctx.json``).

    Raises:
        sweep.eval.ruler.RulerUnavailable: RULER tasks asked without the ``ruler`` extra.
        ValueError, RuntimeError: as the evaluations raise them (out of memory, say).
    """
    result = evaluate_long_context(model, corpus, base_len, train_len, spec, seed)
    metrics, record = dict(result.metrics), result.records()
    if spec.ruler_tasks:
        metrics.update(ruler_part(model, corpus, spec, base_len, train_len, record))
    return metrics, record


def ruler_part(
    model: GatedLM,
    corpus: Corpus,
    spec: LongContextSpec,
    base_len: int,
    train_len: int,
    record: dict[str, Any],
) -> dict[str, float]:
    """RULER's ``spec.ruler_tasks`` at each length of at least :data:`RULER_MIN_LEN` tokens, with
    the model's RoPE and with YaRN; a (task, length) lm-eval cannot build (too short for its
    template, say) is skipped and named in ``record["ruler"]["skipped"]``, the others go on."""
    from sweep.eval.ruler import ruler_scores

    lengths = sorted({m * base_len for m in spec.lengths if m * base_len >= RULER_MIN_LEN})
    skipped: list[str] = []
    record["ruler"] = {"tasks": list(spec.ruler_tasks), "lengths": lengths, "limit": spec.ruler_limit,
                       "skipped": skipped}  # fmt: skip
    metrics: dict[str, float] = {}
    rope, was_training = model.rope, model.training
    try:
        for yarn in (False, True):
            scaling = YarnScaling(spec.yarn_factor, train_len) if yarn else None
            model.set_rope(theta=rope.theta, max_seq_len=max(lengths, default=base_len), yarn=scaling)
            for task in spec.ruler_tasks:
                for length in lengths:
                    try:
                        metrics.update(
                            ruler_scores(
                                model,
                                corpus.tokenizer(),
                                [task],
                                [length],
                                spec.ruler_limit,
                                yarn=yarn,
                                eot_id=corpus.eos_id,
                            )
                        )
                    except ValueError as err:  # lm-eval cannot build this task at this length
                        skipped.append(f"{task} at {length}{' (YaRN)' if yarn else ''}: {err}")
    finally:
        model.rope = rope
        model.train(was_training)
    return metrics


def load_model(cell: Cell, checkpoint: Path) -> GatedLM:
    """The cell's model with the weights of ``checkpoint`` (``final.ckpt``: ``LMModule``'s, under
    ``model.``), on the GPU where there is one.

    Raises:
        FileNotFoundError: no such file. RuntimeError: the weights do not fit the config.
        experiments.checkpointing.CheckpointDamaged: its bytes are not the ones written.
    """
    state = load_weights(checkpoint)
    model = GatedLM(cell.config.model)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def first_stage(cell: Cell) -> Cell:
    """The cell the stages of ``cell`` start from (itself when it has no parent)."""
    while cell.parent is not None:
        cell = cell.parent
    return cell


def score_missing_long_context(
    tracker: Tracker,
    grid: Grid,
    cells: list[Cell],
    cache_root: Path | None = None,
    out: Callable[[str], None] = print,
) -> tuple[int, int]:
    """Score every finished run of ``cells`` whose row the grid's ``longctx:`` names and which has
    no scores of the section as it is now (:meth:`~sweep.evalspec.LongContextSpec.current`: none
    yet, or of another YaRN factor, other lengths, fewer RULER tasks); log them to the run at its
    last step, over any older ones. A run whose evaluation fails gets the tag ``longctx_error``
    (one line here) and the others go on; the next call tries it again. Without the ``ruler``
    extra, RULER's tasks are left out (one line), and a run scored without them counts as scored.

    Returns:
        (scored, failed) counts.
    """
    spec = grid.longctx
    if spec is not None and spec.ruler_tasks:
        from sweep.eval.ruler import INSTALL, missing_packages

        if missing := missing_packages():  # the other scores go on; RULER's need the extra
            out(f"warning: longctx.ruler_tasks not scored: they need {', '.join(missing)} ({INSTALL})")
            spec = dataclasses.replace(spec, ruler_tasks=())
    expect_local_corpora(tracker, cells, cache_root)  # a run on other bytes than the corpus's is no result
    todo: dict[str, tuple[Cell, Any]] = {}
    for cell in cells if spec is not None else ():
        run = tracker.current_result(cell)
        if spec.scores(cell.row.id) and run is not None and run.data.tags.get("status") == Status.FINISHED:
            if not spec.current(run.data.tags):
                todo.setdefault(run.info.run_id, (cell, run))
    failed = 0
    for i, (cell, run) in enumerate(todo.values(), start=1):
        prefix = f"[long context {i}/{len(todo)}] {cell.row.id} s{cell.seed}"
        started = time.perf_counter()
        try:
            model = load_model(cell, Path(run.data.tags.get("checkpoint", "")))
            corpus = build_corpus(cell.config.data, cache_root, log=lambda _msg: None)
            base_len, train_len = first_stage(cell).config.train.seq_len, cell.config.train.seq_len
            metrics, record = score_long_context(model, corpus, spec, base_len, train_len, cell.seed)
        except Exception as err:  # one run's evaluation must not stop the others
            failed += 1
            tracker.client.set_tag(run.info.run_id, "longctx_error", f"{type(err).__name__}: {err}"[:5000])
            out(f"{prefix} FAILED: {type(err).__name__}: {err}".splitlines()[0])
            continue
        run_id = run.info.run_id
        tracker.log_metrics(run_id, metrics, step=cell.config.train.max_steps)
        tracker.log_json(run_id, record, "longctx.json")
        tracker.client.set_tag(run_id, LONGCTX_RULER_TAG, ",".join(spec.ruler_tasks))
        tracker.client.set_tag(run_id, LONGCTX_TAG, spec.recipe())  # last: the scores above are all logged
        out(f"{prefix}: {len(metrics)} scores in {time.perf_counter() - started:.0f} s")
    return len(todo) - failed, failed
