"""The lm-eval wrapper's split of a (context, continuation) pair: one encoding of the joined string,
cut where the context's characters end, a straddling token scored with the continuation; scores
recomputed by hand from the model's logits over the whole string's tokens."""

from __future__ import annotations

import pytest
from lm_eval.api.model import TemplateLM

from experiments.lm_wrapper import GatedAttnLM
from tests.support import TEXT, WINDOW, direct_logprob, request, tiny_lm

# Frequent enough that BPE merges " import", " café" and two emoji into single tokens.
MERGED = "x = import os\nle café 😀😀 cafe\u0301 " * 30


@pytest.fixture(scope="module")
def lm() -> GatedAttnLM:
    return tiny_lm(TEXT + MERGED, 340)


def loglikelihood(lm: GatedAttnLM, context: str, continuation: str) -> tuple[float, bool]:
    ((logprob, greedy),) = lm.loglikelihood([request("loglikelihood", context, continuation)])
    return logprob, greedy


@pytest.mark.parametrize(
    ("context", "continuation", "tokens"),
    [
        ("x = im", "port", ["x", "Ġ=", "Ġimport"]),  # inside a word
        ("le caf", "é", ["le", "ĠcafÃ©"]),  # before a two-byte character merged with the word
        ("a 😀", "😀", ["a", "ĠðŁĺĢðŁĺĢ"]),  # between two emoji whose eight bytes are one token
    ],
)
def test_a_token_that_straddles_the_boundary_is_scored_with_the_continuation(
    lm: GatedAttnLM, context: str, continuation: str, tokens: list[str]
) -> None:
    whole = lm.tokenizer.encode(context + continuation)
    assert whole.tokens == tokens  # the last token holds the end of the context
    # lm-eval's own split cuts off as many tokens as the context encodes to alone: nothing is left.
    assert TemplateLM._encode_pair(lm, context, continuation)[1] == []
    assert lm._encode_pair(context, continuation) == (whole.ids[:-1], whole.ids[-1:])
    logprob, greedy = loglikelihood(lm, context, continuation)
    assert logprob == pytest.approx(direct_logprob(lm, whole.ids, 1), abs=1e-5)
    assert logprob < 0
    assert isinstance(greedy, bool)


def test_a_boundary_inside_a_combining_sequence_splits_between_its_characters(lm: GatedAttnLM) -> None:
    context, continuation = "le cafe", "\u0301"  # e + COMBINING ACUTE ACCENT (two bytes)
    whole = lm.tokenizer.encode(context + continuation)
    assert whole.tokens == ["le", "Ġcafe", "Ìģ"]
    assert lm._encode_pair(context, continuation) == (whole.ids[:2], whole.ids[2:])
    logprob, _ = loglikelihood(lm, context, continuation)
    assert logprob == pytest.approx(direct_logprob(lm, whole.ids, 1), abs=1e-5)
    assert logprob < 0


def test_trailing_context_spaces_move_to_the_continuation_as_in_lm_eval(lm: GatedAttnLM) -> None:
    whole = lm.tokenizer.encode("the cat sat on  the mat")
    assert whole.tokens == ["the", "Ġcat", "Ġsat", "Ġon", "Ġ", "Ġthe", "Ġmat"]
    expected = direct_logprob(lm, whole.ids, 3)  # " ", " the", " mat"
    for context, continuation in [("the cat sat on  ", "the mat"), ("the cat sat on ", " the mat")]:
        assert lm._encode_pair(context, continuation) == (whole.ids[:4], whole.ids[4:])
        assert loglikelihood(lm, context, continuation)[0] == pytest.approx(expected, abs=1e-5)
    # One space before the continuation: the same split either side of the boundary.
    one = lm.tokenizer.encode("the cat sat on the mat").ids
    assert lm._encode_pair("the cat sat on ", "the mat") == lm._encode_pair("the cat sat on", " the mat")
    assert lm._encode_pair("the cat sat on", " the mat") == (one[:4], one[4:])


def test_the_split_equals_lm_evals_wherever_the_context_encodes_alone_to_a_prefix(lm: GatedAttnLM) -> None:
    pairs = [
        ("the cat sat on", " the mat"),
        ("the cat sat on ", "the mat"),
        ("a dog", " ran in the park"),
        ("le cafe", "\u0301"),
        ("the sky is\n", "blue"),
    ]
    for context, continuation in pairs:
        theirs = TemplateLM._encode_pair(lm, context, continuation)
        assert lm.tok_encode(context + continuation)[: len(theirs[0])] == theirs[0]  # well defined
        assert lm._encode_pair(context, continuation) == theirs
    # Where it is not, theirs drops the straddling token and what follows it; ours scores both.
    x_import_os = lm.tok_encode("x = import os")
    assert TemplateLM._encode_pair(lm, "x = im", "port os")[1] == []
    assert lm._encode_pair("x = im", "port os") == (x_import_os[:2], x_import_os[2:])


def test_an_empty_context_is_the_end_of_text_token(lm: GatedAttnLM) -> None:
    tokens = lm.tok_encode("the cat")
    assert lm._encode_pair("", "the cat") == ([lm.eot_token_id], tokens)
    assert lm._encode_pair("  ", "the cat") == ([lm.eot_token_id], lm.tok_encode("  the cat"))
    logprob, _ = loglikelihood(lm, "", "the cat")
    assert logprob == pytest.approx(direct_logprob(lm, [lm.eot_token_id, *tokens], len(tokens)), abs=1e-5)


def test_an_empty_continuation_is_an_error_naming_the_request(lm: GatedAttnLM) -> None:
    with pytest.raises(ValueError, match=r"context 'the cat sat', continuation ''\): an empty continuation"):
        loglikelihood(lm, "the cat sat", "")
    with pytest.raises(ValueError, match=r"token pair 1: no continuation tokens"):
        lm._score([([5], [6]), ([5, 6], [])])
    with pytest.raises(ValueError, match=r"token pair 0: no context tokens"):
        lm._score([([], [6])])


def test_a_continuation_longer_than_the_window_is_scored_in_windows_of_preceding_tokens(
    lm: GatedAttnLM,
) -> None:
    context, continuation = lm._encode_pair("the", " " + TEXT[:300])
    assert len(continuation) > WINDOW
    whole = context + continuation
    # piece k: continuation tokens [k W, (k+1) W), after the W (or fewer) tokens before them
    expected, at = 0.0, 0
    while at < len(continuation):
        n = min(WINDOW, len(continuation) - at)
        end = len(context) + at + n
        window = whole[max(0, end - WINDOW - 1) : end]
        expected += direct_logprob(lm, window, n)
        at += n
    logprob, greedy = loglikelihood(lm, "the", " " + TEXT[:300])
    assert logprob == pytest.approx(expected, abs=1e-4)
    assert greedy is False


def test_an_empty_document_totals_zero_and_a_word_split_nowhere_is_scored_whole(lm: GatedAttnLM) -> None:
    assert lm.loglikelihood_rolling([request("loglikelihood_rolling", "")]) == [0.0]
    tokens = lm.tok_encode("x = import os")
    (total,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", "x = import os")])
    assert total == pytest.approx(direct_logprob(lm, [lm.eot_token_id, *tokens], len(tokens)), abs=1e-5)
    assert total < 0
