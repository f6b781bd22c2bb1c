"""RULER's synthetic long-context tasks through lm-eval, offline: ``longctx/<task>/<len>`` scores.

Source: RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv 2404.06654), as lm-eval 0.4.13 builds it (``lm_eval/tasks/ruler``):
each sample is generated at run time and sized to the length with a Hugging Face tokenizer,
greedy generation (``GatedAttnLM``), scored by recall of the answer strings (0..1).

:data:`RULER_TASKS` are the tasks that need no download: single and multi-key needles
(``niah_single_1``, ``niah_multikey_2``, ``niah_multikey_3``: "repeat" and "needle" haystacks),
variable tracking ``vt``, common and frequent word extraction ``cwe`` and ``fwe``. The others
need the Hugging Face hub: the essay haystack of ``niah_single_2/3``, ``niah_multikey_1``,
``niah_multivalue`` and ``niah_multiquery`` (``prepare_niah.get_haystack`` loads
``baber/paul_graham_essays``), and ``ruler_qa_squad/hotpot`` (``qa_utils``).

Offline: our corpus tokenizer is saved as a ``transformers`` fast tokenizer in a temporary folder
and named as the tasks' ``tokenizer``; ``prepare_niah`` calls ``nltk.download("punkt_tab")`` at
import when the data is absent, for the essay haystack's sentence splitter only, so the import
here runs with that download a no-op. Opt-in: ``pip install -e '.[ruler]'`` (transformers,
wonderwords, nltk). The first call in a process takes about 10 s more and 1 GiB: lm-eval's
generator builds every adjective-noun pair of wonderwords (6.2 M) at import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from experiments.model import GatedLM
from experiments.names import longctx_key
from sweep.eval.lm_eval_env import without_env_report
from sweep.evalspec import RULER_OFFLINE

#: Our task name -> lm-eval's.
RULER_TASKS: dict[str, str] = {
    name: name if name.startswith("niah") else f"ruler_{name}" for name in RULER_OFFLINE
}
PACKAGES = ("transformers", "wonderwords", "nltk")  # the import names are the PyPI names
INSTALL = "pip install -e '.[ruler]'"
VT_EXAMPLE_TOKENS = 500  # vt_utils.get_dataset sizes its in-context example to 500 tokens
#: lm-eval sizes fwe's prompt alone to the length asked (fwe_utils.sys_kwext); its 50 answer tokens
#: come on top. It is asked for that much less, so prompt and answer fit the length as elsewhere.
ANSWER_OUTSIDE = {"fwe": 50}


class RulerUnavailable(RuntimeError):
    """A package RULER needs is not installed; one line."""


def missing_packages() -> list[str]:
    """The packages of :data:`PACKAGES` that are not installed."""
    return [p for p in PACKAGES if importlib.util.find_spec(p) is None]


def ruler_scores(
    model: GatedLM,
    tokenizer: Tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    limit: int,
    device: str | torch.device | None = None,
    yarn: bool = False,
    batch_size: int = 8,
    eot_id: int = 0,
) -> dict[str, float]:
    """Score ``model`` on RULER ``tasks`` at each of ``lengths`` (tokens, the answer's included),
    ``limit`` samples each, with no network.

    Each (task, length) is one ``lm_eval.simple_evaluate`` (seeds 0): samples are generated for that
    length only, so ``limit`` counts per length, and the same seeds give the same samples with and
    without YaRN. The model is put in eval mode on ``device`` (default: its own).

    Returns:
        ``{names.longctx_key(task, len, yarn): score}`` (``yarn``: the caller applied YaRN to the
        model, ``GatedLM.set_rope``), each score the mean over samples of the
        fraction of answer strings found in the generated text, in [0, 1].

    Raises:
        ValueError: an unknown task, a length under 256 or above the model's window
            (``model.max_seq_len``: apply YaRN first), a ``limit`` under 1, or a length too
            short for a task with this tokenizer (lm-eval's generators would loop forever or
            leave the answer empty).
        RulerUnavailable: transformers, wonderwords or nltk is missing.
    """
    unknown = [t for t in tasks if t not in RULER_TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; known: {', '.join(RULER_TASKS)}")
    window = model.max_seq_len
    bad = [n for n in lengths if not 256 <= n <= window]
    if bad or limit < 1:
        what = f"length(s) {bad} outside 256..{window} (the model's window)" if bad else f"limit {limit}"
        raise ValueError(f"RULER: {what}")
    missing = missing_packages()
    if missing:
        raise RulerUnavailable(f"RULER needs {', '.join(missing)}: {INSTALL}")
    _import_offline()
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedTokenizerFast

    from experiments.lm_wrapper import GatedAttnLM

    lm = GatedAttnLM(model, tokenizer, eot_id=eot_id, batch_size=batch_size, device=device)
    folder = Path(lm_eval.__file__).parent / "tasks" / "ruler"  # a namespace package: no __init__
    scores: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ruler-tokenizer-") as hf_dir:
        PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(hf_dir)
        for length in lengths:
            for task in tasks:
                _check_fits(task, length, lambda text: len(tokenizer.encode(text).ids))
                name, asked = RULER_TASKS[task], length - ANSWER_OUTSIDE.get(task, 0)
                # cwe_utils shuffles a module-level RNG: a fresh import gives every run the same words.
                sys.modules.pop("lm_eval.tasks.ruler.cwe_utils", None)
                manager = TaskManager(
                    include_path=str(folder),
                    include_defaults=False,
                    metadata={"tokenizer": hf_dir, "max_seq_lengths": [asked]},
                )
                with without_env_report():
                    out = simple_evaluate(
                        model=lm,
                        tasks=[name],
                        limit=limit,
                        task_manager=manager,
                        log_samples=False,
                        bootstrap_iters=0,
                        random_seed=0,
                        numpy_random_seed=0,
                        torch_random_seed=0,
                        fewshot_random_seed=0,
                    )
                score = out["results"][name].get(f"{asked},none")
                if not isinstance(score, (int, float)) or not (math.isfinite(score) and 0 <= score <= 1):
                    raise RuntimeError(f"RULER {task} at {length}: no score in [0, 1] (got {score!r})")
                scores[longctx_key(task, length, yarn)] = float(score)
    return scores


def _import_offline() -> None:
    """Import lm-eval's ``prepare_niah`` with ``nltk.download`` a no-op: it fetches ``punkt_tab``
    at import when absent, for the essay haystack (not one of ours), and prints that it did."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "lm_eval.tasks.ruler.prepare_niah" in sys.modules:
        return
    import nltk

    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import lm_eval.tasks.ruler.prepare_niah  # noqa: F401
    finally:
        nltk.download = download


def _check_fits(task: str, length: int, count: Callable[[str], int]) -> None:
    """Raise ValueError where lm-eval's generator of ``task`` cannot size a sample to ``length``
    with this tokenizer (``count``: text -> tokens) and would not say so: ``vt`` loops forever
    (``vt_utils.sys_vartrack_w_noise_random``), ``cwe`` leaves the answer empty. The needle tasks
    raise by themselves; ``fwe`` fits any length of 256 or more. Touches the global RNGs;
    ``simple_evaluate`` reseeds them."""
    if task == "vt":
        from lm_eval.tasks.ruler import vt_utils

        def tokens(noises: int, icl: bool) -> int:  # text and answer, as vt_utils counts them
            return max(
                count(" ".join(map(str, vt_utils.generate_input_output(noises, 1, 4, icl)))) for _ in range(3)
            )

        example, need = tokens(5, True), tokens(10, False)
        if example + 30 > VT_EXAMPLE_TOKENS or VT_EXAMPLE_TOKENS + need + 30 > length:
            raise ValueError(
                f"RULER vt at {length}: its smallest sample needs {VT_EXAMPLE_TOKENS + need + 30} tokens and "
                f"its example {example + 30} of {VT_EXAMPLE_TOKENS} with this tokenizer"
            )
    elif task == "cwe":
        from lm_eval.tasks.ruler import cwe_utils

        example, text, answer = cwe_utils.generate_input_output(10, length)
        need = count(f"{example}\n{text} " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer))) + 120
        if need > length:
            raise ValueError(f"RULER cwe at {length}: its smallest list needs {need} tokens, this tokenizer")
