"""A grid's ``eval:`` section: which benchmarks score its finished runs (``sweep.eval``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from experiments.strict import ConfigError
from sweep.gridfile import NAME


@dataclass(frozen=True)
class EvalConfig:
    """The grid's ``eval:`` section: lm-eval tasks run on each finished run's ``final.ckpt``.

    ``tasks``: names of the offline suite (``sweep.eval.suite``: ``offline_mmlu_dev``,
    ``offline_humaneval``; ``offline_wikihow`` and ``offline_mathqa`` download BIG-bench) or any
    lm-eval task name (those need the hub). ``scales``: where ``make sweep`` scores by itself
    (default every scale; ``make eval`` scores at any). ``num_fewshot``: per task (default 0).
    ``limit``: documents per task (None: all). ``batch_size`` and ``max_gen_toks`` go to the model
    wrapper.
    """

    tasks: tuple[str, ...] = ()
    scales: tuple[str, ...] | None = None
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

    def fewshot(self, task: str) -> int:
        return self.num_fewshot.get(task, 0)

    def scored_by_sweep(self, scale: str) -> bool:
        """Whether ``make sweep`` at ``scale`` scores the finished runs by itself."""
        return bool(self.tasks) and (self.scales is None or scale in self.scales)
