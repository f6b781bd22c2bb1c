"""The tokenizer a run trained with, which its export ships: never one built again.

A run stores its corpus's ``tokenizer.json`` as an artifact and its sha256 as a tag when training
starts (``sweep.run.cell``, :data:`~experiments.names.TOKENIZER_SHA256_TAG`). Export downloads that
file and checks it against the tag; the corpus, its raw input and the grid's tokenizer file are not
read. A run from before the artifact may use the corpus folder here only if it holds the bytes the
run trained on: the run's fingerprint (``corpus_fingerprint``; for a run older still, its
``corpus.json``'s build time) must match. Otherwise export refuses: training a BPE again would give
other ids for the same text, so old weights would read a new vocabulary.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from experiments.checksums import file_sha256
from experiments.hf.folder import hf_tokenizer
from experiments.hf.tokens import SpecialTokens, special_tokens
from experiments.names import CORPUS_FINGERPRINT_TAG, CORPUS_TAG, TOKENIZER_SHA256_TAG
from sweep.export.runs import ExportError, ExportJob
from sweep.store import Tracker

CORPUS_RECORD = "corpus.json"  # what every cell run records of its corpus (sweep.run.cell)


@dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer of one run, as export ships it."""

    file: Path
    """A ``tokenizer.json`` with the bytes the run trained with."""
    eos_id: int
    """Its end-of-document id (the corpus manifest's ``tokenizer.eos_id``)."""
    tokens: SpecialTokens
    """The folder's eos, pad and bos (``experiments.hf.tokens``)."""
    origin: str
    """Where it came from: the run's own (its artifact), or its corpus's (the folder here)."""

    def describe(self) -> str:
        """One line for the model card: where it came from and its special tokens."""
        t = self.tokens
        bos = "no BOS" if t.bos is None else f"BOS `{t.bos}` ({t.bos_id})"
        return f"{self.origin}; end `{t.eos}` ({t.eos_id}), padding `{t.pad}` ({t.pad_id}), {bos}"


def run_tokenizer(job: ExportJob, tracker: Tracker, cache_root: Path, tmp: Path) -> RunTokenizer:
    """The tokenizer ``job``'s run trained with (module docstring), downloaded under ``tmp``.

    Raises:
        ExportError: a run of the synthetic task (no tokenizer); a stored tokenizer missing or
            not the bytes its tag names; a run without one whose corpus is not here or holds other
            bytes; a tokenizer whose end-of-document id is not the one the run recorded, with ids
            beyond the model's vocabulary, or that transformers would wrap into another
            (``experiments.hf.folder.hf_tokenizer``). One line naming the run.
    """
    run = job.run
    tags = run.data.tags
    name = f"run {run.info.run_id} ({tags.get('row', '?')})"
    if job.config.data.synthetic is not None:
        raise ExportError(f"RUNS: {name} trained on the synthetic task, which has no tokenizer to export")
    record = _artifact_json(tracker, run, CORPUS_RECORD, tmp)
    if sha := tags.get(TOKENIZER_SHA256_TAG):
        file, origin = _stored(tracker, run, name, sha, tmp), f"the run's own (sha256 {sha[:12]})"
        if not isinstance(eos_id := ((record or {}).get("tokenizer") or {}).get("eos_id"), int):
            raise ExportError(
                f"RUNS: {name} has no readable {CORPUS_RECORD}: its end-of-document id is not known"
            )
    else:
        corpus = _corpus_here(job, name, record, cache_root)
        file, eos_id = corpus.root / corpus.manifest["tokenizer"]["file"], corpus.eos_id
        origin = f"its corpus's (fingerprint {corpus.fingerprint})"
    tokenizer = Tokenizer.from_file(str(file))
    expected = (record or {}).get("tokenizer", {}).get("eos")
    if expected is not None and tokenizer.id_to_token(eos_id) != expected:
        raise ExportError(
            f"RUNS: {name}: id {eos_id} of its tokenizer is {tokenizer.id_to_token(eos_id)!r}, "
            f"not the end-of-document token {expected!r} it recorded"
        )
    if (size := tokenizer.get_vocab_size(with_added_tokens=True)) > job.config.model.vocab_size:
        raise ExportError(
            f"RUNS: {name}: its tokenizer has {size} ids, more than the model's vocab_size "
            f"{job.config.model.vocab_size}"
        )
    try:
        tokens = special_tokens(tokenizer, eos_id)
        hf_tokenizer(tokenizer, tokens, job.config.model.max_seq_len)  # what write_folder will do
    except ValueError as err:
        raise ExportError(f"RUNS: {name}: its tokenizer cannot be shipped as it is: {err}") from None
    return RunTokenizer(file, eos_id, tokens, origin)


