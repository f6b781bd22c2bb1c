"""What the paper measured inside the model (Sections 4.1-4.3, Table 4, Figures 2-5), on a probe batch.

Per layer ``l`` of the probe batch (the same held-out tokens for every run of a corpus):

- **Gate score** (Table 4, Figures 3 and 7): mean, quantiles and fractions below 0.1 / 0.5 of
  the gate's scores act(XW); per head for headwise and head-specific gates. The table's value
  is the mean over layers. Only multiplicative gates have scores: an additive gate's act(XW) is
  an offset, not a factor in [0, 1], so it gets no gate statistics.
- **F-Attn** (Table 4, Figure 2): attention probability on key position 0, averaged over
  heads, query positions and sequences (the paper's "first-token attention"; query 0, which can
  only attend to itself, is included as in the reference reproduction's "paper_style").
  Computed with an explicit softmax in probe mode; training keeps SDPA.
- **M-Act** (Table 4, Figure 6): the largest |activation| of the residual stream after layer
  ``l``; the table's value is the mean over layers.
- **SDPA output** (Figures 4 and 5): mean |Y| before and after a G1 gate, and the fraction of
  |values| of the gated output (the input of ``W_O``) below 1e-2 and 1e-3, beside the paper's
  control: the pre-gate values times the layer's mean gate score. Without a G1 gate, "before"
  and "after" are the same tensor and there is no control.

Quantiles are exact when a layer has at most :data:`QUANTILE_SAMPLES` scores on the probe
batch, and otherwise taken over a seeded uniform sample (with replacement) of about that many,
drawn in proportion to each chunk's size; every other statistic is exact.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from experiments import names as N
from experiments.corpus import Corpus
from experiments.model import GatedLM

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
SCORE_THRESHOLDS = (0.1, 0.5)
SPARSITY_THRESHOLDS = (1e-2, 1e-3)
QUANTILE_SAMPLES = 1_000_000
HIST_BINS = 50  # gate-score histogram over [0, 1]; scores outside fall into the end bins
LATE_QUERY = 16  # the late F-Attn leaves out queries 0..15, which attend to token 0 by necessity
ATTENTION_BUDGET = 2**28  # attention probabilities per layer one probe forward may hold (1 GiB fp32)


# --- the statistics, as pure functions --------------------------------------------------------------


def first_token_attention(probs: torch.Tensor) -> torch.Tensor:
    """Attention mass on key 0 per head, averaged over sequences and query positions.

    Args:
        probs: (B, H, T, S) attention probabilities (rows summing to 1 over all T keys), of
            which only key 0 is read: the full map (S = T) or the column probe mode keeps (S = 1).

    Returns:
        (H,) float64.
    """
    return probs[..., 0].double().mean(dim=(0, 2))


def first_token_floor(seq_len: int, skip: int = 0) -> float:
    """F-Attn of uniform causal attention: query ``t`` (0-based) spreads over ``t + 1`` keys, so it
    puts ``1 / (t + 1)`` on key 0; the mean over queries ``skip .. seq_len - 1`` is
    ``(H_T - H_skip) / (T - skip)`` with ``H_n`` the n-th harmonic number (0.042 at T = 128).

    Raises:
        ValueError: ``skip`` not in ``[0, seq_len)``.
    """
    if not 0 <= skip < seq_len:
        raise ValueError(f"skip must be in [0, {seq_len}), got {skip}")
    return math.fsum(1.0 / (t + 1) for t in range(skip, seq_len)) / (seq_len - skip)


def late_query_start(seq_len: int) -> int:
    """The first query position of the late F-Attn: :data:`LATE_QUERY`, or half of a shorter
    sequence."""
    return min(LATE_QUERY, seq_len // 2)


def max_abs_activation(hidden: torch.Tensor) -> float:
    """M-Act of one layer: ``max |h|`` over a (B, T, d) residual-stream output."""
    return float(hidden.abs().max())


def score_summary(scores: np.ndarray) -> dict[str, float]:
    """Mean, quantiles and fractions below the thresholds of a flat array of gate scores.

    Keys: ``score_mean``, ``score_q01`` .. ``score_q99``, ``frac_below_0.1``, ``frac_below_0.5``.
    """
    out = {"score_mean": float(scores.mean())}
    for q, v in zip(QUANTILES, np.quantile(scores, QUANTILES)):
        out[f"score_q{round(q * 100):02d}"] = float(v)
    for t in SCORE_THRESHOLDS:
        out[f"frac_below_{t}"] = float((scores < t).mean())
    return out


# --- the probe batch --------------------------------------------------------------------------------


def probe_batch(corpus: Corpus, seq_len: int, per_domain: int) -> tuple[torch.Tensor, dict]:
    """The fixed probe batch: the first ``per_domain`` windows of ``seq_len`` tokens of each
    domain's test split (of a synthetic task: the first ``seq_len`` tokens of its first
    ``per_domain`` sequences), domains in sorted order.

    The record (split, windows per domain, sha256 of the tokens) is returned, and each run stores
    it (MLflow ``probe_batch.json``), so every run can show which tokens it was probed on. Nothing
    is written into the corpus: it is shared read-only data.

    Returns:
        ((N, seq_len) int64 tokens, record).

    Raises:
        ValueError: a domain's test split is shorter than one window.
    """
    windows, record = [], {"split": "test", "seq_len": seq_len, "domains": {}}
    stride = corpus.sequence_tokens or seq_len  # a synthetic task's windows start at its <bos>
    for domain in corpus.domains:
        tokens = corpus.tokens("test", domain)
        n = min(per_domain, (len(tokens) - seq_len) // stride + 1 if len(tokens) >= seq_len else 0)
        if n == 0:
            raise ValueError(f"test split of '{domain}' has {len(tokens)} tokens, fewer than {seq_len}")
        starts = np.arange(n) * stride
        block = np.asarray(tokens[starts[:, None] + np.arange(seq_len)], dtype=np.int64)
        windows.append(block)
        record["domains"][domain] = {"windows": n, "first_token": 0}
    batch = np.concatenate(windows)
    record["sha256"] = hashlib.sha256(batch.tobytes()).hexdigest()
    return torch.from_numpy(batch), record


# --- running the probes -----------------------------------------------------------------------------


@dataclass
class _LayerStats:
    """Running sums of one layer over the probe chunks."""

    f_attn_sum: torch.Tensor | None = None  # (H,) float64
    f_attn_n: int = 0
    f_attn_late_sum: float = 0.0
    f_attn_late_n: int = 0
    m_act: float = 0.0
    pre_abs_sum: float = 0.0
    post_abs_sum: float = 0.0
    post_below: dict[float, int] = field(default_factory=dict)
    control_below: dict[float, int] = field(default_factory=dict)
    values_n: int = 0
    head_score_sum: torch.Tensor | None = None  # (H_g,) float64
    head_score_n: int = 0
    scores: list[np.ndarray] = field(default_factory=list)  # samples for the quantiles
    score_sum: float = 0.0
    score_n: int = 0
    score_below: dict[float, int] = field(default_factory=dict)
    hist: np.ndarray = field(default_factory=lambda: np.zeros(HIST_BINS, dtype=np.int64))


@dataclass
class ProbeResult:
    """The probes of one model on one probe batch.

    Attributes:
        summary: scalar metrics under their MLflow keys (layer means), e.g. ``gate/score_mean``.
        layers: per-layer series, e.g. ``layers["f_attn"][l]``.
        heads: per-layer, per-head series (``f_attn``; ``gate_score`` for gated models).
        gate_hist: (L, HIST_BINS) gate-score counts over [0, 1], or None without gate scores.
    """

    summary: dict[str, float]
    layers: dict[str, list[float]]
    heads: dict[str, list[list[float]]]
    gate_hist: np.ndarray | None

    #: per-layer series that also go to MLflow as ``<key>.layer_<ll>`` (``names.layer_key``)
    LAYER_METRICS = {
        "gate_score_mean": N.GATE_SCORE_MEAN,
        "f_attn": N.F_ATTN,
        "f_attn_late": N.F_ATTN_LATE,
        "m_act": N.M_ACT_LAYER,
        "sdpa_abs_mean_pre": N.SDPA_ABS_PRE,
        "sdpa_abs_mean_post": N.SDPA_ABS_POST,
    }

    def metrics(self) -> dict[str, float]:
        """Summary plus per-layer metrics, e.g. ``sink/first_token_attn.layer_03``: a bounded key set."""
        out = dict(self.summary)
        for name, key in self.LAYER_METRICS.items():
            for layer, value in enumerate(self.layers.get(name, [])):
                out[N.layer_key(key, layer)] = value
        return out

    def save(self, folder: Path) -> list[Path]:
        """Write ``probes.json`` (everything but the histogram) and ``gate_hist.npz``; return paths."""
        folder.mkdir(parents=True, exist_ok=True)
        paths = [folder / "probes.json"]
        payload = {"summary": self.summary, "layers": self.layers, "heads": self.heads}
        paths[0].write_text(json.dumps(payload, indent=1) + "\n")
        if self.gate_hist is not None:
            paths.append(folder / "gate_hist.npz")
            np.savez(paths[1], counts=self.gate_hist, edges=np.linspace(0.0, 1.0, HIST_BINS + 1))
        return paths


@torch.no_grad()
def run_probes(model: GatedLM, tokens: torch.Tensor, chunk: int | None = None, seed: int = 0) -> ProbeResult:
    """Probe ``model`` on ``tokens`` (N, T), on the model's device, in float32.

    The model is put in probe mode (explicit softmax, residual stream and gate scores kept) for
    the call and restored after, train/eval mode included. Runs twice over the batch when the
    model has a multiplicative G1 gate: the Figure 5 control needs each layer's mean score first.

    Args:
        chunk: sequences per forward pass; default: as many as keep one layer's (chunk, H, T, T)
            attention map within :data:`ATTENTION_BUDGET` entries (at least one).
    """
    heads, t = model.cfg.n_heads, tokens.shape[1]
    chunk = chunk or max(1, ATTENTION_BUDGET // (heads * t * t))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    attns = [b.attn for b in model.blocks]
    gates = [a.gate for a in attns]
    gated = gates[0] is not None and gates[0].cfg.kind == "gate" and gates[0].cfg.combine == "multiplicative"
    g1 = gated and gates[0].cfg.position == "sdpa"
    captured: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(len(attns))}
    hooks = []
    for i, a in enumerate(attns):
        hooks.append(a.o_proj.register_forward_pre_hook(_capture(captured[i], "post")))
        if a.gate is not None and a.gate.cfg.position == "sdpa":
            hooks.append(a.gate.register_forward_pre_hook(_capture(captured[i], "pre")))
    stats = [_LayerStats() for _ in attns]
    generator = torch.Generator().manual_seed(seed)
    _set_probe_mode(model, True)
    try:
        for start in range(0, len(tokens), chunk):
            model(tokens[start : start + chunk].to(device))
            for i, a in enumerate(attns):
                _accumulate(stats[i], a, model.hidden_states[i], captured[i], generator, len(tokens), gated)
        if g1:
            means = [s.score_sum / s.score_n for s in stats]
            for start in range(0, len(tokens), chunk):
                model(tokens[start : start + chunk].to(device))
                for i in range(len(attns)):
                    control = captured[i]["pre"].float() * means[i]
                    for t in SPARSITY_THRESHOLDS:
                        below = int((control.abs() < t).sum())
                        stats[i].control_below[t] = stats[i].control_below.get(t, 0) + below
    finally:
        _set_probe_mode(model, False)
        for h in hooks:
            h.remove()
        model.train(was_training)
    return _result(stats, gated, tokens.shape[1])


def _capture(store: dict[str, torch.Tensor], name: str):
    def hook(module: torch.nn.Module, args: tuple) -> None:
        store[name] = args[0].detach()

    return hook


def _set_probe_mode(model: GatedLM, on: bool) -> None:
    model.keep_hidden = on
    for block in model.blocks:
        block.attn.keep_attention = on
        block.attn.last_attention = None
        if block.attn.gate is not None:
            block.attn.gate.record = on
            block.attn.gate.recorded_scores = None
    if not on:
        model.hidden_states = []


def _accumulate(
    s: _LayerStats,
    attn: torch.nn.Module,
    hidden: torch.Tensor,
    captured: dict[str, torch.Tensor],
    generator: torch.Generator,
    n_total: int,
    gated: bool,
) -> None:
    probs = attn.last_attention  # (B, H, T, 1): the probabilities on key 0
    per_head = first_token_attention(probs) * probs.shape[0] * probs.shape[2]
    s.f_attn_sum = per_head if s.f_attn_sum is None else s.f_attn_sum + per_head
    s.f_attn_n += probs.shape[0] * probs.shape[2]
    late = probs[:, :, late_query_start(probs.shape[2]) :, 0]
    s.f_attn_late_sum += float(late.double().sum())
    s.f_attn_late_n += late.numel()
    m_act = max_abs_activation(hidden)
    s.m_act = math.nan if math.isnan(m_act) or math.isnan(s.m_act) else max(s.m_act, m_act)
    post = captured["post"].float()
    pre = captured.get("pre", post).float()
    s.values_n += post.numel()
    s.post_abs_sum += float(post.abs().double().sum())
    s.pre_abs_sum += float(pre.abs().double().sum())
    for t in SPARSITY_THRESHOLDS:
        s.post_below[t] = s.post_below.get(t, 0) + int((post.abs() < t).sum())
    gate = attn.gate
    if not gated or gate.recorded_scores is None:
        return
    scores = gate.recorded_scores.float()  # (B, T, H_g, W)
    s.score_sum += float(scores.double().sum())
    s.score_n += scores.numel()
    heads = scores.double().sum(dim=(0, 1, 3))
    s.head_score_sum = heads if s.head_score_sum is None else s.head_score_sum + heads
    s.head_score_n += scores.shape[0] * scores.shape[1] * scores.shape[3]
    for t in SCORE_THRESHOLDS:
        s.score_below[t] = s.score_below.get(t, 0) + int((scores < t).sum())
    flat = scores.flatten()
    s.hist += torch.histc(flat.clamp(0.0, 1.0), bins=HIST_BINS, min=0.0, max=1.0).long().cpu().numpy()
    per_layer = flat.numel() * n_total / scores.shape[0]  # this layer's scores on the whole batch
    if per_layer > QUANTILE_SAMPLES:
        keep = round(QUANTILE_SAMPLES * scores.shape[0] / n_total)
        flat = flat[torch.randint(flat.numel(), (keep,), generator=generator).to(flat.device)]
    s.scores.append(flat.cpu().numpy())


def _result(stats: list[_LayerStats], gated: bool, seq_len: int) -> ProbeResult:
    layers: dict[str, list[float]] = {
        "f_attn": [float(s.f_attn_sum.sum() / (s.f_attn_n * len(s.f_attn_sum))) for s in stats],
        "f_attn_late": [s.f_attn_late_sum / s.f_attn_late_n for s in stats],
        "m_act": [s.m_act for s in stats],
        "sdpa_abs_mean_pre": [s.pre_abs_sum / s.values_n for s in stats],
        "sdpa_abs_mean_post": [s.post_abs_sum / s.values_n for s in stats],
    }
    heads = {"f_attn": [(s.f_attn_sum / s.f_attn_n).tolist() for s in stats]}
    for t in SPARSITY_THRESHOLDS:
        layers[f"sdpa_below_{t:g}"] = [s.post_below[t] / s.values_n for s in stats]
        if stats[0].control_below:
            layers[f"control_below_{t:g}"] = [s.control_below[t] / s.values_n for s in stats]
    hist = None
    if gated:
        per_layer = [score_summary(np.concatenate(s.scores)) for s in stats]
        for key in per_layer[0]:
            layers[f"gate_{key}"] = [p[key] for p in per_layer]
        # Exact mean and fractions (the sample above only serves the quantiles).
        layers["gate_score_mean"] = [s.score_sum / s.score_n for s in stats]
        for t in SCORE_THRESHOLDS:
            layers[f"gate_frac_below_{t}"] = [s.score_below[t] / s.score_n for s in stats]
        heads["gate_score"] = [(s.head_score_sum / s.head_score_n).tolist() for s in stats]
        hist = np.stack([s.hist for s in stats])

    def mean(name: str) -> float:
        return float(np.mean(layers[name]))

    summary = {
        N.F_ATTN: mean("f_attn"),
        N.F_ATTN_LATE: mean("f_attn_late"),
        N.F_ATTN_FLOOR: first_token_floor(seq_len),
        N.F_ATTN_LATE_FLOOR: first_token_floor(seq_len, late_query_start(seq_len)),
        N.M_ACT: mean("m_act"),
        N.M_ACT_MAX: float(np.max(layers["m_act"])),
        N.SDPA_ABS_PRE: mean("sdpa_abs_mean_pre"),
        N.SDPA_ABS_POST: mean("sdpa_abs_mean_post"),
    }
    for t in SPARSITY_THRESHOLDS:
        summary[N.sparsity_key("sdpa", t)] = mean(f"sdpa_below_{t:g}")
        if f"control_below_{t:g}" in layers:
            summary[N.sparsity_key("control", t)] = mean(f"control_below_{t:g}")
    if gated:
        for name in layers:
            if name.startswith("gate_"):
                summary[N.GATE_PREFIX + name.removeprefix("gate_")] = mean(name)
    return ProbeResult(summary, layers, heads, hist)
