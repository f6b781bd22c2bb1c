"""Long-context evaluation of a finished model, with and without YaRN (Table 5 of Qiu et al.).

The paper extends its models with YaRN (Peng et al. 2023) and scores RULER from 4k to 128k; the
baseline loses accuracy after YaRN even inside its training window, the gated model barely. RULER is
greedy generation, on which tiny models score zero, so this module gives graded signals instead, at
each evaluation length ``L`` (a multiple of a base context), once with the model's own RoPE and once
with YaRN:

- **PPL per domain** on the first windows of ``L + 1`` tokens of each domain's test split, and
  their mean (the paper's "Avg PPL", as ``val/ppl/avg``);
- **passkey retrieval** scored by log-likelihood (``experiments.passkey``): the true key's summed
  log-likelihood after the classic passkey prompt (Mohtashami & Jaggi 2023), against distractors;
- **F-Attn** (attention on token 0) on one window, and its ratio to uniform attention's floor.

Metric keys: ``names.longctx_key(task, L, yarn)``, e.g. ``longctx/passkey/2048.yarn``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from experiments import names as N
from experiments.corpus import Corpus
from experiments.corpus.reader import CorpusError
from experiments.devices import scoring_precision
from experiments.longctx_config import LongContextConfig
from experiments.model import GatedLM, YarnScaling
from experiments.passkey import passkey_scores
from experiments.probes import first_token_floor, run_probes
from experiments.strict import to_dict


@dataclass
class LongContextResult:
    """The scores of one model.

    Attributes:
        metrics: ``names.longctx_key(task, L, yarn)`` -> value (PPL; retrieval in [0, 1]; F-Attn).
        ppl: one row per (length, yarn, domain): ``ppl``, ``windows``, ``tokens`` predicted.
        passkey: one row per (length, yarn, depth): ``score``, ``top1``, ``margin`` (nats, true key
            minus mean distractor), ``needle_at`` (token index of the needle in the first trial).
        f_attn: one row per (length, yarn): ``f_attn``, ``floor``, ``ratio``, ``domain``.
        skipped: what was not measured: ``length``, ``yarn``, ``what``, ``why``.
        setup: base length, YaRN's original length, the config and the seed.
        seconds: wall time of the evaluation.
    """

    metrics: dict[str, float] = field(default_factory=dict)
    ppl: list[dict[str, Any]] = field(default_factory=list)
    passkey: list[dict[str, Any]] = field(default_factory=list)
    f_attn: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def records(self) -> dict[str, Any]:
        """Everything, JSON-ready (the artifact ``longctx.json``)."""
        return dataclasses.asdict(self)

    def save(self, folder: Path) -> Path:
        """Write :meth:`records` to ``folder/longctx.json``; return its path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "longctx.json"
        path.write_text(json.dumps(self.records(), indent=1) + "\n")
        return path


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


# --- perplexity --------------------------------------------------------------------------------------


def domain_windows(corpus: Corpus, domain: str, length: int, windows: int) -> torch.Tensor | None:
    """The first ``windows`` windows of ``length + 1`` tokens of ``domain``'s test split, (N, L + 1)
    int64, consecutive ones overlapping by one token (as validation's); a synthetic task's start at
    its sequences. Fewer when the split is short; None when not even one fits."""
    tokens = corpus.tokens("test", domain)
    stride = corpus.sequence_tokens or length
    if len(tokens) < length + 1 or (corpus.sequence_tokens or math.inf) < length + 1:
        return None
    n = min(windows, (len(tokens) - length - 1) // stride + 1)
    starts = np.arange(n) * stride
    return torch.from_numpy(np.asarray(tokens[starts[:, None] + np.arange(length + 1)], dtype=np.int64))


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """``exp`` of the mean next-token NLL (nats) over every predicted token of ``windows`` (N, T + 1)."""
    nll, count, device = 0.0, 0, _device(model)
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size].to(device)
        logits = model(batch[:, :-1]).float()  # (B, T, V)
        nll += float(
            nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        )
        count += batch[:, 1:].numel()
    return math.exp(nll / count)


