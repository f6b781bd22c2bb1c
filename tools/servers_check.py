"""``make servers-check``: the multi-machine recipe of docs/resuming.md run against real servers.

1. Trains a small grid (three cells) in one process with the default SQLite stores: the reference.
2. Starts a PostgreSQL cluster (Debian's package) and an MLflow tracking server backed by it on
   127.0.0.1 (:mod:`tools.servers`), with databases ``mlflow`` and ``optuna``.
3. Runs the recipe's command on two "machines" at once, each in its own results folder, with
   ``MLFLOW_TRACKING_URI`` set to the server and ``--storage`` to the Optuna database:
   ``python -m sweep.cli sweep --grid G --scale tiny --workers 1 --storage postgresql+psycopg://...``
   (what ``make sweep WORKERS=1 STORAGE=...`` runs, with ``--heartbeat 5``; both "machines" are
   this host, so a dead worker's cell is taken over at once, by its pid). Their
   ``results/checkpoints`` is one shared folder, as the recipe asks for a cell to resume on
   another machine.
4. Once some worker's cell has a checkpoint, SIGKILLs that worker mid-cell (with ``--workers 1``
   the machine's sweep itself, whose one worker runs in its process); the same command is
   started again on that machine, as a person would.
5. Checks, through the server: every cell has exactly one run, finished, whose ``train/loss``
   history equals the reference's (relative 1e-5, each step once); the killed cell's run was
   resumed by another worker; its artifacts went through the server; every cell has one
   COMPLETE queue trial. Then a third run of the command trains nothing.

Everything runs in a temporary folder, removed at the end (``--keep`` keeps it). Exit status: 0
when every check passes, 1 when one fails (each failure one line), 2 when PostgreSQL or psycopg
is missing.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from tools.servers import ServerError, missing, mlflow_server, postgres

ROOT = Path(__file__).resolve().parents[1]
STEPS = 240  # long enough that a worker is killed mid-cell after its first checkpoint
KILL_AT = 10  # the first checkpoint's step
GRID = f"""\
name: servers
title: "Servers check"
base:
  model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}}
  train: {{max_steps: {STEPS}, batch_size: 4, seq_len: 32, warmup_steps: 4, val_every: 80, val_tokens: 512,
          max_lr: 2e-3, checkpoint_every: {KILL_AT}}}
  data: {{vocab_size: 512, max_chars_per_source: 200000}}
scales: {{tiny: {{}}}}
rows:
  - {{id: baseline, label: "Baseline"}}
  - {{id: sdpa_elementwise, label: "SDPA elementwise (G1)", model: {{gate: {{position: sdpa}}}}}}
  - {{id: moe, label: "MoE FFN, 4 experts top-2", model: {{moe: {{n_experts: 4, top_k: 2, expert_dim: 16}}}}}}
"""
EXPERIMENT = "servers-tiny"
HEARTBEAT_S = 5  # a worker's fence trips after 10 s without one: not under load on 2 cores
TRAINED = ("finished", "resumed", "restarted")  # queue outcomes of a trial that trained its cell


def sweep_command(
    grid: Path, results: Path, storage: str | None, heartbeat_s: int = HEARTBEAT_S
) -> list[str]:
    """The recipe's command (``make sweep WORKERS=1 STORAGE=...``) into ``results``; without
    ``storage``, the one-process sweep on the default SQLite stores."""
    command = [sys.executable, "-m", "sweep.cli", "sweep", "--grid", str(grid), "--scale", "tiny"]
    command += ["--results", str(results)]
    if storage:
        command += ["--workers", "1", "--storage", storage, "--heartbeat", str(heartbeat_s)]
    return command


def environment(tracking_uri: str | None) -> dict[str, str]:
    """This process's environment with the repository importable, the corpus cache shared by
    every machine (built once) and ``MLFLOW_TRACKING_URI`` set to ``tracking_uri`` (or unset)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.setdefault("GATED_ATTN_CACHE", str(ROOT / ".cache"))
    env.pop("MLFLOW_TRACKING_URI", None)
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start ``command`` with its output appended to ``log``."""
    with open(log, "a") as sink:
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)


def first_checkpoint(folder: Path, procs: list[subprocess.Popen], timeout_s: float = 600) -> str:
    """Wait until some run under ``folder`` (``checkpoints/<experiment>/<run_id>``) has a
    ``step*.ckpt``; return its run id.

    Raises:
        RuntimeError: every process ended first, or none came within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ckpt in sorted(folder.glob(f"{EXPERIMENT}/*/step*.ckpt")):
            return ckpt.parent.name
        if all(p.poll() is not None for p in procs):
            raise RuntimeError("every machine ended before a checkpoint was written")
        time.sleep(0.05)
    raise RuntimeError(f"no checkpoint within {timeout_s:.0f} s")


