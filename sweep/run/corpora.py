"""Checks of a sweep's corpora that need the grid: the sources can be read here (before anything
is written) and the model's vocabulary holds the tokenizer's ids (once the corpus is built)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from experiments.config import DataConfig, embedding_rows
from experiments.corpus import Corpus, build_corpus
from experiments.corpus.documents import hub_snapshot, open_hub, preflight
from experiments.data import disjoint_windows
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


def check_fits(grid: Grid, cells: list[Cell], corpus: Corpus) -> None:
    """Each domain's validation and test splits hold a window of each cell's ``seq_len`` + 1
    tokens, the model of each cell can embed every id of the corpus's tokenizer, and a budget that
    reads no token twice (``data.train_windows: disjoint``) has the windows it reads.

    Raises:
        GridError: naming the row and ``train.seq_len`` (the split, the domain, the tokens it
            holds and needs), ``model.vocab_size`` (the tokenizer's size and its file) or
            ``train.max_steps`` (the windows asked and held).
    """
    for cell in cells:
        t = cell.config.train
        for split in ("val", "test"):  # validation windows, then the probe batch, read them
            for domain in corpus.domains:
                held = len(corpus.tokens(split, domain))
                if held < t.seq_len + 1:
                    raise GridError(
                        grid.file,
                        f"the {split} split of domain '{domain}' holds {held:,} tokens, and a window of "
                        f"seq_len {t.seq_len} needs {t.seq_len + 1}; give the domain more documents",
                        cell.row.id,
                        "train.seq_len",
                    )
        if cell.config.data.train_windows == "disjoint":
            held = disjoint_windows(len(corpus.tokens("train")), t.seq_len)
            if t.max_steps * t.batch_size > held:
                raise GridError(
                    grid.file,
                    f"{t.max_steps} steps of {t.batch_size} windows read {t.max_steps * t.batch_size:,} "
                    f"disjoint windows of {t.seq_len + 1} tokens, but the corpus holds {held:,}; give "
                    "a source more max_tokens or train fewer steps",
                    cell.row.id,
                    "train.max_steps",
                )
        origin = corpus.manifest["tokenizer"].get("pretrained", corpus.root / "tokenizer.json")
        if cell.config.model.vocab_size < corpus.vocab_size:
            raise GridError(
                grid.file,
                f"{cell.config.model.vocab_size} cannot hold the {corpus.vocab_size} token ids of the "
                f"tokenizer {origin}; set model.vocab_size to at least {corpus.vocab_size}",
                cell.row.id,
                "model.vocab_size",
            )
        most = embedding_rows(corpus.vocab_size)
        if cell.config.data.synthetic is None and cell.config.model.vocab_size > most:  # a tokenizer's
            raise GridError(
                grid.file,
                f"{cell.config.model.vocab_size} rows for the {corpus.vocab_size} token ids of the tokenizer "
                f"{origin}: no token would ever train the rows past {most}; set model.vocab_size to "
                f"{corpus.vocab_size}-{most}",
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
                    out(f"downloading {spec.label} at revision {spec.revision}")
                    hub_snapshot(spec, download=True) if spec.data_files else open_hub(spec, download=True)
        check_sources(data)
        corpus = build_corpus(data, cache_root, log=out)
        check_fits(grid, [c for c in cells if c.config.data == data], corpus)
        tokens = corpus.manifest["tokens"]
        out(f"corpus {corpus.root}: vocabulary {corpus.vocab_size}")
        for domain in corpus.domains:
            split = ", ".join(f"{s} {tokens[s][domain]:,}" for s in ("train", "val", "test"))
            out(f"  {domain}: {split} tokens{held_out_line(corpus.manifest, domain)}")
    return 0


def held_out_line(manifest: dict, domain: str) -> str:
    """``; also in train: val 0, test 0 documents; duplicates dropped: N`` for ``domain`` of a
    corpus of documents (``experiments.corpus.repeats``), empty for a synthetic task."""
    shared = manifest.get("shared_with_train", {}).get(domain)
    if shared is None:
        return ""
    domain_of = {entry["name"]: entry["domain"] for entry in manifest.get("sources", [])}
    dropped = sum(
        sum(lost.values())
        for label, lost in manifest.get("repeats", {}).get("dropped", {}).items()
        if domain_of.get(label) == domain
    )
    in_train = f"also in train: val {shared['val']}, test {shared['test']} documents"
    return f"; {in_train}; duplicates dropped: {dropped:,}"