def _stored(tracker: Tracker, run: Any, name: str, sha: str, tmp: Path) -> Path:
    """The run's ``tokenizer.json`` artifact, checked against the sha256 it tagged."""
    from experiments.corpus import TOKENIZER_FILE

    folder = Path(tempfile.mkdtemp(dir=tmp))
    try:
        path = Path(tracker.client.download_artifacts(run.info.run_id, TOKENIZER_FILE, str(folder)))
    except Exception:  # MLflow's own error types for a missing artifact
        raise ExportError(
            f"RUNS: {name}: its {TOKENIZER_FILE} artifact (sha256 {sha[:12]}) is missing from the store"
        ) from None
    if (found := file_sha256(path)) != sha:
        raise ExportError(
            f"RUNS: {name}: its {TOKENIZER_FILE} artifact has sha256 {found[:12]}, not the "
            f"{sha[:12]} it trained with (the stored file changed)"
        )
    return path


def _corpus_here(job: ExportJob, name: str, record: dict | None, cache_root: Path) -> Any:
    """The corpus folder here, for a run that stored no tokenizer: only if it holds the bytes the
    run trained on (its fingerprint, or for a run older than that, the build time it recorded)."""
    from experiments.corpus import MANIFEST, CorpusError, recipe_hash
    from experiments.corpus.build import open_checked

    tags = job.run.data.tags
    digest = tags.get(CORPUS_TAG) or (record or {}).get("recipe_hash") or recipe_hash(job.config.data)
    folder = cache_root / f"corpus-{digest}"
    never = "export never trains a tokenizer again (other ids for the same text)"
    if not (folder / MANIFEST).is_file():
        raise ExportError(
            f"RUNS: {name} stored no tokenizer and its corpus {folder} is not here: {never}; "
            "put back the corpus folder it trained on"
        )
    try:
        corpus = open_checked(folder)
    except CorpusError as err:
        raise ExportError(
            f"RUNS: {name} stored no tokenizer, and its corpus here is unusable: {err}"
        ) from None
    if (fingerprint := tags.get(CORPUS_FINGERPRINT_TAG)) is not None:
        if fingerprint != corpus.fingerprint:
            raise ExportError(
                f"RUNS: {name} stored no tokenizer and {folder} holds other bytes than it trained on "
                f"(fingerprint {corpus.fingerprint}, the run's {fingerprint}): {never}; "
                "put back the corpus folder it trained on"
            )
        return corpus
    built = (record or {}).get("built_at")
    if built is None or built != corpus.manifest.get("built_at"):
        raise ExportError(
            f"RUNS: {name} stored no tokenizer nor corpus fingerprint, and {folder} was built at "
            f"{corpus.manifest.get('built_at')}, not at {built} as the run's: {never}"
        )
    return corpus


def _artifact_json(tracker: Tracker, run: Any, name: str, tmp: Path) -> dict | None:
    """A run's JSON artifact, or None when it has none."""
    folder = Path(tempfile.mkdtemp(dir=tmp))
    try:
        path = tracker.client.download_artifacts(run.info.run_id, name, str(folder))
        return json.loads(Path(path).read_text())
    except Exception:  # MLflow's own error types for a missing artifact; a file that is not JSON
        return None
