"""A run carries its tokenizer (issue 54, items 2 and 3): each run stores the ``tokenizer.json`` it
trained with and its sha256 when training starts, and ``make export`` ships that file, never a BPE
trained again. The issue's case: a ``files`` source edited, the corpus folder moved away, then an
export before the next sweep. A run from before the stored tokenizer uses the corpus folder here
only if it holds the run's bytes (its fingerprint), else export refuses in one line, exit 2."""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
from pathlib import Path

import pytest
from mlflow import MlflowClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from experiments.checksums import file_sha256
from experiments.names import TOKENIZER_SHA256_TAG
from sweep.cli import main

WORDS = "the of and to a in that is was he for it with as his on be at by this had not are but from".split()
TEXT = "the dog was at the park, and he ran from the mat to the sun"


def _jsonl(path: Path, seed: int) -> None:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 80))) for _ in range(150)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"doc {i}: {t}"}) + "\n" for i, t in enumerate(docs)))


def _s_tokenizer(path: Path) -> None:
    """A pretrained ``tokenizer.json`` whose end token is ``</s>`` (id 0), no ``<|endoftext|>``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.save(str(path))


GRID = """\
name: own
title: "Own"
base:
  model: {{vocab_size: 384, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}}
  train: {{max_steps: 4, batch_size: 4, seq_len: 32, warmup_steps: 1, val_every: 4, val_tokens: 256}}
  data: {{vocab_size: 300, val_fraction: 0.2, test_fraction: 0.2,
         sources: [{{files: {source}, domain: web}}]}}
scales: {{tiny: {{}}}}
rows:
  - {{id: baseline, label: "Baseline"}}
  - {{id: pretrained, label: "Ends in s", data: {{tokenizer: {{file: {tokenizer}}}}}}}
