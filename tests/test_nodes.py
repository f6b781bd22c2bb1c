"""A cell on several machines: the tasks of one submitit job as its nodes (here, on this machine).

The job's first task leads (a queue worker), the others follow it through a TCPStore; a MoE cell
on two "nodes" of one rank each trains as in one process. A machine whose ranks fail ends the
cell on every machine, with its line.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from experiments.distributed import NodeFailed, free_port
from sweep.cli import main
from sweep.run import nodes
from sweep.run.nodes import Leader, NodeGroup, _store, follow, store_port
from sweep.run.slurm import ClusterSettings, make_executor
from tests.conftest import MICRO
from tests.test_ddp import _histories, assert_close, weights

pytest.importorskip("submitit", reason="the cluster launcher needs submitit (a core dependency)")
GLOO = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")


def where_am_i() -> tuple[int, int, int]:
    """A rank's (RANK, WORLD_SIZE, NODE_RANK), as spawn_ranks set them."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["NODE_RANK"])


def node_1_fails() -> None:
    """Node 1's rank raises; node 0's waits as it would in a collective that never completes."""
    if os.environ["NODE_RANK"] == "1":
        raise ValueError("disk full on node 1")
    time.sleep(300)


def lead_and_follow(fn, devices: int) -> tuple[object, list[str], int]:
    """One cell of ``fn`` on a group of 2 nodes of this machine: the leader here, the follower in a
    thread. Returns what the leader's train gave (or raised), the follower's lines and status."""
    group = NodeGroup(2, "127.0.0.1", free_port())
    leader = Leader(group)
    lines: list[str] = []
    status: list[int] = []
    follower = threading.Thread(target=lambda: status.append(follow(group, 1, lines.append)))
    follower.start()
    try:
        result: object = leader.train(fn, devices)
    except NodeFailed as err:
        result = err
    finally:
        leader.close()
        follower.join(timeout=120)
    assert not follower.is_alive()
    return result, lines, status[0]


def test_the_nodes_ranks_number_on_from_node_0() -> None:
    """Two nodes of two ranks: node 1 holds ranks 2 and 3 of four; the leader gets rank 0's value."""
    result, lines, status = lead_and_follow(where_am_i, 2)
    assert result == (0, 4, 0)
    assert lines == ["node 1: cell 0 on 2 ranks"] and status == 0


def test_a_follower_whose_rank_fails_ends_the_cell_on_every_node() -> None:
    started = time.monotonic()
    result, lines, status = lead_and_follow(node_1_fails, 1)
    assert isinstance(result, NodeFailed)
    assert str(result).startswith("node 1: ProcessRaisedException: ValueError: disk full on node 1")
    assert time.monotonic() - started < 60  # not node 0's 300 s wait
    assert lines[-1].startswith("node 1: cell 0 failed\nTraceback") and status == 0
    assert "ValueError: disk full on node 1" in lines[-1]  # the whole traceback, in the task's log


def test_every_task_of_a_job_finds_one_store_port_and_the_leader_its_group() -> None:
    assert store_port("123456") == store_port("123456") != store_port("123457")
    assert all(20000 <= store_port(str(j)) < 32768 for j in range(500))  # below the ephemeral ports
    group = NodeGroup(4, "gpu-node-7", 31234)
    os.environ["GATED_ATTN_NODES"] = group.to_env()
    try:
        assert NodeGroup.from_env() == group
    finally:
        del os.environ["GATED_ATTN_NODES"]


def test_ctrl_c_on_the_leader_tells_the_followers_the_cell_failed(monkeypatch) -> None:
    monkeypatch.setattr(nodes, "LEAVE_WAIT_S", 0.5)  # no follower will say it left
    group = NodeGroup(2, "127.0.0.1", free_port())
    leader = Leader(group)
    follower = _store(group, leader=False)

    def interrupt() -> None:
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            leader.train(time.sleep, 1, 300, watch=interrupt)
        assert follower.get("failed/0").decode() == "node 0: KeyboardInterrupt: "
    finally:
        leader.close()


def test_a_cell_the_follower_cannot_unpickle_fails_with_its_line_and_the_follower_goes_on() -> None:
    group = NodeGroup(2, "127.0.0.1", free_port())
    leader = Leader(group)
    leader.store.set("cell/0", b"cno_such_module_here\nrun\n.")  # pickle of no_such_module_here.run
    leader.store.set("end", b"1")
    lines: list[str] = []
    assert follow(group, 1, lines.append) == 0
    assert leader.store.get("failed/0").decode() == (
        "node 1: ModuleNotFoundError: No module named 'no_such_module_here'"
    )
    assert lines[0].startswith("node 1: cell 0 failed\nTraceback") and leader.store.add("left", 0) == 1


