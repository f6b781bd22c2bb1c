"""Where a report came from: ``<stem>.manifest.json`` beside each table, written with it.

It names the command that wrote the files, the commit of the code that wrote them, and, from the
runs' tags, the commits the runs were trained at, their numbers version
(:data:`experiments.numerics.NUMBERS_VERSION`) and their arithmetic
(:func:`sweep.report.runs.arithmetic`). A table holds runs of one numbers version (it is part of
the run key) and one arithmetic (others are left out, ``one_arithmetic``), so a committed table
says exactly which code and which machine kind reproduce it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments.numerics import NUMBERS_VERSION
from sweep.report.publish import Staging
from sweep.store import code_commit

UNRECORDED = "unrecorded"  # a run from before the tag


def provenance(runs: pd.DataFrame | None) -> dict:
    """The runs' count, training commits (commit -> runs), numbers versions and arithmetics, and
    the fingerprints of the corpora they trained on (fingerprint -> runs) where runs recorded one."""
    if runs is None:
        return {"numbers": [str(NUMBERS_VERSION)]}
    if runs.empty:
        return {"runs": 0}
    unique = runs.drop_duplicates("run_id")

    def counts(column: str) -> dict[str, int]:
        values = (
            unique[column].fillna(UNRECORDED) if column in unique else pd.Series([UNRECORDED] * len(unique))
        )
        return {str(k): int(v) for k, v in values.value_counts().sort_index().items()}

    record = {
        "runs": len(unique),
        "trained_at_commits": counts("git_commit"),
        "numbers": sorted(counts("numbers")),
        "arithmetic": sorted(counts("arithmetic")),
    }
    if "corpus_fingerprint" in unique and unique["corpus_fingerprint"].notna().any():
        record["corpus_fingerprints"] = counts("corpus_fingerprint")  # fingerprint -> runs
    return record


def provenance_line(prov: dict) -> str:
    """One sentence for a table's header: the runs, the commit(s), the arithmetic and the corpus
    fingerprint(s)."""
    if not prov.get("runs"):
        return ""
    commits = ", ".join(
        f"{sha[:10]}{'' if n == prov['runs'] else f' ({n})'}" for sha, n in prov["trained_at_commits"].items()
    )
    corpora = ", ".join(prov.get("corpus_fingerprints", {}))
    return (
        f"Runs: {prov['runs']}, trained at commit {commits}; numbers version "
        f"{', '.join(prov['numbers'])}; {'; '.join(prov['arithmetic'])}"
        f"{f'; corpus {corpora}' if corpora else ''}. "
    )


def stage_manifest(
    staging: Staging, stem_path: Path, command: str, files: list[Path], runs: pd.DataFrame | None
) -> Path:
    """Stage ``<stem>.manifest.json`` beside ``stem_path`` (a report's first file) naming
    ``files`` (paths inside the results folder), ``command`` and :func:`provenance`."""
    root = staging.results_dir
    record = {
        "command": command,
        "written_by_commit": code_commit() or UNRECORDED,
        "files": sorted(str(Path(f).resolve().relative_to(root)) for f in files),
        **provenance(runs),
    }
    final = stem_path.with_name(f"{stem_path.stem}.manifest.json")
    return staging.text(final, json.dumps(record, indent=1) + "\n")
