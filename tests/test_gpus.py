"""Every GPU busy (issue 44): the workers a sweep starts on a GPU machine and the GPUs each sees,
with the machine's GPUs faked (``CUDA_VISIBLE_DEVICES``, torch's device count)."""

from __future__ import annotations

import pytest
import torch

from sweep.run import gpus
from sweep.run.gpus import GpuLayoutError, auto_workers, visible_gpus, worker_environments


def test_auto_is_one_worker_per_gpu_times_cells_per_gpu() -> None:
    eight = [str(i) for i in range(8)]
    assert auto_workers(1, 1, eight) == 8
    assert auto_workers(1, 3, eight) == 24
    assert auto_workers(2, 1, eight) == 4  # cells of devices: 2 take two GPUs a worker
    assert auto_workers(4, 2, ["0", "1"]) == 2  # fewer GPUs than a cell wants: refused later, not 0


def test_auto_without_gpus_is_one_worker_per_usable_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus.os, "cpu_count", lambda: 6)
    monkeypatch.setattr(gpus.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert auto_workers(1, 3, []) == 6
    monkeypatch.setattr(gpus.os, "sched_getaffinity", lambda pid: {3})  # taskset -c 3
    assert auto_workers(1, 3, []) == 1


def test_a_cpu_machine_naming_a_gpu_gets_one_worker_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CUDA_VISIBLE_DEVICES=0`` where torch sees no CUDA device: no GPU, so a worker per core."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpus.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert visible_gpus() == []
    assert auto_workers(1, 1) == 4
    assert worker_environments(4, 1, 1) == [{}, {}, {}, {}]


def test_cuda_stops_reading_the_variable_at_its_first_invalid_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpus.cuda_entries("0,-1,2") == ["0"]
    assert gpus.cuda_entries("3, 1,x,0") == ["3", "1"]
    assert gpus.cuda_entries("GPU-8f1c,MIG-2a,1") == ["GPU-8f1c", "MIG-2a", "1"]
    assert gpus.cuda_entries("-1") == [] and gpus.cuda_entries("") == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # even a count that disagrees
    assert visible_gpus() == ["0"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in worker_environments(2, 1, 1)] == ["0", "0"]


def test_taskset_to_one_core_starts_one_worker() -> None:
    """A real ``taskset -c 0`` child process: the affinity, not the machine's core count."""
    import shutil
    import subprocess
    import sys

    if shutil.which("taskset") is None:
        pytest.skip("no taskset on this machine")
    code = "from sweep.run.gpus import auto_workers; print(auto_workers(1, 1, []))"
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "1", out.stderr


def test_each_worker_sees_its_own_gpus_spread_first() -> None:
    envs = worker_environments(6, 1, 2, ["0", "1", "2"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2", "0", "1", "2"]
    pairs = worker_environments(2, 2, 1, ["4", "5", "6", "7"])  # a node's last four, by their names
    assert [e["CUDA_VISIBLE_DEVICES"] for e in pairs] == ["4,5", "6,7"]
    assert worker_environments(3, 1, 1, []) == [{}, {}, {}]  # a CPU machine: nothing set


def test_a_cell_wider_than_the_machine_is_refused() -> None:
    with pytest.raises(GpuLayoutError, match="train.devices = 4 GPUs, but this machine shows 2"):
        worker_environments(1, 4, 1, ["0", "1"])


def test_visible_gpus_follow_the_variable_or_the_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # CUDA counts what the variable shows
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert visible_gpus() == ["3", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert visible_gpus() == ["0", "1", "2", "3"]


def test_start_processes_gives_each_worker_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The local launcher starts each worker process with its own CUDA_VISIBLE_DEVICES (the
    environment each ``Popen`` gets is recorded; the children run ``pass``)."""
    import subprocess
    import sys

    from sweep.run import driver
    from sweep.signals import StopRequest

    seen: list[str] = []
    real_popen = subprocess.Popen

    def popen(command, env, **kw):  # noqa: ANN001
        seen.append(env.get("CUDA_VISIBLE_DEVICES", "<unset>"))
        return real_popen([sys.executable, "-c", "pass"], env=env, **kw)

    monkeypatch.setattr(driver.subprocess, "Popen", popen)
    with StopRequest() as stop:
        driver.start_processes(["x"], 4, stop, print, {}, worker_environments(4, 1, 2, ["0", "1"]))
    assert seen == ["0", "1", "0", "1"]


def test_a_sweep_on_a_two_gpu_machine_starts_its_workers_on_their_gpus(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``make sweep CELLS_PER_GPU=2`` on a machine showing GPUs 0 and 1: four workers, spread
    over the two, through the CLI and the driver (the workers themselves are not started)."""
    from sweep.cli import main
    from sweep.run import driver
    from tests.support import MICRO, use_repo_cache, write_grid

    use_repo_cache(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    seen: dict = {}

    def start(command, count, stop, out, env, each=None):  # noqa: ANN001
        seen.update(count=count, each=each)
        return set()

    monkeypatch.setattr(driver, "start_processes", start)
    grid = write_grid(tmp_path, MICRO)
    main(["sweep", "--grid", str(grid), "--results", str(tmp_path / "results"), "--workers", "auto",
          "--cells-per-gpu", "2"])  # fmt: skip
    assert "for 4 workers" in capsys.readouterr().out
    assert seen["count"] == 4
    assert [e["CUDA_VISIBLE_DEVICES"] for e in seen["each"]] == ["0", "1", "0", "1"]
