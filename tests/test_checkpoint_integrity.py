"""Checkpoints are checked before they are trusted: each is written with its size and sha256
beside it, and a file cut short, grown or overwritten since is named in one line and never
resumed from, started from (a later stage) or scored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from experiments.checkpointing import (
    AtomicCheckpointIO,
    CheckpointDamaged,
    checkpoint_problem,
    load_weights,
    sum_file,
)
from experiments.checksums import file_sha256
from sweep.cli import main
from tests.support import ROOT, STAGED, runs_of, write_grid

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults


def saved(tmp_path: Path) -> Path:
    path = tmp_path / "final.ckpt"
    state = {"state_dict": {"model.w": torch.arange(1000, dtype=torch.float32)}}
    AtomicCheckpointIO().save_checkpoint(state, path)
    return path


def test_a_checkpoint_is_written_with_its_size_and_sha256(tmp_path: Path) -> None:
    path = saved(tmp_path)
    record = json.loads(sum_file(path).read_text())
    assert record == {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final.ckpt", "final.ckpt.sha256"]  # no .tmp
    assert checkpoint_problem(path) is None
    assert torch.equal(load_weights(path)["model.w"], torch.arange(1000, dtype=torch.float32))


def _junk_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-600:-500] = bytes(100)  # inside the tensor's bytes: still a whole zip archive
    path.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "cut in half": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "bytes, "),
    "grown": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "bytes, "),
    "junk of the same size": (_junk_same_size, "changed since it was written (another sha256)"),
    "record edited": (lambda p: sum_file(p).write_text('{"bytes": 1, "sha256": "0"}'), "bytes, 1 when"),
    "record unreadable": (lambda p: sum_file(p).write_text("{"), "its record final.ckpt.sha256 cannot"),
    "emptied": (lambda p: p.write_bytes(b""), "an empty file"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_never_loaded(kind: str, tmp_path: Path) -> None:
    damage, problem = DAMAGE[kind]
    path = saved(tmp_path)
    damage(path)
    assert problem in checkpoint_problem(path)
    with pytest.raises(CheckpointDamaged) as err:
        load_weights(path)
    assert str(err.value).startswith(f"checkpoint {path} is ")
    assert "train its cell again (FORCE=1 with its row in ROWS)" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_file_that_matches_a_forged_record_but_is_not_weights_is_one_line(tmp_path: Path) -> None:
    path = saved(tmp_path)
    path.write_bytes(os.urandom(path.stat().st_size))
    sum_file(path).write_text(json.dumps({"bytes": path.stat().st_size, "sha256": file_sha256(path)}))
    with pytest.raises(CheckpointDamaged) as err:
        load_weights(path)
    assert str(err.value).startswith(f"checkpoint {path} cannot be read as weights (")
    assert "\n" not in str(err.value) and "weights_only=False" not in str(err.value)


def test_a_checkpoint_from_before_the_record_is_checked_as_an_archive(tmp_path: Path) -> None:
    path = saved(tmp_path)
    sum_file(path).unlink()
    assert checkpoint_problem(path) is None
    path.write_bytes(path.read_bytes()[:4096])
    assert checkpoint_problem(path) == "not a whole torch archive (truncated?)"
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path / "absent.ckpt")


def test_a_stage_does_not_start_from_a_damaged_parent(tmp_path: Path, repo_cache: None, capsys) -> None:
    grid, results = write_grid(tmp_path, STAGED, "micro.yaml"), tmp_path / "r"
    sweep = ["sweep", "--grid", str(grid), "--results", str(results), "--rows"]
    assert main([*sweep, "baseline"]) == 0
    (parent,) = runs_of(results, "baseline")
    weights = Path(parent.data.tags["checkpoint"])
    _junk_same_size(weights)
    capsys.readouterr()
    assert main([*sweep, "baseline_long"]) == 1
    out = capsys.readouterr().out
    assert (
        f"baseline_long s0 FAILED: its parent row baseline s0's weights {weights} are changed since it "
        "was written (another sha256) (FORCE=1 ROWS=baseline retrains it)"
    ) in out
    assert runs_of(results, "baseline_long") == []  # nothing trained on the damaged weights
    assert main([*sweep, "baseline", "--force"]) == 0
    assert main([*sweep, "baseline_long"]) == 0
    assert [r.data.tags["status"] for r in runs_of(results, "baseline_long")] == ["finished"]


DRIVER = """
import sys, time
from sweep.signals import StopRequest
from sweep.run.driver import start_processes
start_processes(sys.argv[1:], 2, StopRequest(), print, {})
"""

WORKER = """
import os, signal, sys, time
from pathlib import Path
def saved(signum, frame):
    Path(sys.argv[1], str(os.getpid())).write_text(str(signum))
    sys.exit(143)
signal.signal(signal.SIGTERM, saved)
Path(sys.argv[1], "started-" + str(os.getpid())).touch()
time.sleep(120)
"""


def test_local_workers_stop_saved_when_their_driver_is_killed_outright(tmp_path: Path) -> None:
    """``kill -9`` of the sweep's process (or the OOM killer) leaves no worker training on: each
    gets SIGTERM from the kernel, which stops a real worker at a step with its cell saved."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", WORKER, str(tmp_path)]
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, *command], env=env, cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started-*"))) < 2:
        assert time.monotonic() < deadline and driver.poll() is None, "the workers did not start"
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=10)
    pids = [int(p.name.removeprefix("started-")) for p in tmp_path.glob("started-*")]
    while not all((tmp_path / str(pid)).exists() for pid in pids):
        assert time.monotonic() < deadline, "a worker trained on after its driver died"
        time.sleep(0.05)
    assert {(tmp_path / str(pid)).read_text() for pid in pids} == {str(int(signal.SIGTERM))}
