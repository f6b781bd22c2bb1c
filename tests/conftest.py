"""Shared fixtures: the micro sweep (two rows, a few steps, real corpus) that several test files read."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweep.cli import main

ROOT = Path(__file__).resolve().parents[1]

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
  - {id: add_experts, label: "Add 4 experts", paper_row: 4, requires: [moe]}
"""


@pytest.fixture(scope="session")
def micro(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the micro sweep once; the corpus cache is the repository's own (real packages)."""
    tmp = tmp_path_factory.mktemp("micro")
    grid = tmp / "micro.yaml"
    grid.write_text(MICRO)
    results = tmp / "results"
    mp = pytest.MonkeyPatch()
    mp.setenv("GATED_ATTN_CACHE", str(ROOT / ".cache"))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    code = main(["sweep", "--grid", str(grid), "--results", str(results)])
    yield {"code": code, "grid": grid, "results": results, "mp": mp}
    mp.undo()
