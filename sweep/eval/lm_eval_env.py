"""lm-eval calls without its per-call environment report.

``lm_eval.simple_evaluate`` ends every call with ``add_env_info``: ``torch.utils.collect_env``
runs ``pip list``, ``nvidia-smi``, compilers and ``git`` (2.9 s a call on 2 busy cores). Its
API has no switch for it; nothing here reads the report (the run's own provenance is in MLflow).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

SKIPPED = "not collected (sweep.eval.lm_eval_env): the run's MLflow record holds its environment"


def _versions_only(storage: dict[str, Any]) -> None:
    storage.update({"pretty_env_info": SKIPPED, "lm_eval_version": version("lm_eval")})


@contextlib.contextmanager
def without_env_report() -> Iterator[None]:
    """``lm_eval.simple_evaluate`` inside records lm-eval's version instead of the environment."""
    import lm_eval.evaluator as evaluator

    before = evaluator.add_env_info
    evaluator.add_env_info = _versions_only
    try:
        yield
    finally:
        evaluator.add_env_info = before
