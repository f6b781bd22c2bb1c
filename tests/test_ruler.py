"""RULER's synthetic tasks (sweep/eval/ruler.py) on a tiny untrained model, offline: the key names
and scores in [0, 1]; wrong arguments and missing packages are one-line errors. The end-to-end
test needs the ``ruler`` extra (``pip install -e '.[ruler]'``) and is skipped without it."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments.config import ModelConfig
from experiments.model import GatedLM
from sweep.eval import ruler

# Words of RULER's needle template and haystack, so that a 400-token BPE sizes a sample in 512.
TEXT = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards. One of the special magic numbers for word is: 1234567. "
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "What is the special magic number for word mentioned in the provided text? 0123456789 "
) * 20
LENGTH = 512


def tiny(window: int = LENGTH) -> tuple[GatedLM, Tokenizer]:
    """A 2-layer untrained model (seed 0) of ``window`` positions and a byte-level BPE on ``TEXT``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        ffn_dim=64, max_seq_len=window,
    )  # fmt: skip
    return GatedLM(cfg), tok


@pytest.mark.skipif(
    bool(ruler.missing_packages()),
    reason=f"RULER needs {', '.join(ruler.missing_packages())}: {ruler.INSTALL}",
)
def test_a_needle_task_scores_each_length_under_its_key() -> None:
    torch.set_num_threads(1)
    model, tok = tiny()
    scores = ruler.ruler_scores(
        model, tok, ["niah_single_1"], [LENGTH], limit=2, device="cpu", suffix="/yarn"
    )
    assert list(scores) == [f"longctx/niah_single_1/{LENGTH}/yarn"]
    assert all(math.isfinite(s) and 0 <= s <= 1 for s in scores.values())


def test_an_unknown_task_or_a_length_past_the_window_is_a_one_line_error() -> None:
    model, tok = tiny(window=256)
    with pytest.raises(
        ValueError, match=r"^unknown RULER task\(s\) niah_single_2; known: niah_single_1,"
    ) as err:
        ruler.ruler_scores(model, tok, ["niah_single_1", "niah_single_2"], [256], limit=1)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^RULER: length\(s\) \[512\] outside 256\.\.256"):
        ruler.ruler_scores(model, tok, ["vt"], [256, 512], limit=1)


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ruler, "PACKAGES", ("no_such_package_for_ruler",))
    model, tok = tiny(window=256)
    with pytest.raises(
        ruler.RulerUnavailable, match=r"no_such_package_for_ruler: pip install -e '\.\[ruler\]'"
    ):
        ruler.ruler_scores(model, tok, ["fwe"], [256], limit=1)