"""
PARTS = ("data", "cache", "results")


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both rows trained once on a ``files`` source; a pristine copy of data, cache and store."""
    root = tmp_path_factory.mktemp("own")
    _jsonl(root / "data" / "web.jsonl", 0)
    _s_tokenizer(root / "data" / "s.json")
    (root / "grid.yaml").write_text(
        GRID.format(source=root / "data" / "web.jsonl", tokenizer=root / "data" / "s.json")
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GATED_ATTN_CACHE", str(root / "cache"))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        assert main(["sweep", "--grid", str(root / "grid.yaml"), "--results", str(root / "results")]) == 0
    for part in PARTS:
        shutil.copytree(root / part, root / "pristine" / part, symlinks=True)
    return root


@pytest.fixture
def own(swept: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The swept state restored in place (the recipe hash names the source's path, so the files
    stay where they were), with the runs and their stored tokenizers (the corpus's files)."""
    for path in [*swept.iterdir(), *(swept / "results").iterdir()]:  # what the last test left
        if path.is_dir() and path.name not in ("pristine", "results"):
            shutil.rmtree(path)
    for part in PARTS:
        shutil.copytree(
            swept / "pristine" / part, swept / part, symlinks=True, dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("mlflow.db"),
        )  # fmt: skip
    # the store's bytes restored into its own file: MLflow keeps its connections open
    with sqlite3.connect(swept / "pristine" / "results" / "mlflow.db") as src:
        with sqlite3.connect(swept / "results" / "mlflow.db") as dst:
            src.backup(dst)
    monkeypatch.setenv("GATED_ATTN_CACHE", str(swept / "cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    client = MlflowClient(tracking_uri=f"sqlite:///{swept / 'results' / 'mlflow.db'}")
    runs = {
        r.data.tags["row"]: r
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id], "tags.kind = 'cell'")
    }
    corpora = {row: swept / "cache" / f"corpus-{run.data.tags['corpus']}" for row, run in runs.items()}
    return {"root": swept, "client": client, "runs": runs, "corpora": corpora}


def export(own: dict, runs: str, *extra: str) -> int:
    root = own["root"]
    args = ["export", "--grid", str(root / "grid.yaml"), "--results", str(root / "results"), "--runs", runs]
    return main([*args, "--dest", str(root / "out"), *extra])


def exported_ids(own: dict, row: str, text: str = TEXT) -> list[int]:
    return AutoTokenizer.from_pretrained(own["root"] / "out" / "own-tiny" / f"{row}_s0")(text).input_ids


def test_each_run_stores_the_tokenizer_it_trained_with_and_its_sha256(own: dict) -> None:
    for row, run in own["runs"].items():
        stored = Path(own["client"].download_artifacts(run.info.run_id, "tokenizer.json", str(own["root"])))
        corpus_file = own["corpora"][row] / "tokenizer.json"
        assert stored.read_bytes() == corpus_file.read_bytes()
        assert run.data.tags[TOKENIZER_SHA256_TAG] == file_sha256(corpus_file)


def test_an_export_after_the_source_changed_and_the_corpus_moved_ships_the_runs_own_tokenizer(
    own: dict, capsys
) -> None:
    root = own["root"]
    old = Tokenizer.from_file(str(own["corpora"]["baseline"] / "tokenizer.json"))
    _jsonl(root / "data" / "web.jsonl", 1)  # other documents
    for row, folder in own["corpora"].items():
        folder.rename(root / f"moved-{row}")
    assert export(own, "baseline,pretrained") == 0, capsys.readouterr().err
    assert exported_ids(own, "baseline") == old.encode(TEXT).ids
    card = (root / "out" / "own-tiny" / "baseline_s0" / "README.md").read_text()
    assert "| tokenizer | the run's own (sha256 " in card
    assert main(["data", "--grid", str(root / "grid.yaml"), "--rows", "baseline"]) == 0
    new = Tokenizer.from_file(str(own["corpora"]["baseline"] / "tokenizer.json"))
    assert new.encode(TEXT).ids != old.encode(TEXT).ids  # what an export that trains again would ship


def test_a_s_tokenizers_run_exports_with_s_as_eos_and_pad_in_every_file(own: dict, capsys) -> None:
    assert export(own, "pretrained") == 0, capsys.readouterr().err
    folder = own["root"] / "out" / "own-tiny" / "pretrained_s0"
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == ("</s>", 0, 0, None)
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (0, 0, None)
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (0, 0)
    assert len(tok) == Tokenizer.from_file(str(own["root"] / "data" / "s.json")).get_vocab_size()


def _forget_tokenizer(own: dict, row: str) -> None:
    """Make ``row``'s run look like one trained before runs stored their tokenizer."""
    run = own["runs"][row]
    own["client"].delete_tag(run.info.run_id, TOKENIZER_SHA256_TAG)
    artifacts = own["root"] / "results" / "mlartifacts"
    for path in artifacts.rglob("tokenizer.json"):
        if run.info.run_id in path.parts:
            path.unlink()


def test_a_run_without_a_stored_tokenizer_uses_the_corpus_here_only_if_it_holds_the_runs_bytes(
    own: dict, capsys
) -> None:
    root, run = own["root"], own["runs"]["baseline"]
    _forget_tokenizer(own, "baseline")
    old = Tokenizer.from_file(str(own["corpora"]["baseline"] / "tokenizer.json"))
    own["corpora"]["baseline"].rename(root / "moved")
    assert export(own, "baseline") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: RUNS: run {run.info.run_id} (baseline) stored no tokenizer and its corpus "
        f"{own['corpora']['baseline']} is not here: export never trains a tokenizer again (other ids "
        "for the same text); put back the corpus folder it trained on"
    )
    _jsonl(root / "data" / "web.jsonl", 1)
    assert main(["data", "--grid", str(root / "grid.yaml"), "--rows", "baseline"]) == 0
    capsys.readouterr()
    assert export(own, "baseline") == 2
    err = capsys.readouterr().err.strip()
    fingerprint = run.data.tags["corpus_fingerprint"]
    assert err.startswith(f"error: RUNS: run {run.info.run_id} (baseline) stored no tokenizer and ")
    assert "holds other bytes than it trained on (fingerprint " in err and f"the run's {fingerprint})" in err
    assert not (root / "out").exists()
    shutil.rmtree(own["corpora"]["baseline"])
    (root / "moved").rename(own["corpora"]["baseline"])
    assert export(own, "baseline") == 0
    assert exported_ids(own, "baseline") == old.encode(TEXT).ids


def test_a_stored_tokenizer_that_changed_is_refused_in_one_line(own: dict, capsys) -> None:
    run = own["runs"]["baseline"]
    (stored,) = [
        p
        for p in (own["root"] / "results" / "mlartifacts").rglob("tokenizer.json")
        if run.info.run_id in p.parts
    ]
    stored.write_text(stored.read_text() + "\n")  # the same tokenizer; other bytes all the same
    assert export(own, "baseline,pretrained") == 2
    err = capsys.readouterr().err.strip()
    sha = run.data.tags[TOKENIZER_SHA256_TAG][:12]
    assert err == (
        f"error: RUNS: run {run.info.run_id} (baseline): its tokenizer.json artifact has sha256 "
        f"{file_sha256(stored)[:12]}, not the {sha} it trained with (the stored file changed)"
    )
    assert not (own["root"] / "out").exists()
