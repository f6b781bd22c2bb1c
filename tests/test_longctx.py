"""Long-context evaluation (experiments/longctx.py, experiments/passkey.py) on constructed models."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from experiments import names as N
from experiments.config import DataConfig, ModelConfig
from experiments.corpus import Corpus, build_corpus
from experiments.longctx import LongContextConfig, evaluate_long_context
from experiments.model import GatedLM, KVCache, YarnScaling
from experiments.passkey import passkey_scores, score_candidates
from experiments.probes import first_token_floor
from experiments.strict import ConfigError, from_dict
from tests.support import ROOT

SHAPE = ModelConfig(
    vocab_size=512, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32, max_seq_len=64
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """The tests' small real corpus (vocabulary 512; its 'code' test split has < 2049 tokens)."""
    return build_corpus(DataConfig(vocab_size=512, max_chars_per_source=200000), ROOT / ".cache")


def tiny(seed: int = 0) -> GatedLM:
    torch.manual_seed(seed)
    return GatedLM(SHAPE)


class CopyModel(nn.Module):
    """Induction by longest match: at position t, find the earlier position j whose token equals
    token t with the longest run of equal tokens before both (the most recent on ties) and put the
    mass on token j + 1. Keeps its token history in the KVCache (layer 0's keys), so
    ``KVCache.keep`` copies it with the rows."""

    def __init__(self, vocab: int, cap: int = 16) -> None:
        super().__init__()
        self.vocab, self.cap = vocab, cap
        self.blocks = nn.ModuleList([nn.Identity()])

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t = tokens.shape
        history = tokens
        if cache is not None:
            ids = tokens[:, None, :, None].double()
            history = cache.extend(0, ids, ids)[0][:, 0, :, 0].long()
            cache.length += t
        n = history.shape[1]
        eq = history[:, :, None] == history[:, None, :]  # (B, n, n)
        alive, run = eq.clone(), eq.long()
        for k in range(1, self.cap):  # run[b, i, j]: equal tokens ending at i and at j
            shifted = torch.zeros_like(eq)
            shifted[:, k:, k:] = eq[:, :-k, :-k]
            alive &= shifted
            run += alive
        earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)  # j < i
        score = torch.where(eq & earlier, run * n + torch.arange(n), -1)[:, n - t :]  # (B, t, n)
        best = score.argmax(dim=-1)
        predicted = history.gather(1, (best + 1).clamp(max=n - 1))  # the token after the match
        found = score.amax(dim=-1) >= 0
        logits = torch.zeros(b, t, self.vocab)
        logits.scatter_(-1, predicted[..., None], torch.where(found, 20.0, 0.0)[..., None])
        return logits


def test_copy_model_retrieves_every_passkey(corpus: Corpus) -> None:
    rows = passkey_scores(
        CopyModel(corpus.vocab_size), corpus.tokenizer(), corpus.eos_id, 192, (0.1, 0.5, 0.9), 2, 10, 5
    )
    assert [r["depth"] for r in rows] == [0.1, 0.5, 0.9]
    assert all(r["score"] == 1.0 and r["top1"] == 1.0 and r["margin"] > 0 for r in rows)
    assert rows[0]["needle_at"] < rows[1]["needle_at"] < rows[2]["needle_at"]


def test_uniform_model_scores_chance_and_vocabulary_ppl(corpus: Corpus) -> None:
    model = tiny()
    model.norm.weight.data.zero_()  # every logit exactly 0
    model.train()
    rope = model.rope
    cfg = LongContextConfig(lengths=(2, 32), windows=2, trials=2)
    result = evaluate_long_context(model, corpus, base_len=64, yarn_original=64, cfg=cfg)
    assert model.rope is rope and model.training and model.max_seq_len == 64
    for yarn in (False, True):
        for length in (128, 2048):
            assert result.metrics[N.longctx_key("passkey", length, yarn)] == 0.5
            top1 = result.metrics[N.longctx_key("passkey_top1", length, yarn)]
            assert top1 == pytest.approx(1 / cfg.candidates, abs=1e-12)
            for domain in ("law", "literature"):
                ppl = result.metrics[N.longctx_key(N.longctx_ppl_task(domain), length, yarn)]
                assert ppl == pytest.approx(corpus.vocab_size, rel=1e-5)
        assert result.metrics[N.longctx_key("ppl_avg", 128, yarn)] == pytest.approx(
            corpus.vocab_size, rel=1e-5
        )
        # 'code' has fewer than 2049 test tokens: skipped, and with it the average
        assert N.longctx_key("ppl_code", 2048, yarn) not in result.metrics
        assert N.longctx_key("ppl_avg", 2048, yarn) not in result.metrics
        skipped = {(s["what"], s["length"]) for s in result.skipped if s["yarn"] == yarn}
        assert skipped == {("ppl_code", 2048), ("ppl_avg", 2048)}
    assert len(result.passkey) == 2 * 2 * len(cfg.depths)
    assert all(N.parse_longctx_key(k) is not None for k in result.metrics)