def loss_history(client, run_id: str) -> list[tuple[int, float]]:
    """``train/loss`` of a run as (step, value), in step order."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))


def cell_runs(client) -> list:
    """Every cell run of the check's experiment, deleted ones included."""
    from mlflow.entities import ViewType

    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], "tags.kind = 'cell'", run_view_type=ViewType.ALL)


def same_losses(got: list[tuple[int, float]], want: list[tuple[int, float]], rel: float = 1e-5) -> bool:
    """The same steps, each once, and every loss within ``rel`` of the reference's."""
    if [s for s, _ in got] != [s for s, _ in want]:
        return False
    return all(abs(a - b) <= rel * max(abs(b), 1e-12) for (_, a), (_, b) in zip(got, want))


def check_outcome(
    server, reference, victim_run: str, victim: str, queue_url: str, artifacts: Path
) -> list[str]:
    """The failures (one line each) of the servers' final state against the reference run."""
    import optuna

    failures = []
    want = {r.data.tags["run_key"]: r for r in cell_runs(reference)}
    runs = cell_runs(server)
    counts = Counter(r.data.tags.get("run_key") for r in runs)
    if set(counts) != set(want) or any(n != 1 for n in counts.values()):
        failures.append(f"runs per cell: {dict(counts)}; want one for each of {sorted(want)}")
    for run in runs:
        key, row = run.data.tags.get("run_key"), run.data.tags.get("row", "?")
        if run.info.status != "FINISHED" or run.data.tags.get("status") != "finished":
            status = run.data.tags.get("status")
            failures.append(f"{row}: run {run.info.run_id} is {run.info.status} / {status}")
        if key in want:
            got = loss_history(server, run.info.run_id)
            if not same_losses(got, loss_history(reference, want[key].info.run_id)):
                failures.append(f"{row}: train/loss ({len(got)} points) differs from the one-process run's")
        if not server.list_artifacts(run.info.run_id):
            failures.append(f"{row}: run {run.info.run_id} has no artifacts on the server")
    (killed,) = [r for r in runs if r.info.run_id == victim_run] or [None]
    if killed is None:
        failures.append(f"the killed worker's run {victim_run} is gone")
    elif killed.data.tags.get("resumed") != "1" or killed.data.tags.get("worker") == victim:
        tags = {k: killed.data.tags.get(k) for k in ("resumed", "worker")}
        failures.append(f"the killed cell's run was not resumed by another worker: {tags}")
    if not any(artifacts.rglob("*.json")):
        failures.append(f"no artifact file reached the server's destination {artifacts}")
    study = optuna.load_study(study_name="cells-tiny", storage=queue_url)
    trained = Counter(  # the trials that trained a cell; a younger twin reads duplicate or skipped
        t.user_attrs.get("run_key")
        for t in study.get_trials()
        if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("outcome") in TRAINED
    )
    if trained != Counter(list(want)):
        failures.append(f"queue trials that trained each cell: {dict(trained)}; want one each")
    return failures


