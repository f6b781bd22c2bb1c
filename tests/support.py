"""What several test files share: the micro grids, running the CLI slowed down, waiting for a
checkpoint, reading a sweep's runs and queue, comparing weights, finding a cell's ranks, a tiny
language model for the benchmark tests. One module, imported one way (``from tests.support
import ...``); ``conftest.py`` holds only pytest's hooks and fixtures."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import optuna
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from mlflow import MlflowClient
from mlflow.entities import ViewType
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments import names as N
from experiments.config import DataConfig, ModelConfig, MoEConfig, TrainConfig, from_dict
from experiments.lm_wrapper import GatedAttnLM
from experiments.model import GatedLM
from sweep.cli import main
from sweep.studies import storage_url


def write_grid(tmp_path: Path, text: str, name: str = "grid.yaml") -> Path:
    """``text`` as the grid file ``tmp_path/name``."""
    path = tmp_path / name
    path.write_text(text)
    return path


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
  - {id: moe, label: "MoE FFN, 4 experts top-2", model: {moe: {n_experts: 4, top_k: 2, expert_dim: 16}}}
"""


#: The micro model of the multi-process tests (tests/test_ddp.py, tests/test_fsdp.py): dense, and
#: a MoE of 4 experts, top-2; 6 steps of 4 sequences of 32 tokens, checkpointed at step 3.
MODEL = ModelConfig(
    vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=32
)
TRAIN = TrainConfig(
    max_steps=6, batch_size=4, seq_len=32, warmup_steps=2, val_every=3, val_tokens=512, checkpoint_every=3
)
DATA = DataConfig(vocab_size=512, max_chars_per_source=200000)
KINDS = {
    "dense": MODEL,
    "moe": dataclasses.replace(MODEL, moe=MoEConfig(n_experts=4, top_k=2, expert_dim=16)),
}


class LossRecorder(pl.Callback):
    """Each optimiser step's logged ``train/loss`` (the global batch's, on every rank)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: object, out: object, batch: object, i: int
    ) -> None:
        if (i + 1) % trainer.accumulate_grad_batches == 0:  # the step's last micro-batch
            self.losses.append(float(trainer.callback_metrics[N.TRAIN_LOSS]))


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
from sweep.studies import storage_url
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


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal to float tolerance: 1e-4 of each tensor's largest entry (an AdamW step turns float
    noise in a near-zero gradient into a change of about 1e-6 in a weight of about 0.08)."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-4 * float(b[k].abs().max())), k


def histories(results: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric of the grid's one finished cell run: key -> [(step, value)] by step."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    (run,) = client.search_runs([exp.experiment_id], "tags.kind = 'cell' and tags.status = 'finished'")
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }


def process_state(pid: int) -> str | None:
    """A process's state letter (``S``, ``R``, ``Z`` for one dead but not yet reaped), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def ranks_of(ancestor: int) -> list[int]:
    """The ranks (``python -m sweep.run.ranks`` under torchrun) that descend from ``ancestor``."""
    parents, commands = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            commands[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue

    def descends(pid: int) -> bool:
        while pid in parents and pid != ancestor:
            pid = parents[pid]
        return pid == ancestor

    return [
        pid
        for pid, cmd in commands.items()
        if b"sweep.run.ranks" in cmd and b"torch.distributed.run" not in cmd and descends(pid)
    ]


def all_cell_runs(results: Path) -> list:
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    return client.search_runs([exp.experiment_id], "tags.kind = 'cell'", run_view_type=ViewType.ALL)


def queue_trials(results: Path) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name="cells-tiny", storage=storage_url(results, None))
    return study.get_trials()


GOOD = """\
name: g
base:
  model: {vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}
  train: {max_steps: 6, batch_size: 4, seq_len: 32, warmup_steps: 2, val_every: 3, val_tokens: 256,
          max_lr: 2e-3}
  data: {vocab_size: 512}
scales: {tiny: {}}
rows:
  - {id: baseline}
  - {id: sdpa, model: {gate: {position: sdpa}}}
"""


TEXT = "the cat sat on the mat. a dog ran in the park. the sun is hot and the sky is blue. " * 20


WINDOW = 24


def tiny_lm(text: str, vocab_size: int, **kwargs: int) -> GatedAttnLM:
    """A 2-layer model (seed 0, untrained) and a byte-level BPE trained on ``text``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer)
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        ffn_dim=64, max_seq_len=WINDOW,
    )  # fmt: skip
    return GatedAttnLM(GatedLM(cfg), tok, batch_size=3, **kwargs)


def direct_logprob(lm: GatedAttnLM, tokens: list[int], n_scored: int) -> float:
    """log p of the last ``n_scored`` tokens of ``tokens`` given the ones before, one forward."""
    with torch.no_grad():
        logp = F.log_softmax(lm.model(torch.tensor([tokens[:-1]])).float(), -1)[0]
    positions = range(len(tokens) - 1 - n_scored, len(tokens) - 1)
    return sum(logp[i, tokens[i + 1]].item() for i in positions)


def request(kind: str, *args: object) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


STAGE_ROW = (
    '  - {id: baseline_long, label: "Baseline, stage 2", parent: baseline,\n'
    "     model: {rope_theta: 1000000.0, max_seq_len: x4}, train: {seq_len: x4, batch_size: x1/4}}\n"
    '  - {id: gated_long, label: "G1, stage 2", parent: sdpa_elementwise,\n'
    "     model: {rope_theta: 1000000.0, max_seq_len: x4},\n"
    "     train: {seq_len: x4, batch_size: x1/4, max_steps: 12}}\n"
)


STAGED = LONG_MICRO + STAGE_ROW


def client_for(results: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")


def runs_of(results: Path, row: str) -> list:
    client = client_for(results)
    exp = client.get_experiment_by_name("micro-tiny")
    return client.search_runs([exp.experiment_id], f"tags.kind = 'cell' and tags.row = '{row}'")


#: the words of the corpus tests' made-up documents
WORDS = "the of and to a in that is was he for it with as his on be at by this had not are but from".split()


def word_docs(seed: int, n: int) -> list[str]:
    """``n`` distinct documents of 30-80 words from :data:`WORDS`, the same for the same ``seed``."""
    rng = random.Random(seed)
    return [
        f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 80)))
        for i in range(n)
    ]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """``texts`` as a JSON-lines file of ``{"text": ...}`` rows at ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def files_recipe(sources: list, **extra) -> DataConfig:
    """A corpus recipe of ``sources`` with a 300-id BPE and 20 % validation and test splits."""
    recipe = {"vocab_size": 300, "val_fraction": 0.2, "test_fraction": 0.2, "sources": sources, **extra}
    return from_dict(DataConfig, recipe)
