"""A grid's ``eval:`` and ``longctx:`` sections: which benchmarks score its finished runs
(``sweep.eval``), and which rows get the long-context evaluation (``experiments.longctx``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from importlib import metadata

from experiments.longctx_config import LongContextConfig
from experiments.strict import ConfigError, to_dict
from sweep.gridfile import NAME

#: RULER's tasks that lm-eval generates with no download (``sweep.eval.ruler``).
RULER_OFFLINE = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
#: A run's tag once its long-context scores are logged: the :meth:`LongContextSpec.recipe` they
#: were made with (runs scored before recipes were recorded say ``scored``, which no recipe is).
LONGCTX_TAG = "longctx"
#: A run's tag naming the RULER tasks its long-context scores hold, comma-separated (may be empty).
LONGCTX_RULER_TAG = "longctx_ruler"


@functools.cache
def _lm_eval_version() -> str | None:
    """lm-eval's installed version, read once a process (every score check asks for it)."""
    try:
        return metadata.version("lm_eval")
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class ScaleEval:
    """What ``make sweep`` scores at one scale (``eval.at.<scale>``): ``tasks``, a subset of the
    grid's (default all of them; ``make eval`` scores the rest), and ``limit``, the documents per
    task at this scale (default the grid's ``limit``): the first N of each task's fixed shuffle,
    the same N for every run."""

    tasks: tuple[str, ...] | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError("limit", f"must be an integer >= 1; got {self.limit}")


