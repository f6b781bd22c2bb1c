"""HumanEval pass@1 for lm-eval's ``process_results``: the completion runs with the problem's
tests in a confined child process (``sweep.eval.sandbox``: only with ``HF_ALLOW_CODE_EVAL=1``; an
empty folder, resource limits, a reliability guard, no network, a timeout), so a hanging, crashing
or harmful completion costs one failed problem, never the evaluation or the machine.

lm-eval loads this file from the suite's task folder (``!function humaneval_exec.process_results``).
"""

from __future__ import annotations

from sweep.eval.sandbox import require_opt_in, run_confined

TIMEOUT_S = 10.0


def program(doc: dict, completion: str) -> str:
    """The prompt, the completion, the problem's tests and the call of ``check``."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def passes(doc: dict, completion: str, timeout_s: float = TIMEOUT_S) -> bool:
    """Whether ``completion`` passes the problem's tests within ``timeout_s`` wall seconds; a
    completion that exits early (``sys.exit(0)``) or breaks a limit fails.

    Raises:
        CodeEvalRefused: ``HF_ALLOW_CODE_EVAL`` is not ``1``: nothing runs.
    """
    require_opt_in(f"HumanEval ({doc.get('task_id', 'a problem')})")
    return run_confined(program(doc, completion), timeout_s)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval hook: ``results`` holds the one greedy completion.

    Raises:
        CodeEvalRefused: ``HF_ALLOW_CODE_EVAL`` is not ``1`` (no score, not a 0).
    """
    return {"pass@1": float(passes(doc, results[0]))}
