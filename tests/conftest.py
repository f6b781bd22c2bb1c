"""Shared fixtures: the micro sweep (three rows, a few steps, real corpus) that several test files read."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sweep.cli import main

ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/micro.json from this run (tests/test_golden.py)",
    )


MICRO = """\
name: micro
title: "Micro sweep"
paper_table: table1_moe
base:
  model: {vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}
  train: {max_steps: 8, batch_size: 4, seq_len: 32, warmup_steps: 2, val_every: 4, val_tokens: 512,
          max_lr: 2e-3}
  data: {vocab_size: 512, max_chars_per_source: 200000}
scales: {tiny: {}}
rows:
  - {id: baseline, label: "Baseline", paper_row: 1}
  - {id: sdpa_elementwise, label: "SDPA elementwise (G1)", paper_row: 5, model: {gate: {position: sdpa}}}
  - {id: moe, label: "MoE FFN, 4 experts top-2", model: {moe: {n_experts: 4, top_k: 2, expert_dim: 16}}}
"""

#: MICRO with 40 steps, a checkpoint every 5 and a validation every 10: long enough to stop midway.
LONG_STEPS = 40
LONG_MICRO = MICRO.replace(
    "max_steps: 8, batch_size: 4, seq_len: 32, warmup_steps: 2, val_every: 4,",
    f"max_steps: {LONG_STEPS}, batch_size: 4, seq_len: 32, warmup_steps: 4, val_every: 10,",
).replace("max_lr: 2e-3}", "max_lr: 2e-3, checkpoint_every: 5}")

#: ``python -c SLOW_CLI <sweep.cli arguments>``: the CLI with every training step 0.1 s slower (the
#: numbers are untouched), so a test can stop a process midway.
SLOW_CLI = """
import sys, time
from experiments.lit import LMModule
step_end = LMModule.on_train_batch_end
def slow(self, *args):
    time.sleep(0.1)
    step_end(self, *args)
LMModule.on_train_batch_end = slow
from sweep.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_slow_cli(args: list[str], new_session: bool = False) -> subprocess.Popen:
    """Run ``SLOW_CLI`` with ``args`` in a subprocess against the repository's corpus cache and
    the default (per results folder) stores; output captured as text. ``new_session``: in a
    process group of its own (``os.killpg`` then signals it and its children, as SLURM would)."""
    env = {**os.environ, "GATED_ATTN_CACHE": str(ROOT / ".cache"), "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_CLI, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_session,
    )


def wait_for_checkpoint(results: Path, min_step: int, procs: list[subprocess.Popen]) -> Path:
    """Poll until some run under ``results`` has a checkpoint of at least ``min_step``; return
    its folder. Fails if every process in ``procs`` ended first."""
    from experiments.checkpointing import latest_checkpoint

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert any(p.poll() is None for p in procs), "the processes ended before the checkpoint"
        for folder in (results / "checkpoints").glob("*/*"):
            found = latest_checkpoint(folder)
            if found is not None and int(found.stem.removeprefix("step")) >= min_step:
                return folder
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint of step {min_step} within 300 s")


def use_repo_cache(mp: pytest.MonkeyPatch) -> None:
    """The repository's corpus cache (real packages, built once) and the default per-results
    SQLite store, whatever the caller's environment says."""
    mp.setenv("GATED_ATTN_CACHE", str(ROOT / ".cache"))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def repo_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    use_repo_cache(monkeypatch)


def swept(tmp: Path, grid_text: str, *args: str) -> Iterator[dict]:
    """Write ``grid_text`` to ``tmp/micro.yaml`` and sweep it once into ``tmp/results`` (extra
    CLI ``args`` appended); yields ``{code, grid, results, mp}`` for a shared fixture."""
    grid = tmp / "micro.yaml"
    grid.write_text(grid_text)
    results = tmp / "results"
    mp = pytest.MonkeyPatch()
    use_repo_cache(mp)
    code = main(["sweep", "--grid", str(grid), "--results", str(results), *args])
    yield {"code": code, "grid": grid, "results": results, "mp": mp}
    mp.undo()


@pytest.fixture(scope="session")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Run the micro sweep once; the corpus cache is the repository's own (real packages)."""
    yield from swept(tmp_path_factory.mktemp("micro"), MICRO)
