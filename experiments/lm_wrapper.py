"""Our checkpoints as an lm-evaluation-harness model (registered as ``gated-attn``).

``GatedAttnLM`` subclasses lm-eval's ``TemplateLM`` (an ``lm_eval.api.model.LM``). Each
(context, continuation) pair is encoded once, as one string, and split where the context's
characters end (:meth:`GatedAttnLM._encode_pair`); a token that straddles that boundary belongs
to the continuation, so a continuation is never scored as empty. We score the continuation
tokens; an empty continuation is an error, never a score. Inputs longer than the model's window
are truncated from the left; a continuation longer than the window is scored in pieces of the
window's length, each after as many preceding tokens as the window holds (as a rolling
log-likelihood is). Inputs are batched longest first, right-padded; requests with the same input
(a multiple-choice question's one-token answers) share one forward pass. Generation is greedy,
batched over prompts of equal length, with a KV cache (each token is fed once), and stops at the
first stop string (or EOS, or ``max_gen_toks``).
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

from experiments.checkpointing import load_weights
from experiments.config import ModelConfig
from experiments.devices import scoring_precision
from experiments.model import GatedLM, KVCache


@register_model("gated-attn")
class GatedAttnLM(TemplateLM):
    """lm-eval model over a :class:`GatedLM` and its corpus tokenizer.

    Args:
        model: the trained model (eval mode is set here).
        tokenizer: the corpus tokenizer; ``eot_id`` is its end-of-document token (``Corpus.eos_id``).
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
        self.max_length = model.max_seq_len  # the RoPE table, which set_rope may widen

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Path, model_cfg: ModelConfig, tokenizer_file: Path, **kwargs: Any
    ) -> GatedAttnLM:
        """Load ``final.ckpt`` (a Lightning checkpoint of ``LMModule``; weights under ``model.``).

        Raises:
            FileNotFoundError: no such file.
            experiments.checkpointing.CheckpointDamaged: its bytes are not the ones written.
        """
        state = load_weights(checkpoint)
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

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """``(context, continuation)`` -> (context tokens, continuation tokens), from one encoding.

        As lm-eval's causal split (``TemplateLM._encode_pair``), trailing whitespace of the context
        moves to the continuation and the joined string is encoded once. The context's tokens are
        those of the whole encoding that end within the context's characters (the tokenizer's
        offsets); a token that straddles the boundary belongs to the continuation. The byte-level
        BPE merges across a boundary inside a word or a character sequence (``"x = im"`` +
        ``"port"`` is ``x``, `` =``, `` import``), where lm-eval's split, the whole encoding less as
        many tokens as the context encodes to alone, leaves the continuation empty (its Hugging
        Face backend asserts there). An empty context (or whitespace only) is the prefix token
        (EOS), as lm-eval's empty-context rule; the tokenizer adds no BOS, so no token is dropped.

        Raises:
            ValueError: the continuation is empty: there is nothing to score.
        """
        if not continuation:
            raise ValueError(f"{_named(context, continuation)}: an empty continuation has nothing to score")
        boundary = len(context.rstrip())
        encoding = self.tokenizer.encode(context + continuation)
        ends = [end for _, end in encoding.offsets]
        cut = next((i for i, end in enumerate(ends) if end > boundary), len(ends))
        return encoding.ids[:cut] or [self.prefix_token_id], encoding.ids[cut:]

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's ``loglikelihood``: (sum of log p of the continuation's tokens in nats, whether
        they are the greedy ones) per ``(context, continuation)`` request, every one split by
        :meth:`_encode_pair` (an empty context included).

        Raises:
            ValueError: a request's continuation is empty.
        """
        pairs = [r.args for r in requests]
        return self._loglikelihood_tokens([((c, x), *self._encode_pair(c, x)) for c, x in pairs])

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        """Score lm-eval's ``((context, continuation), context tokens, continuation tokens)``.

        Raises:
            ValueError: a request without context or continuation tokens: no number would be its
                score (lm-eval's Hugging Face backend asserts the same).
        """
        for (context, continuation), context_enc, continuation_enc in requests:
            problem = self._unscorable(context_enc, continuation_enc)
            if problem:
                raise ValueError(f"{_named(context, continuation)}: {problem}")
        return self._score([(context, continuation) for _, context, continuation in requests])

    def _unscorable(self, context: list[int], continuation: list[int]) -> str | None:
        """Why a token pair has no score, or None."""
        if not context or not continuation:
            return "no context tokens" if not context else "no continuation tokens"
        return None

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) in nats and whether it is the greedy continuation;
        the joined tokens keep their last ``max_length + 1``. A continuation of more than
        ``max_length`` tokens is scored in pieces of ``max_length``, each after the tokens before
        it (the sum of the pieces; greedy only if every piece is). Batched by equal length; only
        the continuation's positions are kept from each batch (a (T, V) matrix per request would
        not fit at a large vocabulary).

        Raises:
            ValueError: a pair without context or continuation tokens.
        """
        pieces: list[tuple[int, list[int], list[int]]] = []
        for i, (context, continuation) in enumerate(pairs):
            problem = self._unscorable(context, continuation)
            if problem:
                raise ValueError(f"token pair {i}: {problem}")
            for at in range(0, len(continuation), self.max_length):
                pieces.append((i, context + continuation[:at], continuation[at : at + self.max_length]))
        totals = [0.0] * len(pairs)
        greedy = [True] * len(pairs)
        for (i, _, _), (logprob, is_greedy) in zip(pieces, self._score_windows(pieces), strict=True):
            totals[i] += logprob
            greedy[i] = greedy[i] and is_greedy
        return list(zip(totals, greedy, strict=True))

    def _score_windows(self, pieces: list[tuple[int, list[int], list[int]]]) -> list[tuple[float, bool]]:
        """:meth:`_score` of pieces whose continuation fits the window. Inputs are batched longest
        first and right-padded to the batch's longest: attention is causal and the experts are
        dropless, so a padding token changes no position before it."""
        # Requests with the same input (a multiple-choice question's one-token answers) share one
        # forward pass.
        inputs: dict[tuple[int, ...], list[tuple[int, int, list[int]]]] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(pieces):
            whole = (context + continuation)[-(self.max_length + 1) :]
            inputs[tuple(whole[:-1])].append((i, len(whole) - 1 - len(continuation), continuation))
        rows = sorted(inputs, key=len, reverse=True)
        results: dict[int, tuple[float, bool]] = {}
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            width = len(chunk[0])
            batch = torch.tensor([list(row) + [self._eot] * (width - len(row)) for row in chunk])
            with scoring_precision(self._device):  # bf16 autocast on CUDA, as training; fp32 on the CPU
                logits = self.model(batch.to(self._device)).float()
            for j, row in enumerate(chunk):
                for i, at, continuation in inputs[row]:
                    logp = F.log_softmax(logits[j, at : at + len(continuation)], dim=-1).cpu()
                    target = torch.tensor(continuation)
                    logprob = logp.gather(-1, target[:, None]).sum().item()
                    results[i] = (logprob, bool((logp.argmax(-1) == target).all()))
        return [results[i] for i in range(len(pieces))]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each document in nats, in disjoint windows of ``max_length``
        tokens, the first conditioned on EOS. The document is encoded once, whole (no boundary to
        split); an empty one has no tokens to predict and totals 0.0, as in lm-eval's Hugging Face
        backend (no windows)."""
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
        EOS, or ``max_gen_toks`` tokens. The prompt is the context encoded once, whole (nothing to
        split), cut from the left to leave room for ``max_gen_toks``; an empty context is the
        prefix token (EOS), as in :meth:`_encode_pair`."""
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
        with scoring_precision(self._device):
            return self._greedy_tokens(tokens, budget, stops)

    def _greedy_tokens(self, tokens: torch.Tensor, budget: int, stops: list[list[str]]) -> list[list[int]]:
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


def _named(context: str, continuation: str) -> str:
    """A loglikelihood request as an error names it: the context's end and the continuation."""
    shown = repr(context[-60:]) if len(context) <= 60 else f"...{context[-60:]!r}"
    return f"loglikelihood request (context {shown}, continuation {continuation[:60]!r})"


def cut_at_stop(text: str, stops: list[str]) -> str:
    """``text`` up to the earliest occurrence of any stop string."""
    cut = min((text.find(s) for s in stops if s and s in text), default=len(text))
    return text[:cut]