@dataclass(frozen=True)
class EvalConfig:
    """The grid's ``eval:`` section: lm-eval tasks run on each finished run's ``final.ckpt``.

    ``tasks``: names of the offline suite (``sweep.eval.suite``: Table 1's ``offline_hellaswag``,
    ``offline_mmlu``, ``offline_gsm8k``, then ``offline_arc_easy``, ``offline_piqa``,
    ``offline_sciq``, ``offline_lambada``, ``offline_mmlu_dev``, ``offline_humaneval``;
    ``offline_wikihow`` and ``offline_mathqa`` download BIG-bench) or any lm-eval task name (those
    need the hub). ``scales``: where ``make sweep`` scores by itself (default every scale;
    ``make eval`` scores at any). ``at``: per scale, the tasks ``make sweep`` scores and the
    documents per task (:class:`ScaleEval`). ``num_fewshot``: per task (default 0). ``limit``:
    documents per task (None: all). ``batch_size`` and ``max_gen_toks`` go to the model wrapper.
    """

    tasks: tuple[str, ...] = ()
    scales: tuple[str, ...] | None = None
    at: dict[str, ScaleEval] = field(default_factory=dict)
    num_fewshot: dict[str, int] = field(default_factory=dict)
    limit: int | None = None
    batch_size: int = 32
    max_gen_toks: int = 64

    def __post_init__(self) -> None:
        if not all(map(NAME.match, self.tasks)) or len(set(self.tasks)) < len(self.tasks):
            raise ConfigError(
                "tasks", f"must be a list of distinct task names ([A-Za-z0-9_.-]); got {list(self.tasks)}"
            )
        for task, shots in self.num_fewshot.items():
            if task not in self.tasks or shots < 0:
                raise ConfigError(
                    f"num_fewshot.{task}", f"must map a listed task to a count >= 0; got {shots}"
                )
        for name in ("limit", "batch_size", "max_gen_toks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(name, f"must be an integer >= 1; got {value}")
        for scale, override in self.at.items():
            unknown = [t for t in override.tasks or () if t not in self.tasks]
            if unknown:
                raise ConfigError(f"at.{scale}.tasks", f"{', '.join(unknown)} not in eval.tasks")

    def for_scale(self, scale: str, sweep: bool = False) -> EvalConfig:
        """This config at ``scale``: its ``at.<scale>`` limit, and with ``sweep`` (what ``make
        sweep`` scores) its ``at.<scale>`` tasks. One limit per scale, so ``make eval`` and ``make
        sweep`` make the same recipe (:meth:`recipe`) of a task."""
        override = self.at.get(scale, ScaleEval())
        tasks = override.tasks if sweep and override.tasks is not None else self.tasks
        limit = override.limit if override.limit is not None else self.limit
        return dataclasses.replace(self, tasks=tuple(tasks), limit=limit, at={})

    def fewshot(self, task: str) -> int:
        return self.num_fewshot.get(task, 0)

    def recipe(self, task: str) -> str:
        """What a score of ``task`` was made with, as 12 hex digits: the task, its shots, the
        limit, the generation budget, the offline suite's version and lm-eval's. A score is the
        run's only while its tag ``bench/<task>/recipe`` says this (``sweep.eval.scores``); after
        any of them changed, ``make eval`` scores the run again and the tables leave the old one out."""
        from sweep.eval.suite import SUITE_VERSION
        from sweep.eval.wheel_tasks import TASKS as WHEEL_TASKS
        from sweep.eval.wheel_tasks import WHEEL_SHA256

        made_with = {
            "task": task,
            "num_fewshot": self.fewshot(task),
            "limit": self.limit,
            "max_gen_toks": self.max_gen_toks,
            "suite": SUITE_VERSION,
            **({"wheel": WHEEL_SHA256} if task in WHEEL_TASKS else {}),
            "lm_eval": _lm_eval_version(),
        }
        return hashlib.sha256(json.dumps(made_with, sort_keys=True).encode()).hexdigest()[:12]

    def scored_by_sweep(self, scale: str) -> bool:
        """Whether ``make sweep`` at ``scale`` scores the finished runs by itself."""
        return bool(self.tasks) and (self.scales is None or scale in self.scales)


@dataclass(frozen=True)
class LongContextSpec(LongContextConfig):
    """A grid's ``longctx:`` section: :class:`~experiments.longctx.LongContextConfig` (lengths as
    multiples of the scale's context, YaRN factor, PPL windows, passkey depths and trials), the
    rows it scores after training, and RULER's tasks, opt-in.

    ``rows``: the rows scored (default every row). ``ruler_tasks``: RULER tasks of
    :data:`RULER_OFFLINE` run through lm-eval at each length of 256 tokens or more (needs
    ``pip install -e '.[ruler]'``; greedy generation, so only models that can generate score above
    zero). ``ruler_limit``: samples per task and length.
    """

    rows: tuple[str, ...] = ()
    ruler_tasks: tuple[str, ...] = ()
    ruler_limit: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [t for t in self.ruler_tasks if t not in RULER_OFFLINE]
        if unknown:
            raise ConfigError(
                "ruler_tasks",
                f"unknown {', '.join(unknown)}; offline RULER tasks: {', '.join(RULER_OFFLINE)}",
            )
        if self.ruler_limit < 1:
            raise ConfigError("ruler_limit", f"must be an integer >= 1; got {self.ruler_limit}")

    def scores(self, row: str) -> bool:
        """Whether the long-context evaluation scores ``row``'s cells."""
        return not self.rows or row in self.rows

    def recipe(self) -> str:
        """What a run's long-context scores were made with, as 12 hex digits: every setting of
        the section (the lengths, the YaRN factor, the windows, the passkeys, ``ruler_limit``) but
        which rows and which RULER tasks it scores. The scores count only while the run's tag
        ``longctx`` (:data:`LONGCTX_TAG`) says this: after an edit (YaRN x2 made x8, a length
        added) ``make eval`` scores the run again, and the tables leave the old scores out
        (``sweep.report.runs``), rather than show factor-2 scores under factor 8."""
        made_with = {k: v for k, v in to_dict(self).items() if k not in ("rows", "ruler_tasks")}
        return hashlib.sha256(json.dumps(made_with, sort_keys=True).encode()).hexdigest()[:12]

    def current(self, tags: dict[str, str]) -> bool:
        """Whether a run's tags say its long-context scores are of this section: its
        :meth:`recipe`, and every RULER task of ``ruler_tasks`` scored."""
        scored = set(filter(None, tags.get(LONGCTX_RULER_TAG, "").split(",")))
        return tags.get(LONGCTX_TAG) == self.recipe() and set(self.ruler_tasks) <= scored
