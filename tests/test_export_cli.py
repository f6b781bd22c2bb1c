"""``python -m sweep.cli export`` (``make export``) on the micro sweep's runs: the folders, a fresh
offline process loading them, the model card, and bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.checkpointing import load_weights
from experiments.model import GatedLM
from sweep.cli import main
from sweep.grid import load_grid
from tests.support import client_for, runs_of

LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
for folder in sys.argv[1:]:
    remote = "auto_map" in json.load(open(folder + "/config.json"))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=remote)
    ids = torch.tensor([tokenizer("the cat sat on the mat").input_ids])
    print(json.dumps({"class": type(model).__name__, "ids": ids[0].tolist(),
                      "logits": model(ids).logits[0, -1].tolist()}))
"""


def export(micro: dict, dest: Path, runs: str, *extra: str) -> int:
    args = ["export", "--grid", str(micro["grid"]), "--results", str(micro["results"]), "--runs", runs]
    return main([*args, "--dest", str(dest), *extra])


def harness_logits(micro: dict, row: str, run, ids: list[int]) -> torch.Tensor:
    """The last position's logits of the run's ``final.ckpt`` in the harness's own model."""
    (cell,) = load_grid(micro["grid"]).cells("tiny", seeds=[0], rows=[row])
    model = GatedLM(cell.config.model).eval()
    state = load_weights(Path(run.data.tags["checkpoint"]))
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]


def test_three_rows_export_and_a_fresh_offline_process_loads_them(
    micro: dict, tmp_path: Path, capsys
) -> None:
    assert export(micro, tmp_path, "baseline,sdpa_elementwise,moe") == 0
    folders = [tmp_path / "micro-tiny" / f"{row}_s0" for row in ("baseline", "sdpa_elementwise", "moe")]
    assert capsys.readouterr().out.count(": " + str(tmp_path)) == 3
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", LOAD, *map(str, folders)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [x["class"] for x in loaded] == ["Qwen3ForCausalLM", "Qwen3NextForCausalLM", "Qwen3MoeForCausalLM"]
    for row, x in zip(("baseline", "sdpa_elementwise", "moe"), loaded):
        (run,) = [r for r in runs_of(micro["results"], row) if r.data.tags["status"] == "finished"]
        ours = harness_logits(micro, row, run, x["ids"])
        assert ((ours - torch.tensor(x["logits"])).abs().max() / ours.abs().max()).item() <= 1e-5
        card = (tmp_path / "micro-tiny" / f"{row}_s0" / "README.md").read_text()
        assert run.info.run_id in card and f"{run.data.metrics['val/ppl/avg']:.3f}" in card
        assert "library_name: transformers" in card and "| numbers version |" in card
        paper = {"baseline": "row 1 of table1_moe", "sdpa_elementwise": "row 5 of table1_moe"}.get(row, "—")
        assert f"| paper row | {paper} |" in card and "| training tokens | 1,024 |" in card


def test_a_run_id_exports_and_an_existing_folder_needs_force(micro: dict, tmp_path: Path, capsys) -> None:
    (run,) = [r for r in runs_of(micro["results"], "moe") if r.data.tags["status"] == "finished"]
    assert export(micro, tmp_path, run.info.run_id) == 0
    assert (
        capsys.readouterr().out.strip() == f"moe_s0 ({run.info.run_id}): {tmp_path / 'micro-tiny' / 'moe_s0'}"
    )
    folder = tmp_path / "micro-tiny" / "moe_s0"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert export(micro, tmp_path, run.info.run_id) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {folder} exists: FORCE=1 replaces it"
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert export(micro, tmp_path, "moe", "--force") == 0
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp
    assert sorted(p.name for p in folder.parent.iterdir()) == ["moe_s0"]  # nothing beside it left


@pytest.mark.parametrize(
    "runs, message",
    [
        ("nope", "RUNS: 'nope' is neither a row of the grid nor a run id of the tracking store"),
        ("", "RUNS: give one or more row ids or run ids, a,b"),
    ],
)
def test_an_unknown_name_is_one_line_and_exit_2(micro: dict, tmp_path: Path, capsys, runs, message) -> None:
    assert export(micro, tmp_path, runs) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not tmp_path.joinpath("micro-tiny").exists()


@pytest.fixture
def copied(micro: dict, tmp_path: Path) -> dict:
    """The micro sweep's store and checkpoints copied, their checkpoint tags pointing at the copy."""
    results = tmp_path / "results"
    shutil.copytree(micro["results"], results)
    client = client_for(results)
    for row in ("baseline", "sdpa_elementwise", "moe"):
        for run in runs_of(results, row):
            old = Path(run.data.tags["checkpoint"])
            new = results / old.relative_to(micro["results"])
            client.set_tag(run.info.run_id, "checkpoint", str(new))
    return {**micro, "results": results}


