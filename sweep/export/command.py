"""``python -m sweep.cli export --runs a,b`` (``make export``): each finished run as a Hugging Face
transformers folder, ``<dest>/<experiment>/<row>_s<seed>``.

Every name, run, checkpoint and destination is checked before the first folder is written; each
folder is written beside its place and renamed into it (``experiments.hf.folder``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from experiments.model import YarnScaling

#: the import names of the ``export`` extra
PACKAGES = ("transformers", "safetensors", "accelerate")
INSTALL = "pip install -e '.[export]' (make export installs it)"


class ExportUnavailable(RuntimeError):
    """A package of the ``export`` extra is missing; one line naming the install command."""


def check_packages() -> None:
    """Raises:
    ExportUnavailable: transformers, safetensors or accelerate is not installed."""
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ExportUnavailable(f"export needs {', '.join(missing)}: {INSTALL}")


def run_export(args: argparse.Namespace, grid, results: Path, cache: Path | None) -> int:
    """The ``export`` command: 0 when every folder is written; 2 with one line on bad input (an
    unknown, unfinished or diverged run, a damaged checkpoint, an existing destination without
    ``--force``, a YaRN factor below 1, the ``export`` extra missing), nothing written."""
    from experiments.checkpointing import CheckpointDamaged
    from experiments.config import ConfigError
    from sweep.export.runs import ExportError

    dest = Path(args.dest) if args.dest else None
    try:
        export_runs(args.runs, grid, args.scale, results, dest, args.force, args.yarn, cache)
    except ConfigError as err:
        print(f"error: --yarn: {err.message}", file=sys.stderr)
        return 2
    except (ExportError, ExportUnavailable, CheckpointDamaged) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def export_runs(
    runs: str,
    grid,
    scale: str,
    results: Path,
    dest: Path | None,
    force: bool,
    yarn_factor: float | None,
    cache: Path | None,
) -> list[Path]:
    """Export the runs ``runs`` (comma-separated row ids or run ids) names; return the folders.

    Args:
        dest: the root of the folders (default ``results/export``).
        yarn_factor: write YaRN at this factor over the run's training length into the config
            (Table 5's inference-time extension); None: the RoPE the run trained with.

    Raises:
        ExportUnavailable: the ``export`` extra is missing.
        sweep.export.runs.ExportError: bad ``RUNS`` or destination (before anything is written).
        experiments.config.ConfigError: a YaRN factor below 1.
    """
    check_packages()
    import transformers

    from experiments.checkpointing import load_weights
    from experiments.corpus import TOKENIZER_FILE, build_corpus
    from experiments.hf.folder import write_folder
    from sweep.export.card import model_card
    from sweep.export.runs import ExportError, export_jobs
    from sweep.store import Tracker, experiment_name
    from sweep.store_urls import missing_sqlite_store, tracking_uri

    if yarn_factor is not None:
        YarnScaling(yarn_factor, 1)  # ConfigError below 1, before anything is read
    if lost := missing_sqlite_store(tracking_uri(results)):
        raise ExportError(f"tracking store {lost[0]} is {lost[1]}: nothing to export (make sweep makes it)")
    transformers.utils.logging.disable_progress_bar()  # one line per folder, no bars
    tracker = Tracker(tracking_uri(results), experiment_name(grid.name, scale), results / "mlartifacts")
    names = [n.strip() for n in runs.split(",") if n.strip()]
    jobs = export_jobs(names, grid, scale, tracker, dest or results / "export", force)
    written = []
    for job in jobs:
        train_len = job.config.train.seq_len
        yarn = YarnScaling(yarn_factor, train_len) if yarn_factor is not None else None
        corpus = build_corpus(job.config.data, cache, log=lambda _msg: None)
        state = load_weights(job.checkpoint)
        model_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        folder = write_folder(
            job.dest, job.config.model, model_state, corpus.root / TOKENIZER_FILE, corpus.eos_id,
            model_card(job, job.dest.name), yarn=yarn, force=force,
        )  # fmt: skip
        print(f"{job.name} ({job.run.info.run_id}): {folder}")
        written.append(folder)
    return written
