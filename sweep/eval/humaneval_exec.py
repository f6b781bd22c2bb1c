"""HumanEval pass@1 for lm-eval's ``process_results``: the completion runs with the problem's
tests in a separate Python process (isolated mode, no site packages, a temporary folder, a
timeout), so a hanging or
crashing completion costs one failed problem, never the evaluation.

lm-eval loads this file from the suite's task folder (``!function humaneval_exec.process_results``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

TIMEOUT_S = 10.0


def program(doc: dict, completion: str) -> str:
    """The prompt, the completion, the problem's tests and the call of ``check``."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def passes(doc: dict, completion: str, timeout_s: float = TIMEOUT_S) -> bool:
    """Whether ``completion`` passes the problem's tests within ``timeout_s`` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-S", "-c", program(doc, completion)],
                cwd=tmp,
                capture_output=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval hook: ``results`` holds the one greedy completion."""
    return {"pass@1": float(passes(doc, results[0]))}
