"""MLflow's system metrics for each cell's run while it trains: CPU and memory always, disk and
network, and the GPU's utilisation, memory and power where there is one (through ``nvidia-ml-py``).

Logged as ``system/<name>`` (``system/cpu_utilization_percentage``,
``system/system_memory_usage_megabytes``, ``system/gpu_0_utilization_percentage``, ...) every
:data:`INTERVAL_S` seconds, plus one sample when the cell ends, so even a short cell has one. A
resumed run continues their steps. ``SWEEP_SYSTEM_METRICS=0`` (``make sweep SYSTEM_METRICS=0``,
``--no-system-metrics``) turns them off; MLflow's ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``
changes the interval.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

ENV = "SWEEP_SYSTEM_METRICS"  # "0" (or "false", "off", "no") turns them off
INTERVAL_S = 10.0


def enabled() -> bool:
    """Whether cells log system metrics (on unless :data:`ENV` says otherwise)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@contextlib.contextmanager
def system_metrics(uri: str, run_id: str, interval_s: float = INTERVAL_S) -> Iterator[None]:
    """Sample the machine into run ``run_id`` of the store at ``uri`` while the block runs.

    Never fails the cell: a monitor that cannot start or log is skipped (the metrics are an aid,
    not a result)."""
    if not enabled():
        yield
        return
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=uri
        )
        monitor.start()
    except Exception:  # noqa: BLE001 - psutil missing, a store hiccup: train without them
        yield
        return
    try:
        yield
    finally:
        monitor.finish()
        with contextlib.suppress(Exception):  # the run may be gone (deleted in the UI meanwhile)
            monitor.collect_metrics()  # the last stretch, which the monitor's loop never publishes
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
