"""``make ui-check``: the MLflow UI as a user sees it, in a real headless Chromium.

Serves ``mlflow ui`` on the store (a free port, one worker), opens the URL ``make ui`` prints for
GRID at SCALE, waits for the page's scripts, and checks what the browser rendered: every cell run
of the experiment by name (``<row>-s<seed>``) with its Avg PPL (``val/ppl/avg``) value. Writes a
screenshot to ``results/figures/ui_runs.png``. Needs Chromium (Debian's ``chromium`` package;
the Makefile target installs it); slow, so not part of ``make test``.

Exit status: 0 when the page shows them, 1 when it does not (what is missing is printed), 2 on
bad input (no such experiment, no browser).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from experiments.names import VAL_PPL_AVG, Kind
from sweep.grid import load_grid
from sweep.run.ranks import free_port
from sweep.store import Tracker, experiment_name
from sweep.store_urls import tracking_uri
from sweep.ui_view import runs_url

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _wait_for(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"mlflow ui did not answer at {url} within {timeout_s:.0f} s")


def _browser(browser: str, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000"]
    return subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=180)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="grids/table1.yaml")
    parser.add_argument("--scale", default="tiny")
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    browser = next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        print("error: no Chromium found (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    grid = load_grid(args.grid)
    uri = tracking_uri(args.results)
    tracker = Tracker(uri, experiment_name(grid.name, args.scale), args.results / "mlartifacts")
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.kind = '{Kind.CELL}'", max_results=5000)
    if not runs:
        print(f"error: experiment {tracker.experiment} has no cell run; make sweep first", file=sys.stderr)
        return 2
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1"]
        + ["--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    try:
        _wait_for(base)
        url = runs_url(base, tracker.experiment_id)
        dom = _browser(browser, "--window-size=1600,1000", "--dump-dom", url).stdout  # renders what fits
        shot = args.results / "figures" / "ui_runs.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        _browser(browser, f"--screenshot={shot.resolve()}", "--window-size=1600,1000", url)
    finally:
        server.terminate()
        server.wait(timeout=30)
    names = sorted(r.info.run_name for r in runs)
    missing = [n for n in names if n not in dom]
    # The Avg PPL column, not just its name (the sort button shows that): each run's value.
    values = {r.info.run_name: r.data.metrics.get(VAL_PPL_AVG) for r in runs}
    shown = {n: f"{math.floor(v * 100) / 100:.2f}" for n, v in values.items() if v is not None}  # a prefix
    missing += [f"{n}'s {VAL_PPL_AVG} {text}..." for n, text in shown.items() if text not in dom]
    if missing:
        print(f"FAIL: the page does not show {', '.join(missing)}")
        return 1
    print(f"PASS: the page shows all {len(names)} cell runs of {tracker.experiment} with their {VAL_PPL_AVG}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