def test_a_diverged_or_unfinished_run_is_one_line_and_exit_2(copied: dict, tmp_path: Path, capsys) -> None:
    client = client_for(copied["results"])
    (run,) = [r for r in runs_of(copied["results"], "moe") if r.data.tags["status"] == "finished"]
    client.set_tag(run.info.run_id, "status", "diverged")
    assert export(copied, tmp_path / "out", "moe") == 2
    err = capsys.readouterr().err.strip()
    grid = copied["grid"]
    none = "has no finished run at scale tiny (diverged: s0; no final weights)"
    assert err == f"error: RUNS: row 'moe' of {grid} {none}"
    assert export(copied, tmp_path / "out", run.info.run_id) == 2
    err = capsys.readouterr().err.strip()
    diverged = "is diverged, not finished: a diverged run has no final weights"
    assert err == f"error: RUNS: run {run.info.run_id} (moe) {diverged}"
    client.set_tag(run.info.run_id, "status", "killed")
    assert export(copied, tmp_path / "out", run.info.run_id) == 2
    assert capsys.readouterr().err.strip().endswith("is killed, not finished")
    assert not (tmp_path / "out").exists()


def test_a_damaged_checkpoint_is_one_line_and_exit_2_before_anything_is_written(
    copied: dict, tmp_path: Path, capsys
) -> None:
    (run,) = [
        r for r in runs_of(copied["results"], "sdpa_elementwise") if r.data.tags["status"] == "finished"
    ]
    checkpoint = Path(run.data.tags["checkpoint"])
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF
    checkpoint.write_bytes(bytes(data))
    assert export(copied, tmp_path / "out", "baseline,sdpa_elementwise") == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"error: RUNS: run {run.info.run_id}: checkpoint {checkpoint} is ") and "\n" not in err
    )
    assert not (tmp_path / "out").exists()  # baseline, first and whole, was not written either


def test_a_crash_mid_export_leaves_the_old_folder_and_no_half_written_one(
    micro: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import experiments.hf.folder as folder_module

    assert export(micro, tmp_path, "baseline") == 0
    folder = tmp_path / "micro-tiny" / "baseline_s0"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder.parent / ".baseline_s0.partial-1").mkdir()  # a killed export's leftovers

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(folder_module, "hf_tokenizer", crash)
    assert export(micro, tmp_path, "baseline", "--force") == 1
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["baseline_s0"]


def test_a_missing_store_is_refused_without_creating_one(tmp_path: Path, capsys) -> None:
    code = main(["export", "--results", str(tmp_path / "results"), "--runs", "baseline"])
    assert code == 2 and "nothing to export (make sweep makes it)" in capsys.readouterr().err
    assert not (tmp_path / "results" / "mlflow.db").exists()


def test_a_missing_export_extra_is_one_line_naming_the_install(
    micro: dict, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sweep.export import command

    monkeypatch.setattr(command, "PACKAGES", ("transformers", "no_such_package_for_export"))
    assert export(micro, tmp_path, "baseline") == 2
    assert capsys.readouterr().err.strip() == (
        "error: export needs no_such_package_for_export: pip install -e '.[export]' (make export installs it)"
    )
    assert not tmp_path.joinpath("micro-tiny").exists()


@pytest.mark.parametrize("factor", ["inf", "-inf", "nan", "-1", "0", "0.5", "abc"])
def test_a_yarn_factor_that_is_not_a_finite_number_of_at_least_1_is_one_line_and_exit_2(
    micro: dict, tmp_path: Path, capsys, factor: str
) -> None:
    assert export(micro, tmp_path, "baseline", f"--yarn={factor}") == 2
    got = repr(factor) if factor == "abc" else float(factor)
    assert capsys.readouterr().err == f"error: YARN: the factor must be a finite number >= 1, got {got}\n"
    assert not tmp_path.joinpath("micro-tiny").exists()


def test_a_yarn_factor_past_what_max_position_embeddings_holds_is_one_line_and_exit_2(
    micro: dict, tmp_path: Path, capsys
) -> None:
    assert export(micro, tmp_path, "baseline", "--yarn=1e300") == 2
    assert capsys.readouterr().err == (
        "error: YARN: 1e+300 x the training length 32 is more positions than max_position_embeddings "
        "holds (9,223,372,036,854,775,807)\n"
    )
    assert not tmp_path.joinpath("micro-tiny").exists()


@pytest.mark.parametrize("where", ["dest", "experiment folder"])
def test_a_destination_that_is_a_file_is_one_line_and_exit_2(
    micro: dict, tmp_path: Path, capsys, where: str
) -> None:
    file = tmp_path / "dest" if where == "dest" else tmp_path / "dest" / "micro-tiny"
    file.parent.mkdir(exist_ok=True)
    file.write_text("not a folder\n")
    assert export(micro, tmp_path / "dest", "baseline") == 2
    assert capsys.readouterr().err == f"error: DEST: {file} is not a folder\n"
    assert file.read_text() == "not a folder\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder without write permission")
def test_a_read_only_destination_is_one_line_and_exit_2(micro: dict, tmp_path: Path, capsys) -> None:
    dest = tmp_path / "dest"
    dest.mkdir(mode=0o555)
    try:
        assert export(micro, dest / "sub", "baseline") == 2
    finally:
        dest.chmod(0o755)
    assert capsys.readouterr().err == f"error: DEST: {dest} is not writable (Permission denied)\n"
    assert list(dest.iterdir()) == []
