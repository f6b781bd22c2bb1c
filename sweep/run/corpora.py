"""Checks of a sweep's corpora that need the grid: the sources can be read here (before anything
is written) and the model's vocabulary holds the tokenizer's ids (once the corpus is built)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from experiments.config import DataConfig
from experiments.corpus import Corpus, build_corpus
from experiments.corpus.documents import open_hub, preflight
from sweep.grid import Cell, Grid
from sweep.gridfile import GridError


def check_sources(data: DataConfig) -> None:
    """Every ``files`` pattern matches and every offline ``hub`` source is cached (a package recipe,
    or a synthetic task, has nothing to check).

    Raises:
        experiments.corpus.CorpusError: the first source that cannot be read, in one line.
    """
    if data.synthetic is None and data.streamed:
        preflight(data.specs())


def check_vocab(grid: Grid, cells: list[Cell], corpus: Corpus) -> None:
    """The model of each cell can embed every id of the corpus's tokenizer.

    Raises:
        GridError: naming the row and ``model.vocab_size``, the tokenizer's size and its file.
    """
    for cell in cells:
        if cell.config.model.vocab_size < corpus.vocab_size:
            origin = corpus.manifest["tokenizer"].get("pretrained", corpus.root / "tokenizer.json")
            raise GridError(
                grid.file,
                f"{cell.config.model.vocab_size} cannot hold the {corpus.vocab_size} token ids of the "
                f"tokenizer {origin}; set model.vocab_size to at least {corpus.vocab_size}",
                cell.row.id,
                "model.vocab_size",
            )


def build_corpora(
    grid: Grid, cells: list[Cell], cache_root: Path | None, download: bool, out: Callable[[str], None] = print
) -> int:
    """``make data``: build each corpus the cells need (``download``: fetch their hub sources into
    the local Hugging Face cache first, the one step that reaches the network) and print its tokens
    per domain and split. Returns the exit status, 0.

    Raises:
        experiments.corpus.CorpusError: a source cannot be read or downloaded.
        GridError: a model's vocabulary cannot hold the tokenizer's ids.
    """
    recipes = list(dict.fromkeys(c.config.data for c in cells))
    for data in recipes:
        if download and data.synthetic is None:
            for spec in data.specs():
                if spec.kind == "hub":
                    out(f"downloading {spec.hub} ({spec.config}, {spec.split}, revision {spec.revision})")
                    open_hub(spec, download=True)
        check_sources(data)
        corpus = build_corpus(data, cache_root, log=out)
        check_vocab(grid, [c for c in cells if c.config.data == data], corpus)
        tokens = corpus.manifest["tokens"]
        out(f"corpus {corpus.root}: vocabulary {corpus.vocab_size}")
        for domain in corpus.domains:
            split = ", ".join(f"{s} {tokens[s][domain]:,}" for s in ("train", "val", "test"))
            out(f"  {domain}: {split} tokens")
    return 0
