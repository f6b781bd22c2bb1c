"""Scoring processes do not spin: a passive OpenMP wait policy before torch loads, and lm-eval's
per-call environment report left out."""

from __future__ import annotations

import os
import subprocess
import sys

import lm_eval.evaluator

from sweep.eval.lm_eval_env import SKIPPED, without_env_report


def _policy_seen(env: dict[str, str]) -> str:
    code = (
        "import sys, os, sweep.cli; assert 'torch' not in sys.modules; print(os.environ['OMP_WAIT_POLICY'])"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_command_line_sets_a_passive_wait_policy_before_torch_loads_unless_the_user_set_one() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_seen(env) == "PASSIVE"
    assert _policy_seen({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


def test_lm_evals_environment_report_is_left_out_inside_and_restored_after(monkeypatch) -> None:
    import torch.utils.collect_env

    def never(*_args, **_kwargs):  # the 2.9 s report: must not run
        raise AssertionError("collect_env ran")

    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", never)
    before = lm_eval.evaluator.add_env_info
    with without_env_report():
        record: dict = {}
        lm_eval.evaluator.add_env_info(record)
    assert record["pretty_env_info"] == SKIPPED and record["lm_eval_version"].startswith("0.4")
    assert lm_eval.evaluator.add_env_info is before
