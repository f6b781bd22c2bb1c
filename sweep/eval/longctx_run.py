"""The long-context evaluation of one finished cell (a grid's ``longctx:`` section): the scores of
:func:`experiments.longctx.evaluate_long_context` and, opt-in, RULER's (``sweep.eval.ruler``),
each with the model's own RoPE and with YaRN. Source: Table 5 of Qiu et al. (2025), Section 4.4."""

from __future__ import annotations

from typing import Any

from experiments.corpus import Corpus
from experiments.longctx import evaluate_long_context
from experiments.model import GatedLM, YarnScaling
from sweep.evalspec import LongContextSpec

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
        from sweep.eval.ruler import ruler_scores

        lengths = sorted({m * base_len for m in spec.lengths if m * base_len >= RULER_MIN_LEN})
        rope, was_training = model.rope, model.training
        try:
            for yarn in (False, True):
                scaling = YarnScaling(spec.yarn_factor, train_len) if yarn else None
                model.set_rope(theta=rope.theta, max_seq_len=lengths[-1], yarn=scaling)
                metrics.update(
                    ruler_scores(
                        model, corpus.tokenizer(), spec.ruler_tasks, lengths, spec.ruler_limit, yarn=yarn
                    )
                )
        finally:
            model.rope = rope
            model.train(was_training)
        record["ruler"] = {"tasks": list(spec.ruler_tasks), "lengths": lengths, "limit": spec.ruler_limit}
    return metrics, record
