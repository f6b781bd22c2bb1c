"""The streaming build: any mix of package, files and hub sources (``experiments.corpus.documents``),
a trained BPE or a pretrained ``tokenizer.json``, in memory that does not grow with the corpus.

Each document goes to val, test or train by a hash of its source and id (so a split needs no
list of the documents), is encoded in batches on every core (``tokenizers``), ends with the
tokenizer's end-of-document token and is appended to its domain's file at once. Training
reads the same memmaps as before (``experiments.corpus.reader``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer

import experiments.corpus.documents as D
import experiments.corpus.prefetch as prefetch
import experiments.corpus.sources as sources
from experiments.config import DataConfig, to_dict
from experiments.corpus.bpe import train_bpe
from experiments.corpus.encoders import Mismatch, SampleCheck, TokenizersEncoder, document_encoder, pipelined
from experiments.corpus.pretrained import pretrained_file, whole_documents
from experiments.corpus.read_files import ReadFiles
from experiments.corpus.reader import EOS, MANIFEST, SPLITS, TOKENIZER_FILE, CorpusError, manifest_header
from experiments.corpus.reading import Progress, bounded, clean_texts, not_blank
from experiments.corpus.repeats import (
    Ledger,
    Repeats,
    checked_shared,
    firsts_only,
    ids_keys,
    repeats_record,
    text_key,
)
from experiments.data_config import SourceSpec

BUILD_VERSION = 2
"""Bump whenever this builder changes what it writes (split rule, separators, layout)."""

BPE_SAMPLE_CHARS = 50_000_000
"""Characters of each source's train split the BPE is trained on, at most: a larger sample barely
changes the merges of a vocabulary of tens of thousands and costs the trainer's memory."""

_BATCH_CHARS = 2_000_000  # bounds the text and the Encoding objects held at once


def domain_of(spec: SourceSpec) -> str:
    """The source's domain: its own, or its package's."""
    return spec.domain or sources.SOURCES[spec.package].domain


def split_of(label: str, doc_id: str, cfg: DataConfig) -> str:
    """``val``, ``test`` or ``train`` for one document, from sha256 of ``<label>/<doc_id>``:
    the same document always lands in the same split, whatever else the source holds."""
    u = int.from_bytes(hashlib.sha256(f"{label}/{doc_id}".encode()).digest()[:8], "big") / 2**64
    return "val" if u < cfg.val_fraction else "test" if u < cfg.val_fraction + cfg.test_fraction else "train"


def fetchable_specs(cfg: DataConfig, log: Callable[[str], None]) -> list[SourceSpec]:
    """The recipe's sources less the package sources this machine cannot fetch (one line says which
    domains that leaves out: ``sources.available``)."""
    packages = [s.package for s in cfg.specs() if s.package]
    others = {domain_of(s) for s in cfg.specs() if not s.package}
    kept = set(sources.available(packages, log, required=not others, others=others))
    return [s for s in cfg.specs() if not s.package or s.package in kept]


def train_texts(
    cfg: DataConfig, specs: list[SourceSpec], downloads: Path, record: ReadFiles | None = None
) -> Iterator[str]:
    """The train split's first documents of each source, up to :data:`BPE_SAMPLE_CHARS`
    characters (a package source's ``max_chars_per_source`` if less): what the BPE is trained on
    (one streamed pass; the trainer keeps word counts, not texts)."""
    met: dict[str, D.SeenFiles] = {}
    # Repeated texts are skipped, as the build drops them (it compares ids, which a trained BPE
    # gives alike exactly for alike texts); a text first met past a source's sample here may be
    # sampled from a later source, which only adds a document to the BPE's sample.
    repeats = Repeats()
    for spec in specs:
        cap = min(cfg.max_chars_per_source, BPE_SAMPLE_CHARS) if spec.package else BPE_SAMPLE_CHARS
        chars = 0
        seen = met.setdefault(domain_of(spec), D.SeenFiles())
        for batch in bounded(
            prefetch.batches(
                spec, downloads, _BATCH_CHARS, seen=seen, max_bytes=cfg.max_document_bytes, record=record
            ),
            spec,
            cfg,
        ):
            batch = [doc for doc in batch if not_blank(doc.text)]
            firsts = repeats.keep(spec.label, [text_key(doc.text.replace("\r\n", "\n")) for doc in batch])
            repeats.commit()
            for doc, first in zip(batch, firsts):
                if first and split_of(spec.label, doc.doc_id, cfg) == "train":
                    yield doc.text
                    chars += len(doc.text)
                    if chars >= cap:
                        break
            if chars >= cap:
                break


