"""What the training device changes (issue 44's smaller defects), shown on the CPU: a resume in
another precision or compile setting is refused, a checkpoint's CUDA generator state loads on a
machine with fewer GPUs, scoring on the CPU stays fp32, and a GPU run is tagged with the GPU's
arithmetic, not the CPU's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from experiments import devices
from experiments import names as N
from experiments.devices import rng_state, scoring_precision, set_rng_state
from sweep.grid import load_grid, run_key
from sweep.report.runs import arithmetic
from sweep.run.placement import placement_change
from sweep.store import runtime_tags
from tests.support import MICRO, write_grid


def _run(params: dict[str, str], tags: dict[str, str]) -> SimpleNamespace:
    return SimpleNamespace(data=SimpleNamespace(params=params, tags=tags), info=SimpleNamespace(run_id="r1"))


def test_a_run_started_in_bf16_does_not_resume_in_fp32(tmp_path) -> None:
    (cell,) = load_grid(write_grid(tmp_path, MICRO)).cells("tiny", rows=["baseline"])
    assert cell.config.train.precision == "auto"  # fp32 here: no CUDA
    assert placement_change(_run({}, {N.PRECISION_TAG: "32-true"}), cell) == ""
    moved = placement_change(_run({}, {N.PRECISION_TAG: "bf16-mixed"}), cell)
    assert "another placement (precision bf16-mixed -> 32-true)" in moved
    assert placement_change(_run({}, {}), cell) == ""  # a run from before the tag: nothing to compare


def test_a_run_does_not_resume_with_compile_switched(tmp_path) -> None:
    (cell,) = load_grid(write_grid(tmp_path, MICRO)).cells("tiny", rows=["baseline"])
    compiled = dataclasses.replace(cell, config=dataclasses.replace(
        cell.config, train=dataclasses.replace(cell.config.train, compile=True)
    ))  # fmt: skip
    assert run_key(compiled.config) == run_key(cell.config)  # how it trains, not what: one run key
    assert "train.compile False -> True" in placement_change(_run({"train.compile": "False"}, {}), compiled)


def test_a_checkpoint_of_more_gpus_resumes_on_fewer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the state of every GPU was saved and ``set_rng_state_all`` refused another count."""
    set_to: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: set_to.append(state))
    state = rng_state()
    assert [int(s[0]) for s in state["cuda"]] == [7]  # the current device's alone
    eight = dict(state, cuda=[torch.tensor([i], dtype=torch.uint8) for i in range(8)])  # an older file
    set_rng_state(eight)
    assert [int(s[0]) for s in set_to] == [0]  # the first, where every worker trained
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    set_rng_state(eight)  # a CPU machine: the CUDA state is left alone
    assert len(set_to) == 1


def test_scoring_on_the_cpu_is_fp32_as_before() -> None:
    x = torch.randn(4, 4)
    with scoring_precision("cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert (x @ x).dtype == torch.float32


def test_a_gpu_run_is_tagged_with_the_gpu_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "cpu_arith" in runtime_tags() and "gpu_arith" not in runtime_tags()
    monkeypatch.setattr(devices, "gpu_arithmetic", lambda: "cuda 12.8, sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    tags = runtime_tags()
    assert "cpu_arith" not in tags and tags["gpu_arith"] == "cuda 12.8, sm_90"
    tags |= {N.PRECISION_TAG: "bf16-mixed"}
    assert arithmetic(tags).startswith("NVIDIA H100 80GB HBM3 (cuda 12.8, sm_90, bf16-mixed), ")


def test_only_sessions_that_select_gpu_tests_see_cuda() -> None:
    """tests/conftest.py hides CUDA unless the ``-m`` expression selects the ``gpu`` tests."""
    from tests.conftest import selects_gpu_tests

    for expression in ("gpu", "gpu or slow", "gpu and not slow"):
        assert selects_gpu_tests(expression), expression
    for expression in ("", "not gpu", "not slow and not gpu", "not (slow or gpu)", "slow"):
        assert not selects_gpu_tests(expression), expression
