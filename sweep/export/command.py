"""``python -m sweep.cli export --runs a,b`` (``make export``): each finished run as a Hugging Face
transformers folder, ``<dest>/<experiment>/<row>_s<seed>``.

Every name, run, checkpoint and destination is checked before the first folder is written; each
folder is written beside its place and renamed into it (``experiments.hf.folder``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
from pathlib import Path

from experiments.model import YarnScaling

#: the import names of the ``export`` extra
PACKAGES = ("transformers", "safetensors", "accelerate")
INSTALL = "pip install -e '.[export]' (make export installs it)"
#: the most positions a YaRN export may name: ``max_position_embeddings`` is read as a 64-bit integer
MAX_POSITIONS = 2**63 - 1


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
    unknown, unfinished or diverged run, a damaged checkpoint, a run whose tokenizer cannot be had
    as it trained with, a destination that exists without ``--force`` or cannot be written, a YaRN
    factor that is not a finite number of at least 1, the ``export`` extra missing), nothing
    written."""
    from experiments.checkpointing import CheckpointDamaged
    from sweep.export.runs import ExportError

    dest = Path(args.dest) if args.dest else None
    try:
        export_runs(args.runs, grid, args.scale, results, dest, args.force, _factor(args.yarn), cache)
    except (ExportError, ExportUnavailable, CheckpointDamaged) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _factor(text: str | None) -> float | None:
    """``--yarn``'s number, or None.

    Raises:
        sweep.export.runs.ExportError: not a number.
    """
    from sweep.export.runs import ExportError

    try:
        return None if text is None else float(text)
    except ValueError:
        raise ExportError(f"YARN: the factor must be a finite number >= 1, got {text!r}") from None


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

    Each folder ships the tokenizer the run trained with (``sweep.export.tokenizer``): the
    corpus's raw input is never read and no tokenizer is trained again.

    Args:
        dest: the root of the folders (default ``results/export``).
        yarn_factor: write YaRN at this factor over the run's training length into the config
            (Table 5's inference-time extension); None: the RoPE the run trained with.
        cache: the corpus cache (default ``experiments.corpus.default_cache_root``), read only for
            a run that stored no tokenizer.

    Raises:
        ExportUnavailable: the ``export`` extra is missing.
        sweep.export.runs.ExportError: bad ``RUNS``, destination or YaRN factor, or a run whose
            tokenizer cannot be had as it trained with (before anything is written).
    """
    check_packages()
    import transformers

    from experiments.checkpointing import load_weights
    from experiments.corpus import default_cache_root
    from experiments.hf.folder import write_folder
    from sweep.export.card import model_card
    from sweep.export.runs import ExportError, check_destinations, export_jobs
    from sweep.export.tokenizer import run_tokenizer
    from sweep.store import Tracker, experiment_name
    from sweep.store_urls import missing_sqlite_store, tracking_uri

    if yarn_factor is not None and not (math.isfinite(yarn_factor) and yarn_factor >= 1):
        raise ExportError(f"YARN: the factor must be a finite number >= 1, got {yarn_factor}")
    if lost := missing_sqlite_store(tracking_uri(results)):
        raise ExportError(f"tracking store {lost[0]} is {lost[1]}: nothing to export (make sweep makes it)")
    transformers.utils.logging.disable_progress_bar()  # one line per folder, no bars
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # nor MLflow's downloads'
    tracker = Tracker(tracking_uri(results), experiment_name(grid.name, scale), results / "mlartifacts")
    names = [n.strip() for n in runs.split(",") if n.strip()]
    jobs = export_jobs(names, grid, scale, tracker, dest or results / "export", force)
    yarns = [_yarn(yarn_factor, job.config.train.seq_len) for job in jobs]
    check_destinations(jobs)
    written = []
    with tempfile.TemporaryDirectory(prefix="export-tokenizers-") as tmp:
        tokenizers = [run_tokenizer(job, tracker, cache or default_cache_root(), Path(tmp)) for job in jobs]
        for job, tokenizer, yarn in zip(jobs, tokenizers, yarns):
            state = load_weights(job.checkpoint)
            model_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
            folder = write_folder(
                job.dest, job.config.model, model_state, tokenizer.file, tokenizer.eos_id,
                model_card(job, job.dest.name, tokenizer.describe()), yarn=yarn, force=force,
            )  # fmt: skip
            print(f"{job.name} ({job.run.info.run_id}): {folder}")
            written.append(folder)
    return written


def _yarn(factor: float | None, train_len: int) -> YarnScaling | None:
    """YaRN at ``factor`` over ``train_len`` tokens, or None.

    Raises:
        sweep.export.runs.ExportError: a factor whose length, ``factor * train_len`` positions,
            does not fit the 64-bit integer ``max_position_embeddings`` is read into.
    """
    from sweep.export.runs import ExportError

    if factor is None:
        return None
    if math.ceil(factor * train_len) > MAX_POSITIONS:
        raise ExportError(
            f"YARN: {factor:g} x the training length {train_len} is more positions than "
            f"max_position_embeddings holds ({MAX_POSITIONS:,})"
        )
    return YarnScaling(factor, train_len)