def write_corpus(
    cfg: DataConfig, digest: str, out: Path, downloads: Path, log: Callable[[str], None]
) -> None:
    """Build a streamed recipe into ``out``: the tokenizer (trained, or the pretrained one), the
    token files (:func:`build_streamed`) and, last, ``manifest.json``.

    Raises:
        CorpusError: a source or the tokenizer cannot be read.
    """
    t_start = time.perf_counter()
    specs = fetchable_specs(cfg, log)
    record = ReadFiles()  # every local file, as the build read it
    if cfg.tokenizer is not None:
        tokenizer, eos_id, sha256 = pretrained_file(cfg)
        path = Path(cfg.tokenizer.file).expanduser()
        whole_documents(tokenizer, path, log)
        origin = {"pretrained": str(path.resolve()), "sha256": sha256}
    else:
        tokenizer = train_bpe(train_texts(cfg, specs, downloads, record), cfg.vocab_size)
        eos_id, origin = tokenizer.token_to_id(EOS), {"trained": "byte-level BPE on the train split"}
    tokenizer.save(str(out / TOKENIZER_FILE))
    eos = tokenizer.id_to_token(eos_id)
    log(
        f"corpus {digest}: tokenizer vocab {tokenizer.get_vocab_size()}, end of document {eos} "
        f"{time.perf_counter() - t_start:.1f}s"
    )
    encoder = document_encoder(tokenizer, add_special_tokens=True, log=log)
    try:
        body = build_streamed(
            cfg, specs, SampleCheck(encoder, _reference(tokenizer)), eos_id, out, downloads, log, record
        )
    except Mismatch as err:
        log(f"corpus {digest}: {err}; encoding with HF tokenizers instead")
        for stale in [*out.glob(".train-*.part"), *out.glob("val/*.bin"), *out.glob("test/*.bin")]:
            stale.unlink()
        encoder = _reference(tokenizer)
        body = build_streamed(cfg, specs, SampleCheck(encoder, encoder), eos_id, out, downloads, log, record)
    tokens = {"file": TOKENIZER_FILE, "vocab_size": tokenizer.get_vocab_size(), "eos_id": eos_id, "eos": eos}
    body["tokenizer"] = {**tokens, **origin}
    record.unchanged()  # a file rewritten since it was read fails the build: nothing is published
    seconds = round(time.perf_counter() - t_start, 2)
    manifest = {**manifest_header(to_dict(cfg), digest), "build_seconds": seconds, **body}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last: it marks the corpus complete
    log(
        f"corpus {digest}: encoded {sum(body['tokens']['train'].values()):,} train tokens, "
        f"built in {time.perf_counter() - t_start:.1f}s"
    )