def test_ppl_and_f_attn_equal_a_recomputation_by_hand(corpus: Corpus) -> None:
    model = tiny(1)
    cfg = LongContextConfig(lengths=(2,), windows=2, trials=1, depths=(0.5,), batch_size=1)
    result = evaluate_long_context(model, corpus, base_len=64, yarn_original=64, cfg=cfg)
    tokens = torch.from_numpy(np.asarray(corpus.tokens("test", "law")[: 2 * 128 + 1], dtype=np.int64))
    windows = torch.stack([tokens[:129], tokens[128:257]])  # consecutive windows share one token
    for yarn in (False, True):
        model.set_rope(max_seq_len=128, yarn=YarnScaling(4.0, 64) if yarn else None)
        with torch.no_grad():
            logp = model(windows[:, :-1]).log_softmax(-1).gather(-1, windows[:, 1:, None])
        expected = math.exp(-logp.double().mean().item())
        assert result.metrics[N.longctx_key("ppl_law", 128, yarn)] == pytest.approx(expected, rel=1e-6)
        f_attn = result.metrics[N.longctx_key("f_attn", 128, yarn)]
        assert result.metrics[N.longctx_key("f_attn_ratio", 128, yarn)] == pytest.approx(
            f_attn / first_token_floor(128)
        )
    assert (
        result.metrics[N.longctx_key("ppl_law", 128, False)]
        != result.metrics[N.longctx_key("ppl_law", 128, True)]
    )


def test_cached_candidate_scores_equal_full_forwards() -> None:
    model = tiny(2).eval()
    prefix = torch.arange(40) % 50 + 3
    candidates = torch.tensor([[7, 8, 9], [7, 9, 8], [100, 3, 4]])
    got = score_candidates(model, prefix, candidates)
    for c, score in zip(candidates, got):
        full = torch.cat([prefix, c])[None]
        with torch.no_grad():
            logp = model(full[:, :-1]).log_softmax(-1)[0, -3:].gather(-1, c[:, None])
        assert score.item() == pytest.approx(logp.double().sum().item(), abs=1e-4)


def test_passkey_is_deterministic_given_the_seed(corpus: Corpus) -> None:
    model, tok = tiny(3).eval(), corpus.tokenizer()
    model.set_rope(max_seq_len=128)
    first = passkey_scores(model, tok, corpus.eos_id, 128, (0.5,), 2, 4, 5, seed=7)
    assert passkey_scores(model, tok, corpus.eos_id, 128, (0.5,), 2, 4, 5, seed=7) == first
    assert passkey_scores(model, tok, corpus.eos_id, 40, (0.5,), 1, 4, 5) is None  # no room for the needle


def test_metric_names_round_trip() -> None:
    for task in (*N.LONGCTX_TASKS, N.longctx_ppl_task("literature")):
        for length in (128, 2048):
            plain, yarn = N.longctx_key(task, length), N.longctx_key(task, length, yarn=True)
            assert plain != yarn and not yarn.startswith(plain + "/")
            assert N.parse_longctx_key(plain) == (task, length, False)
            assert N.parse_longctx_key(yarn) == (task, length, True)
    assert N.longctx_key("passkey", 2048, True) == "longctx/passkey/2048.yarn"
    assert N.parse_longctx_key(N.VAL_PPL_AVG) is None and N.parse_longctx_key("longctx/passkey/x") is None
    with pytest.raises(ValueError):
        N.longctx_key("ppl/avg", 128)


@pytest.mark.parametrize(
    "data, key",
    [
        ({"lengths": []}, "lengths"),
        ({"lengths": [1, 0]}, "lengths"),
        ({"yarn_factor": 0.5}, "yarn_factor"),
        ({"depths": [0.5, 1.5]}, "depths"),
        ({"windows": 0}, "windows"),
        ({"candidates": 1}, "candidates"),
        ({"key_digits": 1, "candidates": 5}, "candidates"),
        ({"key_digits": 0}, "key_digits"),
    ],
)
def test_bad_config_values_name_their_key(data: dict, key: str) -> None:
    assert from_dict(LongContextConfig, {}) == LongContextConfig()
    with pytest.raises(ConfigError) as err:
        from_dict(LongContextConfig, data, "longctx")
    assert err.value.path == f"longctx.{key}"


def test_config_is_a_plain_dataclass() -> None:
    cfg = from_dict(LongContextConfig, {"lengths": [1, 4], "depths": [0.25], "yarn_factor": 8})
    assert cfg.lengths == (1, 4) and cfg.depths == (0.25,) and cfg.yarn_factor == 8.0
    assert dataclasses.replace(cfg, trials=2).trials == 2
