"""A training process's set-up: its torch threads, and Lightning's and MLflow's noise kept out of
the sweep's log."""

from __future__ import annotations

import logging
import os
import warnings

import torch

#: Torch threads of every cell on the CPU. Fixed, so a cell's arithmetic, and so its numbers, does
#: not depend on how many workers share the machine: the workers are the parallelism. On 2 cores
#: two one-thread workers trained 1.49x the tokens per second of one two-thread process.
CELL_THREADS = 1


def pin_threads() -> None:
    """Set this process's torch threads to :data:`CELL_THREADS`."""
    torch.set_num_threads(CELL_THREADS)


def quiet_lightning() -> None:
    """Keep Lightning's banner lines, small-data warnings and MLflow's logged tracebacks out of
    the sweep's log."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is imported
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    # The SQL store logs every database error with its traceback, then raises it as an
    # MlflowException, which the sweep reports in one line (a cell's failure, a store gone).
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*to avoid cluttering logs.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    # a SLURM login node, or a job whose worker trains its cell in one process or under torchrun
    warnings.filterwarnings("ignore", ".*The `srun` command is available on your system but is not used.*")
    warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", ".*resuming from a checkpoint that ended before the epoch ended.*")