def build_streamed(
    cfg: DataConfig,
    specs: list[SourceSpec],
    encoder: SampleCheck,
    eos_id: int,
    out: Path,
    downloads: Path,
    log: Callable[[str], None],
    record: ReadFiles | None = None,
) -> dict[str, Any]:
    """Encode every source of ``specs`` (:func:`fetchable_specs`) into ``out`` (``train.bin``,
    ``val/<domain>.bin``, ``test/<domain>.bin``); return the manifest's ``domains``, ``dtype``,
    ``files``, ``tokens``, ``train_spans`` and ``sources``.

    Raises:
        CorpusError: a source cannot be read (``documents``), yields nothing, or leaves a domain
            without a document in some split.
    """
    domains = sorted({domain_of(s) for s in specs})
    vocab_size = encoder.reference.tokenizer.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)
    (out / "val").mkdir(exist_ok=True)
    (out / "test").mkdir(exist_ok=True)
    parts = {d: out / f".train-{d}.part" for d in domains}
    files: dict[str, Any] = {"train": "train.bin", "val": {}, "test": {}}
    handles: dict[tuple[str, str], BinaryIO] = {}
    for d in domains:
        handles[("train", d)] = open(parts[d], "wb")
        for split in ("val", "test"):
            files[split][d] = f"{split}/{d}.bin"
            handles[(split, d)] = open(out / files[split][d], "wb")
    totals = {s: dict.fromkeys(domains, 0) for s in SPLITS}
    entries = []
    met = {d: D.SeenFiles() for d in domains}  # a domain's file is read once, whichever source names it
    repeats = Repeats()  # a document is kept once in the corpus, where it was first read
    ledger = Ledger()  # what was written, by split
    record = record if record is not None else ReadFiles()
    try:
        for spec in specs:
            entry = _encode_source(
                spec,
                cfg,
                encoder,
                eos_id,
                dtype,
                handles,
                totals,
                downloads,
                log,
                met,
                repeats,
                ledger,
                record,
            )
            entries.append(entry)
    finally:
        for fh in handles.values():
            fh.close()
    for d in domains:
        for split in SPLITS:
            if totals[split][d] == 0:
                raise CorpusError(
                    f"domain '{d}': no document fell in the {split} split; give it more documents "
                    f"(each goes to val / test with odds {cfg.val_fraction} / {cfg.test_fraction})"
                )
    spans, start = {}, 0
    os.replace(parts[domains[0]], out / "train.bin")  # the first domain's part is the file's start
    with open(out / "train.bin", "ab") as train:
        for d in domains:  # the domains one after another, as the package build writes them
            if d != domains[0]:
                with open(parts[d], "rb") as part:
                    shutil.copyfileobj(part, train, 1 << 24)
                os.remove(parts[d])
            spans[d] = [start, start + totals["train"][d]]
            start += totals["train"][d]
    moved = repeats.n_dropped() > 0  # before the rule, every dropped document was written
    return {"domains": domains, "dtype": dtype.name, "files": files, "tokens": totals, "train_spans": spans,
            "sources": entries, "repeats": repeats_record(repeats, moved),
            "shared_with_train": checked_shared(ledger)}  # fmt: skip