def machines_run(
    grid: Path, work: Path, uri: str, queue_url: str, out: Callable[[str], None]
) -> tuple[str, str, dict[str, int], list[str]]:
    """Steps 3-4 of the module docstring: two machines, a worker killed mid-cell, its machine's
    command run again, all until every machine's sweep ends.

    Returns:
        The killed worker's run id, the worker (``host:pid``), each sweep's exit status and the
        command of a machine.
    """
    import psutil
    from mlflow import MlflowClient

    shared = work / "shared-checkpoints"  # the machines' results/checkpoints, on "shared storage"
    shared.mkdir()
    env = environment(uri)
    commands, logs = {}, {}
    for name in ("machine-a", "machine-b"):
        results = work / name / "results"
        results.mkdir(parents=True)
        (results / "checkpoints").symlink_to(shared)
        commands[name], logs[name] = sweep_command(grid, results, queue_url), work / name / "sweep.log"
    out(f"on each machine: MLFLOW_TRACKING_URI={uri} python {' '.join(commands[name][1:])}")
    procs = {n: start(c, env, logs[n]) for n, c in commands.items()}
    try:
        run_id = first_checkpoint(shared, list(procs.values()))
        victim = MlflowClient(tracking_uri=uri).get_run(run_id).data.tags["worker"]
        pid = int(victim.rsplit(":", 1)[1])
        # WORKERS=1: the worker is the machine's sweep itself; else one of its worker processes
        owner = next(
            (n for n, p in procs.items() if pid in {p.pid, *(c.pid for c in _children(psutil, p.pid))}), None
        )
        if owner is None:
            raise RuntimeError(f"run {run_id}'s worker {victim} is no machine's worker")
        os.kill(pid, signal.SIGKILL)
        step = max(p.stem for p in (shared / EXPERIMENT / run_id).glob("step*.ckpt"))
        out(f"SIGKILL {owner}'s worker {victim} mid-cell (run {run_id}, newest checkpoint {step})")
        codes = {f"{owner}, its worker killed": procs[owner].wait(timeout=600)}
        out(f"{owner}'s sweep exited {codes[f'{owner}, its worker killed']}; the same command again there")
        procs[owner] = start(commands[owner], env, logs[owner])
        codes.update({n: p.wait(timeout=900) for n, p in procs.items()})
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return run_id, victim, codes, commands["machine-a"]


def _children(psutil: ModuleType, pid: int) -> list:
    """The child processes of ``pid`` (none once it has ended)."""
    try:
        return psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []


def run_check(work: Path, out: Callable[[str], None] = print) -> int:
    """Run the whole check in ``work``; return the exit status (see the module docstring)."""
    from mlflow import MlflowClient

    t0 = time.perf_counter()
    say = lambda line: out(f"[{time.perf_counter() - t0:5.0f} s] {line}")  # noqa: E731
    grid = work / "servers.yaml"
    grid.write_text(GRID)
    ref = work / "reference" / "results"
    done = subprocess.run(
        sweep_command(grid, ref, None), env=environment(None), cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        out(f"FAIL: the one-process reference sweep exited {done.returncode}:\n{done.stdout[-2000:]}")
        return 1
    say(f"reference: the grid in one process on the default SQLite stores ({ref})")
    reference = MlflowClient(tracking_uri=f"sqlite:///{ref / 'mlflow.db'}")
    with postgres(["mlflow", "optuna"]) as urls:
        say(f"PostgreSQL: {urls['mlflow']}, {urls['optuna']}")
        artifacts = work / "mlartifacts"
        with mlflow_server(urls["mlflow"], artifacts, work / "mlflow-server.log") as uri:
            say(f"MLflow server: {uri} (artifacts to {artifacts})")
            run_id, victim, codes, command = machines_run(grid, work, uri, urls["optuna"], say)
            say(f"every machine's sweep ended: exit statuses {codes}")
            server = MlflowClient(tracking_uri=uri)
            failures = check_outcome(server, reference, run_id, victim, urls["optuna"], artifacts)
            if any(code != 0 for name, code in codes.items() if "killed" not in name):
                failures.append(f"a machine's last sweep failed: {codes} (its log: sweep.log)")
            again = subprocess.run(command, env=environment(uri), cwd=ROOT, capture_output=True, text=True)
            if again.returncode != 0 or "finished 0, resumed 0, skipped 3" not in again.stdout:
                failures.append(f"a third sweep trained something or failed: {again.stdout[-500:]}")
    for line in failures:
        out(f"FAIL: {line}")
    if not failures:
        say("servers check passed: each of 3 cells has one finished run, losses equal the reference's")
    return 1 if failures else 0


def run_in_temp(check: Callable[[Path], int], name: str, doc: str, argv: list[str] | None) -> int:
    """``python -m tools.<name> [--keep]``: ``check`` run in a new temporary folder, removed at
    the end unless ``--keep`` (or a failure) keeps it; exit 2 when PostgreSQL or psycopg is
    missing."""
    parser = argparse.ArgumentParser(prog=f"python -m tools.{name}", description=doc.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, stores)")
    args = parser.parse_args(argv)
    why = missing()
    if why:
        print(f"{name.replace('_', ' ')}: cannot run: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix=f"gated-{name.split('_')[0]}-"))
    try:
        return check(work)
    except (ServerError, RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"FAIL: {err} (logs in {work})", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.servers_check [--keep]``; see the module docstring."""
    return run_in_temp(run_check, "servers_check", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