def test_a_follower_with_no_leader_says_where_it_looked_and_exits_1(monkeypatch) -> None:
    monkeypatch.setattr(nodes, "STORE_TIMEOUT_S", 2)
    group = NodeGroup(2, "127.0.0.1", free_port())
    lines: list[str] = []
    assert follow(group, 1, lines.append) == 1
    assert lines[0].startswith(f"node 1: no leader's store at 127.0.0.1:{group.store_port} after 2 s")


def test_the_leader_opens_its_store_before_the_corpus_is_built(tmp_path: Path, monkeypatch) -> None:
    """Followers start with the job; the leader's corpus build (``prepare_sweep``) can outlast
    their wait for its store, so the store opens first."""
    from sweep.run import queue

    monkeypatch.setattr(nodes, "LEAVE_WAIT_S", 0.5)
    monkeypatch.setattr(nodes, "STORE_TIMEOUT_S", 5)  # a store opened late fails in seconds
    group = NodeGroup(2, "127.0.0.1", free_port())
    monkeypatch.setenv(nodes.NODES_ENV, group.to_env())
    reached = []

    def building_the_corpus(*args: object, **kwargs: object) -> None:
        follower = _store(group, leader=False)  # connects at once: the store is open
        reached.append(follower.check(["end"]))
        raise RuntimeError("stop after the check")

    monkeypatch.setattr(queue, "prepare_sweep", building_the_corpus)
    with pytest.raises(RuntimeError, match="stop after the check"):
        queue.run_worker(None, [], tmp_path, "sqlite://", 30, None, None)
    assert reached == [False]


def test_a_two_node_job_asks_slurm_for_two_nodes_of_one_task(tmp_path: Path, monkeypatch) -> None:
    import submitit

    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # "srun is here"
    executor = make_executor(ClusterSettings("slurm", tmp_path, gpus_per_worker=8, nodes=2))
    script = executor._executor._make_submission_file_text("python -m sweep.cli worker", "uid")
    for flag in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8"):
        assert f"#SBATCH {flag}" in script


def test_a_cell_on_two_nodes_is_refused_without_a_cluster_launcher(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "micro.yaml"
    path.write_text(MICRO.replace("expert_dim: 16}}}", "expert_dim: 16}}, train: {num_nodes: 2}}"))
    code = main(["sweep", "--grid", str(path), "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"error: {path}: row 'moe': train.num_nodes: num_nodes = 2: a cell on several machines trains "
        "in a cluster job of as many nodes (LAUNCHER=slurm, or submitit-local to try it here)"
    )
    args = [
        "sweep",
        "--grid",
        str(path),
        "--results",
        str(tmp_path / "results"),
        "--launcher",
        "submitit-local",
    ]
    assert main([*args, "--workers", "1"]) == 2  # one job size per sweep: 1 and 2 nodes mixed
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: {path}: row 'baseline': train.num_nodes: num_nodes = 1, but row 'moe' has 2"
    )
    assert not (tmp_path / "results").exists()


@GLOO
@pytest.mark.slow
def test_a_moe_cell_on_two_nodes_of_one_job_trains_as_in_one_process(
    tmp_path: Path, repo_cache: None
) -> None:
    """``train: {num_nodes: 2, strategy: ddp}`` through ``--launcher submitit-local``: one job of
    two tasks, each a node of one gloo rank. Its run holds every metric of the one-process run,
    each step once, with the same values (but wall-clock figures), and its final weights."""
    two_nodes = MICRO.replace("max_lr: 2e-3}", "max_lr: 2e-3, num_nodes: 2, strategy: ddp}")
    found = {}
    for name, text, extra in (
        ("one", MICRO, []),
        ("two", two_nodes, ["--launcher", "submitit-local", "--workers", "1", "--gpus-per-worker", "0"]),
    ):
        (tmp_path / name).mkdir()
        grid = tmp_path / name / "grid.yaml"
        grid.write_text(text)
        results = tmp_path / name / "results"
        assert main(["sweep", "--grid", str(grid), "--results", str(results), "--rows", "moe", *extra]) == 0
        found[name] = _histories(results)
    one, two = found["one"], found["two"]
    assert one.keys() == two.keys() and "train/loss" in one
    for key in {k for k in one if not k.startswith("system/")} - {"train/tokens_per_s"}:
        assert [s for s, _ in two[key]] == [s for s, _ in one[key]], key
        assert [v for _, v in two[key]] == pytest.approx([v for _, v in one[key]], rel=1e-4, abs=1e-6), key
    finals = [next((tmp_path / n / "results" / "checkpoints").glob("*/*/final.ckpt")) for n in ("one", "two")]
    assert_close(weights(finals[1]), weights(finals[0]))
    logs = "".join(p.read_text() for p in (tmp_path / "two" / "results" / "slurm").glob("*/*_1_log.out"))
    assert "node 1: cell 0 on 1 ranks" in logs  # the second task trained its rank
