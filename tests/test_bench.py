"""Benchmarks: the lm-eval wrapper against direct model arithmetic, the offline suite's data, the
HumanEval executor, a micro task end to end through ``lm_eval.simple_evaluate``."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments.lm_wrapper import GatedAttnLM, cut_at_stop
from sweep.eval.humaneval_exec import passes
from sweep.eval.scores import parse_results
from sweep.eval.suite import bigbench_docs, humaneval_problems, mmlu_dev_questions
from sweep.grid import GridError, load_grid
from tests.support import (
    GOOD,
    MICRO,
    TEXT,
    WINDOW,
    direct_logprob,
    request,
    tiny_lm,
    use_repo_cache,
    write_grid,
)


@pytest.fixture(scope="module")
def lm() -> GatedAttnLM:
    return tiny_lm(TEXT, 300, max_gen_toks=12)


def test_loglikelihood_is_the_sum_of_token_logprobs(lm: GatedAttnLM) -> None:
    pairs = [("the cat sat on", " the mat"), ("a dog", " ran in the park"), ("the sky is", " blue")]
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    for (context, continuation), (logprob, _) in zip(pairs, got):
        whole = lm.tok_encode(context + continuation)
        n_cont = len(whole) - len(lm.tok_encode(context))
        assert n_cont > 0
        assert logprob == pytest.approx(direct_logprob(lm, whole, n_cont), abs=1e-4)


def test_a_context_longer_than_the_window_is_cut_from_the_left(lm: GatedAttnLM) -> None:
    context, continuation = TEXT[:400], " the mat"
    ((logprob, greedy),) = lm.loglikelihood([request("loglikelihood", context, continuation)])
    whole = lm.tok_encode(context + continuation)
    n_cont = len(whole) - len(lm.tok_encode(context))
    assert len(whole) > WINDOW + 1
    assert logprob == pytest.approx(direct_logprob(lm, whole[-(WINDOW + 1) :], n_cont), abs=1e-4)
    assert isinstance(greedy, bool)


def test_loglikelihood_rolling_is_the_documents_total_nll(lm: GatedAttnLM) -> None:
    short = "the cat sat on the mat."
    tokens = lm.tok_encode(short)
    assert len(tokens) < WINDOW
    (got,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", short)])
    assert got == pytest.approx(direct_logprob(lm, [0, *tokens], len(tokens)), abs=1e-4)

    long = TEXT[:300]
    tokens = lm.tok_encode(long)
    assert len(tokens) > 2 * WINDOW
    # Disjoint chunks of WINDOW predicted tokens; each sees as much of what precedes it as fits
    # in the window (EOS before the first token).
    padded, expected = [0, *tokens], 0.0
    for start in range(0, len(tokens), WINDOW):
        end = min(start + WINDOW, len(tokens))
        expected += direct_logprob(lm, padded[max(0, end - WINDOW) : end + 1], end - start)
    (got,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", long)])
    assert got == pytest.approx(expected, abs=1e-3)


def test_generate_until_stops_at_the_stop_string(lm: GatedAttnLM) -> None:
    context = "the cat sat"
    (free,) = lm.generate_until([request("generate_until", context, {"until": [], "max_gen_toks": 12})])
    assert len(free) >= 4
    stop = free[2:4]
    (cut,) = lm.generate_until([request("generate_until", context, {"until": [stop], "max_gen_toks": 12})])
    assert cut == free[: free.find(stop)]
    assert cut_at_stop("abc\ndef x", ["\nd", "x"]) == "abc"
    (same,) = lm.generate_until([request("generate_until", context, {"until": [""], "max_gen_toks": 12})])
    assert same == free  # an empty stop string stops nothing


def test_offline_suite_data() -> None:
    mmlu = mmlu_dev_questions()
    assert len(mmlu) == 282 and len({d["subject"] for d in mmlu}) == 57
    assert all(0 <= d["answer"] < len(d["choices"]) == len(d["labels"]) for d in mmlu)
    anatomy = next(d for d in mmlu if d["question"].startswith("Which of the following is the body cavity"))
    assert anatomy["choices"] == ["Abdominal", "Cranial", "Pleural", "Spinal"] and anatomy["answer"] == 1
    problems = humaneval_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"


def test_the_suite_builds_into_a_fresh_cache(tmp_path: Path) -> None:
    from sweep.eval.suite import chance, task_dir

    root = task_dir(tmp_path / "new" / "cache")
    assert sorted(p.name for p in root.iterdir()) == [
        "checksums.json", "humaneval.jsonl", "humaneval_exec.py", "mmlu_dev.jsonl", "offline_humaneval.yaml",
        "offline_mmlu_dev.yaml", "ready",
    ]  # fmt: skip
    assert not list((tmp_path / "new" / "cache").glob(".bench-build-*"))  # the build folder is gone
    assert chance(root, "offline_mmlu_dev") == pytest.approx((281 / 4 + 1 / 5) / 282)
    assert chance(root, "offline_humaneval") is None
    assert "unsafe_code: true" in (root / "offline_humaneval.yaml").read_text()  # lm-eval's own check
    assert task_dir(tmp_path / "new" / "cache") == root  # built once
    # the YAMLs name their data by absolute path: a moved cache is rebuilt, not read stale
    (tmp_path / "new").rename(tmp_path / "moved")
    moved = task_dir(tmp_path / "moved" / "cache")
    assert str(moved / "mmlu_dev.jsonl") in (moved / "offline_mmlu_dev.yaml").read_text()


def test_a_suite_file_changed_after_the_build_is_named_and_not_scored_from(tmp_path: Path) -> None:
    from sweep.eval.suite import BenchError, task_dir

    root = task_dir(tmp_path / "cache")
    data = root / "mmlu_dev.jsonl"
    data.write_text(data.read_text().replace('"answer": 0', '"answer": 1', 1))  # one answer edited
    with pytest.raises(BenchError) as info:
        task_dir(tmp_path / "cache")
    assert str(info.value) == (
        f"benchmark suite {root}: mmlu_dev.jsonl changed since it was built (another sha256); "
        f"delete the folder to rebuild it (rm -r {root})"
    )


def test_bigbench_task_json_becomes_multiple_choice(tmp_path: Path) -> None:
    spec = {
        "example_input_prefix": "Q: ",
        "examples": [
            {"input": "2+2?", "target_scores": {"3": 0, "4": 1, "5": 0}},
            {"input": "free text", "target": "x"},  # no choices: skipped
        ],
    }
    archive = tmp_path / "bigbench-1.0.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = json.dumps(spec).encode()
        info = tarfile.TarInfo("bigbench-1.0.0/bigbench/benchmark_tasks/sums/easy/task.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    docs = bigbench_docs(archive, "sums", "easy")
    assert docs == [
        {"question": "Q: 2+2?", "choices": ["3", "4", "5"], "labels": ["A", "B", "C"], "answer": 1}
    ]


def test_humaneval_executor_runs_the_tests_in_a_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    problem = humaneval_problems()[0]
    assert passes(problem, problem["canonical_solution"])
    assert not passes(problem, "    return None\n")
    assert not passes(problem, "    while True:\n        pass\n", timeout_s=1.0)


def test_a_micro_task_runs_end_to_end_through_simple_evaluate(lm: GatedAttnLM, tmp_path: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    docs = [
        {"question": "the cat sat on the", "choices": ["mat", "sky"], "labels": ["A", "B"], "answer": 0},
        {"question": "the sky is", "choices": ["blue", "hot", "cat"], "labels": ["A", "B", "C"], "answer": 0},
        {"question": "a dog ran in the", "choices": ["park", "sun"], "labels": ["A", "B"], "answer": 1},
    ]
    (tmp_path / "micro.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    from sweep.eval.suite import _mc_task, _write_task

    _write_task(tmp_path / "micro_mc.yaml", _mc_task("micro_mc", tmp_path / "micro.jsonl"))
    out = simple_evaluate(
        model=lm, tasks=["micro_mc"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=False
    )
    scores = parse_results("micro_mc", out["results"]["micro_mc"])
    prompt = "{q}\n" + "{opts}Answer:"
    hits = 0
    for d in docs:
        text = prompt.format(
            q=d["question"], opts="".join(f"{label}. {c}\n" for label, c in zip(d["labels"], d["choices"]))
        )
        asked = [request("loglikelihood", text, f" {label}") for label in d["labels"]]
        lls = [lp for lp, _ in lm.loglikelihood(asked)]
        hits += lls.index(max(lls)) == d["answer"]
    assert scores["bench/micro_mc/acc"] == pytest.approx(hits / len(docs))
    assert "bench/micro_mc/acc_stderr" in scores


def test_grid_eval_section_is_validated(tmp_path: Path) -> None:

    grid = load_grid(
        write_grid(tmp_path, GOOD + "eval: {tasks: [offline_mmlu_dev], num_fewshot: {offline_mmlu_dev: 5}}\n")
    )
    assert grid.eval.tasks == ("offline_mmlu_dev",) and grid.eval.fewshot("offline_mmlu_dev") == 5
    with pytest.raises(GridError, match=r"eval.shots: unknown key"):
        load_grid(write_grid(tmp_path, GOOD + "eval: {tasks: [a], shots: 3}\n"))
    with pytest.raises(GridError, match=r"eval.num_fewshot.b: must map a listed task"):
        load_grid(write_grid(tmp_path, GOOD + "eval: {tasks: [a], num_fewshot: {b: 1}}\n"))


@pytest.mark.slow
def test_make_eval_scores_finished_runs_without_retraining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    from sweep.cli import main

    use_repo_cache(monkeypatch)
    plain, scored = tmp_path / "plain.yaml", tmp_path / "scored.yaml"
    plain.write_text(MICRO)
    scored.write_text(
        MICRO + "eval: {tasks: [offline_mmlu_dev, offline_humaneval], limit: 6, max_gen_toks: 8}\n"
    )
    results = tmp_path / "results"
    assert main(["sweep", "--grid", str(plain), "--results", str(results)]) == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")

    def runs() -> list:
        return client.search_runs([exp.experiment_id], "tags.kind = 'cell'", run_view_type=ViewType.ALL)

    before = {r.info.run_id for r in runs()}
    assert not any(k.startswith("bench/") for r in runs() for k in r.data.metrics)
    capsys.readouterr()

    # Without HF_ALLOW_CODE_EVAL=1, HumanEval runs nothing: one warning, no number in the tables.
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    assert main(["eval", "--grid", str(scored), "--results", str(results)]) == 0
    printed = capsys.readouterr().out
    held = "warning: offline_humaneval not scored: it runs model-generated code; set HF_ALLOW_CODE_EVAL=1"
    assert printed.count(held) == 1
    assert "benchmarks (offline_mmlu_dev): 3 runs scored, 0 failed" in printed
    assert not any(k.startswith("bench/offline_humaneval/") for r in runs() for k in r.data.metrics)
    csv = pd.read_csv(results / "micro.csv").set_index("id")
    assert csv["bench_offline_humaneval"].isna().all() and (csv["bench_offline_humaneval_n"] == 0).all()
    assert csv["bench_offline_mmlu_dev"].notna().all()
    md = (results / "micro.md").read_text().splitlines()
    lines = [line.split("|") for line in md if line.startswith("|")]
    column = next(i for i, cell in enumerate(lines[0]) if cell.strip().startswith("humaneval"))
    assert {row[column].strip() for row in lines[2:]} == {"—"}  # no number for an unscored task

    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    assert main(["eval", "--grid", str(scored), "--results", str(results)]) == 0
    printed = capsys.readouterr().out
    assert (
        "warning: HF_ALLOW_CODE_EVAL=1: offline_humaneval runs model-generated code: each program" in printed
    )
    assert "benchmarks (offline_mmlu_dev, offline_humaneval): 3 runs scored, 0 failed" in printed
    after = runs()
    for run in after:  # MMLU was scored once: only the missing task ran again
        assert len(client.get_metric_history(run.info.run_id, "bench/offline_mmlu_dev/acc")) == 1
    assert {r.info.run_id for r in after} == before  # nothing trained again
    for run in after:
        acc = run.data.metrics["bench/offline_mmlu_dev/acc"]
        assert acc in {i / 6 for i in range(7)}  # 6 questions
        assert run.data.metrics["bench/offline_mmlu_dev/acc_stderr"] >= 0
        assert run.data.metrics["bench/offline_humaneval/pass_at_1"] in {i / 6 for i in range(7)}
    csv = pd.read_csv(results / "micro.csv").set_index("id")
    for run in after:  # one seed per row: the table's value is the run's
        row = csv.loc[run.data.tags["row"]]
        assert row["bench_offline_mmlu_dev"] == pytest.approx(
            run.data.metrics["bench/offline_mmlu_dev/acc"], abs=1e-5
        )
        assert row["bench_offline_humaneval"] == pytest.approx(
            run.data.metrics["bench/offline_humaneval/pass_at_1"], abs=1e-5
        )
        assert row["bench_offline_humaneval_n"] == 1
    table = (results / "micro.md").read_text()
    assert "mmlu_dev acc (chance 0.250)" in table and "humaneval pass@1" in table

    assert main(["eval", "--grid", str(scored), "--results", str(results)]) == 0  # nothing missing
    assert "runs scored" not in capsys.readouterr().out

    # Scores made with another recipe (here 4 questions, not 6) are not the grid's: the tables
    # leave them out, and make eval scores the task again (HumanEval's stand).
    fewer = tmp_path / "fewer.yaml"
    fewer.write_text(scored.read_text().replace("limit: 6", "limit: 4"))
    assert main(["tables", "--grid", str(fewer), "--results", str(results)]) == 0
    csv = pd.read_csv(results / "micro.csv").set_index("id")
    assert csv["bench_offline_mmlu_dev"].isna().all() and (csv["bench_offline_mmlu_dev_n"] == 0).all()
    capsys.readouterr()
    assert main(["eval", "--grid", str(fewer), "--results", str(results)]) == 0
    assert (
        "benchmarks (offline_mmlu_dev, offline_humaneval): 3 runs scored, 0 failed" in capsys.readouterr().out
    )
    csv = pd.read_csv(results / "micro.csv").set_index("id")
    for run in runs():
        assert len(client.get_metric_history(run.info.run_id, "bench/offline_mmlu_dev/acc")) == 2
        acc = run.data.metrics["bench/offline_mmlu_dev/acc"]
        assert acc in {i / 4 for i in range(5)}
        assert csv.loc[run.data.tags["row"], "bench_offline_mmlu_dev"] == pytest.approx(acc, abs=1e-5)
    assert main(["eval", "--grid", str(scored), "--results", str(results)]) == 0  # back to 6: again
    assert "3 runs scored" in capsys.readouterr().out


def test_the_table_shows_acc_or_the_only_score_headed_with_the_logged_chance(tmp_path: Path) -> None:
    from dataclasses import replace

    import pandas as pd

    from experiments.names import bench_score_key
    from sweep.evalspec import ScaleEval
    from sweep.report.tables import bench_columns

    tasks = "offline_mmlu_dev, offline_humaneval, hellaswag, offline_gsm8k, offline_sciq"
    grid = load_grid(write_grid(tmp_path, GOOD + f"eval: {{tasks: [{tasks}]}}\n"))
    runs = pd.DataFrame(
        [
            {
                "status": "finished",
                "bench/offline_mmlu_dev/acc": 0.25,
                "bench/offline_mmlu_dev/acc_stderr": 0.02,
                "bench/offline_mmlu_dev/chance": 0.2497,
                "bench/offline_humaneval/pass_at_1": 0.0,
                "bench/offline_humaneval/pass_at_1_stderr": 0.0,
            }
        ]
    )
    # at a scale whose make sweep scores every task, every task is a column
    assert len(bench_columns(grid, "tiny", runs)) == 5
    # where it scores a subset, a task neither in it nor scored is none (hellaswag, offline_sciq),
    # unless it is one of the paper's (offline_gsm8k)
    grid = replace(grid, eval=replace(grid.eval, at={"tiny": ScaleEval(tasks=("offline_mmlu_dev",))}))
    mmlu, humaneval, gsm8k = bench_columns(grid, "tiny", runs)
    assert (mmlu.metric, mmlu.heading) == ("bench/offline_mmlu_dev/acc", "mmlu_dev acc (chance 0.250)")
    assert (humaneval.metric, humaneval.heading) == ("bench/offline_humaneval/pass_at_1", "humaneval pass@1")
    assert (gsm8k.metric, gsm8k.paper) == (
        "bench/offline_gsm8k/bpb",
        "gsm8k",
    )  # not scored yet: its BENCH_METRIC
    runs["bench/hellaswag/acc"] = 0.3
    assert [b.metric for b in bench_columns(grid, "tiny", runs)][2] == "bench/hellaswag/acc"
    assert bench_score_key("t", ["bench/t/acc_norm", "bench/t/acc", "bench/t/chance"]) == "bench/t/acc"
    assert bench_score_key("t", ["bench/t/exact_match", "bench/t/chance"]) == "bench/t/exact_match"
    assert bench_score_key("t", ["bench/t/chance", "bench/u/acc"]) is None


def naive_greedy(lm: GatedAttnLM, prompt: list[int], budget: int, stops: list[str]) -> list[int]:
    """Greedy decoding the slow way: the whole sequence through the model for every new token."""
    tokens, new = list(prompt), []
    with torch.no_grad():
        for _ in range(budget):
            token = int(lm.model(torch.tensor([tokens]))[0, -1].argmax())
            if token == lm.eot_token_id:
                break
            tokens.append(token)
            new.append(token)
            if any(s in lm.tok_decode(new) for s in stops):
                break
    return new


def test_cached_batched_generation_equals_the_naive_loop(lm: GatedAttnLM) -> None:
    """Rows of one batch that stop at different steps (and leave it) get exactly the tokens the
    one-at-a-time, no-cache loop gives each of them."""
    text = lm.tok_encode(TEXT)
    prompts = [text[0:5], text[7:12], text[20:25]]  # one batch: prompts of one length
    free = [naive_greedy(lm, p, 12, []) for p in prompts]
    stops = [[lm.tok_decode(free[0][1:3])], [], [lm.tok_decode(free[2][4:5])]]
    expected = [naive_greedy(lm, p, 12, s) for p, s in zip(prompts, stops)]
    assert len({len(e) for e in expected}) > 1  # the rows really stop at different steps
    got = lm._greedy(torch.tensor(prompts), 12, stops)
    assert got == expected


def test_answers_to_one_question_share_a_forward_pass(
    lm: GatedAttnLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    context = lm.tok_encode("the cat sat on the")
    answers = [lm.tok_encode(" " + w)[-1:] for w in ("mat", "dog", "sun", "sky")]
    calls = []
    forward = lm.model.forward
    monkeypatch.setattr(
        lm.model, "forward", lambda tokens, *a: calls.append(tokens.shape) or forward(tokens, *a)
    )
    got = lm._score([(context, a) for a in answers])
    assert calls == [(1, len(context))]  # four requests, one row
    for a, (logprob, _) in zip(answers, got):
        assert logprob == pytest.approx(direct_logprob(lm, context + a, 1), abs=1e-5)
