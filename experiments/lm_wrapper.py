"""Our checkpoints as an lm-evaluation-harness model (registered as ``gated-attn``).

``GatedAttnLM`` subclasses lm-eval's ``TemplateLM`` (an ``lm_eval.api.model.LM``): lm-eval splits
each (context, continuation) pair at the token boundary (``_encode_pair``: the whole string is
encoded, the context's tokens are cut off the front, trailing context spaces move to the
continuation), and we score the continuation tokens. Inputs longer than the model's window are
truncated from the left. Requests with the same input (a multiple-choice question's one-token
answers) share one forward pass. Generation is greedy, batched over prompts of equal length, with
a KV cache (each token is fed once), and stops at the first stop string (or EOS, or
``max_gen_toks``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer

from experiments.config import ModelConfig
from experiments.model import GatedLM, KVCache


@register_model("gated-attn")
class GatedAttnLM(TemplateLM):
    """lm-eval model over a :class:`GatedLM` and its corpus tokenizer.

    Args:
        model: the trained model (eval mode is set here).
        tokenizer: the corpus tokenizer; ``eot_id`` is its end-of-text token (id 0).
        batch_size: sequences per forward pass.
        max_gen_toks: default generation budget (a request's ``max_gen_toks`` overrides it).
        device: where to run (default: the model's device).
    """

    def __init__(
        self,
        model: GatedLM,
        tokenizer: Tokenizer,
        batch_size: int = 32,
        max_gen_toks: int = 64,
        eot_id: int = 0,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self._device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model.to(self._device)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self._eot = eot_id
        self.max_length = model.cfg.max_seq_len

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Path, model_cfg: ModelConfig, tokenizer_file: Path, **kwargs: Any
    ) -> GatedAttnLM:
        """Load ``final.ckpt`` (a Lightning checkpoint of ``LMModule``; weights under ``model.``)."""
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
        model = GatedLM(model_cfg)
        model.load_state_dict(
            {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        )
        return cls(model, Tokenizer.from_file(str(tokenizer_file)), **kwargs)

    @property
    def eot_token_id(self) -> int:
        return self._eot

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether it is the greedy continuation; the
        joined tokens keep their last ``max_length + 1``. Batched by equal length; only the
        continuation's positions are kept from each batch (a (T, V) matrix per request would
        not fit at a large vocabulary)."""
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)  # an empty continuation
        by_len: dict[int, list[tuple[int, list[int], int, list[int]]]] = defaultdict(list)
        for i, (context, continuation) in enumerate(pairs):
            whole = (context + continuation)[-(self.max_length + 1) :]
            n = min(len(continuation), len(whole) - 1)  # longer than the window: its end
            if n > 0:
                by_len[len(whole) - 1].append((i, whole[:-1], len(whole) - 1 - n, continuation[-n:]))
        for jobs in by_len.values():
            # Requests with the same input (a multiple-choice question's one-token answers) share
            # one forward pass.
            inputs: dict[tuple[int, ...], list[tuple[int, int, list[int]]]] = defaultdict(list)
            for i, row, at, continuation in jobs:
                inputs[tuple(row)].append((i, at, continuation))
            rows = list(inputs)
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                logits = self.model(torch.tensor(chunk, device=self._device)).float()
                for j, row in enumerate(chunk):
                    for i, at, continuation in inputs[row]:
                        logp = F.log_softmax(logits[j, at : at + len(continuation)], dim=-1).cpu()
                        target = torch.tensor(continuation)
                        logprob = logp.gather(-1, target[:, None]).sum().item()
                        results[i] = (logprob, bool((logp.argmax(-1) == target).all()))
        return results

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        return self._score([(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each document, in disjoint windows of ``max_length`` tokens,
        the first conditioned on EOS."""
        totals = []
        for (text,) in (r.args for r in requests):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
                )
            ]
            totals.append(sum(lp for lp, _ in self._score(windows)))
        return totals

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context until the first ``until`` string (not included),
        EOS, or ``max_gen_toks`` tokens."""
        jobs = []
        for context, gen_kwargs in (r.args for r in requests):
            until = gen_kwargs.get("until") or []
            until = [u for u in ([until] if isinstance(until, str) else until) if u]  # "" stops nothing
            budget = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            budget = max(1, min(budget, self.max_length - 1))
            prompt = self.tok_encode(context)[-(self.max_length - budget) :] or [self.eot_token_id]
            jobs.append((prompt, until, budget))
        outputs: list[str] = [""] * len(jobs)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (prompt, _, budget) in enumerate(jobs):
            groups[(len(prompt), budget)].append(i)
        for (_, budget), idx in groups.items():
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start : start + self.batch_size]
                tokens = torch.tensor([jobs[i][0] for i in chunk], device=self._device)
                generated = self._greedy(tokens, budget, [jobs[i][1] for i in chunk])
                for i, ids in zip(chunk, generated):
                    outputs[i] = cut_at_stop(self.tok_decode(ids), jobs[i][1])
        return outputs

    def _greedy(self, tokens: torch.Tensor, budget: int, stops: list[list[str]]) -> list[list[int]]:
        """(B, T) prompts -> up to ``budget`` greedy tokens each, stopping a row at EOS or once its
        decoded text holds a stop string. The prompt is fed once and every new token once after it
        (:class:`~experiments.model.KVCache`); finished rows leave the batch."""
        new: list[list[int]] = [[] for _ in range(tokens.shape[0])]
        cache = KVCache(len(self.model.blocks))
        nxt = self.model(tokens, cache)[:, -1].argmax(-1)
        active = list(range(tokens.shape[0]))  # batch row -> request
        for step in range(budget):
            still = []
            for row, (b, token) in enumerate(zip(active, nxt.tolist())):
                if token == self.eot_token_id:
                    continue
                new[b].append(token)
                if not any(s in self.tok_decode(new[b]) for s in stops[b]):
                    still.append(row)
            if not still or step == budget - 1:
                break
            if len(still) < len(active):
                keep = torch.tensor(still, device=self._device)
                cache.keep(keep)
                nxt, active = nxt.index_select(0, keep), [active[r] for r in still]
            nxt = self.model(nxt[:, None], cache)[:, -1].argmax(-1)
        return new


def cut_at_stop(text: str, stops: list[str]) -> str:
    """``text`` up to the earliest occurrence of any stop string."""
    cut = min((text.find(s) for s in stops if s and s in text), default=len(text))
    return text[:cut]