# --- the evaluation ----------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_long_context(
    model: GatedLM, corpus: Corpus, base_len: int, yarn_original: int, cfg: LongContextConfig, seed: int = 0
) -> LongContextResult:
    """Score ``model`` at every length ``L = m * base_len`` (``m`` in ``cfg.lengths``), with its own
    RoPE and with YaRN (``factor = cfg.yarn_factor``, ``original_max_position = yarn_original``,
    the model's theta): PPL per domain and their mean, passkey retrieval, F-Attn (see the module
    docstring). Runs in eval mode without gradients; the model's RoPE tables and train mode are
    restored after. A domain whose test split is shorter than ``L + 1`` tokens is skipped (and
    ``ppl_avg`` then left out: it averages every domain); so is passkey retrieval when the corpus
    has no tokenizer or the prompt does not fit in ``L``; each skip is recorded in ``skipped``.
    Source: Table 5 of Qiu et al. (YaRN after training, scored by length); YaRN: Peng et al. 2023.
    About 20 s on one CPU thread for a 4-layer d=128 model at 128..2048 tokens with the defaults.

    Returns:
        The metrics under ``names.longctx_key(task, L, yarn)`` (tasks ``ppl_avg``, ``ppl_<domain>``,
        ``passkey``, ``passkey_top1``, ``f_attn``, ``f_attn_ratio``) and the per-depth detail.

    Raises:
        ValueError: ``base_len`` or ``yarn_original`` < 1.
    """
    if base_len < 1 or yarn_original < 1:
        raise ValueError(f"base_len and yarn_original must be >= 1, got {base_len} and {yarn_original}")
    clock = time.perf_counter()
    lengths = sorted({m * base_len for m in cfg.lengths})
    setup = {"base_len": base_len, "yarn_original": yarn_original, "config": to_dict(cfg), "seed": seed}
    result = LongContextResult(setup=setup)
    try:
        tokenizer = corpus.tokenizer()
    except CorpusError:  # a synthetic task
        tokenizer = None
    rope, was_training = model.rope, model.training
    model.eval()
    try:
        for yarn in (False, True):
            scaling = YarnScaling(cfg.yarn_factor, yarn_original) if yarn else None
            model.set_rope(theta=rope.theta, max_seq_len=lengths[-1], yarn=scaling)
            for length in lengths:
                with scoring_precision(_device(model)):  # bf16 on CUDA (8k-token attention), fp32 on CPU
                    _one_length(model, corpus, tokenizer, length, yarn, cfg, seed, result)
    finally:
        model.rope = rope
        model.train(was_training)
    result.seconds = time.perf_counter() - clock
    return result


def _one_length(
    model: GatedLM,
    corpus: Corpus,
    tokenizer: Any,
    length: int,
    yarn: bool,
    cfg: LongContextConfig,
    seed: int,
    result: LongContextResult,
) -> None:
    def log(task: str, value: float) -> None:
        result.metrics[N.longctx_key(task, length, yarn)] = value

    def skip(what: str, why: str) -> None:
        result.skipped.append({"length": length, "yarn": yarn, "what": what, "why": why})

    ppl, probe = {}, None
    for domain in corpus.domains:
        windows = domain_windows(corpus, domain, length, cfg.windows)
        if windows is None:
            skip(N.longctx_ppl_task(domain), f"test split of '{domain}' has no window of {length + 1} tokens")
            continue
        probe = (domain, windows[0, :length]) if probe is None else probe
        ppl[domain] = perplexity(model, windows, cfg.batch_size)
        log(N.longctx_ppl_task(domain), ppl[domain])
        row = {"windows": len(windows), "tokens": len(windows) * length}
        result.ppl.append({"length": length, "yarn": yarn, "domain": domain, "ppl": ppl[domain]} | row)
    if len(ppl) == len(corpus.domains):
        log("ppl_avg", sum(ppl.values()) / len(ppl))
    else:
        skip("ppl_avg", "a domain was skipped")

    if probe is None:
        skip("f_attn", "no domain has a window")
    else:
        f_attn, floor = run_probes(model, probe[1][None]).summary[N.F_ATTN], first_token_floor(length)
        log("f_attn", f_attn)
        log("f_attn_ratio", f_attn / floor)
        row = {"domain": probe[0], "f_attn": f_attn, "floor": floor, "ratio": f_attn / floor}
        result.f_attn.append({"length": length, "yarn": yarn} | row)

    if tokenizer is None:
        skip("passkey", "the corpus has no tokenizer (a synthetic task)")
        return
    rows = passkey_scores(
        model, tokenizer, corpus.eos_id, length, cfg.depths, cfg.trials, cfg.candidates, cfg.key_digits, seed
    )
    if rows is None:
        skip("passkey", f"needle and question do not fit in {length} tokens")
        return
    log("passkey", float(np.mean([r["score"] for r in rows])))
    log("passkey_top1", float(np.mean([r["top1"] for r in rows])))
    result.passkey += [{"length": length, "yarn": yarn} | r for r in rows]