def _encode_source(
    spec: SourceSpec,
    cfg: DataConfig,
    encoder: SampleCheck,
    eos_id: int,
    dtype: np.dtype,
    handles: dict[tuple[str, str], BinaryIO],
    totals: dict[str, dict[str, int]],
    downloads: Path,
    log: Callable[[str], None],
    met: dict[str, D.SeenFiles],
    repeats: Repeats,
    ledger: Ledger,
    record: ReadFiles,
) -> dict[str, Any]:
    domain = domain_of(spec)
    skipped_before = len(met[domain].skipped)
    progress = Progress(spec, log)
    counts = dict.fromkeys(SPLITS, 0)
    docs = dict.fromkeys(SPLITS, 0)
    chars = seen = 0
    token_cap = spec.max_tokens or float("inf")
    char_cap = cfg.max_chars_per_source if spec.kind == "package" else float("inf")  # files, hub: max_tokens
    read = prefetch.batches(
        spec, downloads, _BATCH_CHARS, seen=met[domain], max_bytes=cfg.max_document_bytes, record=record
    )
    numbered = ((batch, texts, encoder.reserve(len(texts))) for batch, texts in clean_texts(read, spec, cfg))
    encode = lambda job: encoder.encode(job[1], job[2])  # noqa: E731
    for (batch, texts, _), (flat, lengths) in pipelined(numbered, encode):
        # A document is its ids (what training reads): one met before, in any source, is left out.
        keys, read_here = ids_keys(flat, lengths), len(batch)
        places = np.flatnonzero(repeats.keep(spec.label, keys))  # the first occurrences, in the batch
        flat, lengths = firsts_only(flat, lengths, places)
        batch, texts, keys = [batch[i] for i in places], [texts[i] for i in places], [keys[i] for i in places]
        ends = np.cumsum(lengths)
        ends_eos = (lengths > 0) & (flat[np.maximum(ends - 1, 0)] == eos_id) if flat.size else lengths < 0
        tokens = lengths + ~ends_eos  # the post-processor may have ended it with eos already
        n_chars = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        # Stop, not skip, at the first document past a cap (skipping would favour short documents),
        # once each source has 3 (one per split).
        past = (sum(docs.values()) + np.arange(len(batch)) >= 3) & (
            (chars + np.cumsum(n_chars) > char_cap) | (sum(counts.values()) + np.cumsum(tokens) > token_cap)
        )
        stop = int(np.argmax(past)) if past.any() else len(batch)
        seen += int(places[stop]) + 1 if stop < len(batch) else read_here
        flat = flat[: ends[stop - 1]] if stop else flat[:0]
        flat = np.insert(flat, ends[:stop][~ends_eos[:stop]], eos_id)  # each document, then eos
        split = np.array([SPLITS.index(split_of(spec.label, doc.doc_id, cfg)) for doc in batch[:stop]])
        ledger.add(domain, [SPLITS[code] for code in split], keys[:stop])
        by_token = np.repeat(split, tokens[:stop])
        for code, name in enumerate(SPLITS):
            part = flat[by_token == code]
            if part.size:
                handles[(name, domain)].write(part.astype(dtype).tobytes())
            counts[name] += int(part.size)
            docs[name] += int((split == code).sum())
        chars += int(n_chars[:stop].sum())
        progress.update(sum(doc.nbytes for doc in batch[:stop]), int(tokens[:stop].sum()), stop)
        if stop < len(batch):  # decisions past the last document written never happened
            repeats.commit(int(places[stop - 1]) + 1 if stop else 0)
            repeats.rollback()
            break
        repeats.commit()
    left_out = D.matched_and_left_out(spec)[1] if spec.kind == "files" else []
    left_out += met[domain].skipped[skipped_before:]
    skipped = len(left_out)
    if skipped:
        names = ", ".join(p.name for p in left_out[:3]) + (f" and {skipped - 3} more" if skipped > 3 else "")
        log(
            f"corpus: {spec.label}: {skipped} file(s) left out as the same file or the same bytes as one "
            f"read before for domain '{domain}': {names}"
        )
    if line := repeats.line(spec.label):
        log(line)
    if not sum(docs.values()) and not skipped and not repeats.n_dropped(spec.label):
        raise CorpusError(f"source '{spec.label}': yielded no non-empty documents")
    for split_name in SPLITS:
        totals[split_name][domain] += counts[split_name]
    log(progress.done(sum(docs.values()), seen))
    return {"name": spec.label, "kind": spec.kind, "domain": domain, "spec": _spec_record(spec),
            **_provenance(spec, record), "n_docs": docs, "tokens": counts, "chars": chars}  # fmt: skip


def _reference(tokenizer: Tokenizer) -> TokenizersEncoder:
    return TokenizersEncoder(tokenizer, add_special_tokens=True)


def _spec_record(spec: SourceSpec) -> dict[str, Any]:
    return {k: v for k, v in {"files": list(spec.files or ()), "hub": spec.hub, "config": spec.config,
            "split": spec.split if spec.hub else None, "revision": spec.revision, "package": spec.package,
            "max_tokens": spec.max_tokens}.items() if v}  # fmt: skip


def _provenance(spec: SourceSpec, record: ReadFiles) -> dict[str, Any]:
    """What was read: the files (path, bytes) and the sha256 of their bytes as the build read
    them (``record``); a hub data set's revision; a package's pin."""
    if spec.kind == "files":
        paths = D.matched_files(spec)
        root = D.common_root(paths)
        sha256 = record.source_sha256(spec.label, paths, root)
        return {"root": str(root), "file_list": record.file_list(paths, root), "sha256": sha256}
    if spec.kind == "hub" and spec.data_files and not spec.online:  # the files of exactly that revision
        paths = D.hub_files(spec, D.hub_snapshot(spec))
        root = D.common_root(paths)
        sha256 = record.source_sha256(spec.label, paths, root)
        return {"revision": spec.revision, "file_list": record.file_list(paths, root), "sha256": sha256}
    if spec.kind == "hub":
        return {"revision": spec.revision}
    src = sources.SOURCES[spec.package]
    return {"version": src.version, "pin": src.pin, "license": src.license}
