"""Shared fixtures: the micro sweep (three rows, a few steps, real corpus) that several test files
read; and the one rule for GPUs: a session that does not select the ``gpu`` tests (``make test``,
``make test-all``) runs with CUDA hidden, so on a GPU host its tests and the processes they start
train on the CPU as on CI (``accelerator="auto"`` would otherwise make the DDP tests 2-GPU tests and
the golden cells bf16 ones); ``make test-gpu`` (``-m gpu``) runs the tests that need CUDA, each
skipped where there is none."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a ``-m`` expression asks for the ``gpu`` tests (``gpu``, ``gpu and not slow``), as
    opposed to excluding them or not naming them."""
    words = markexpr.replace("(", " ").replace(")", " ").split()
    return any(w == "gpu" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def pytest_configure(config: pytest.Config) -> None:
    if not selects_gpu_tests(config.getoption("markexpr", "") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA; children inherit it


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/micro.json from this run (tests/test_golden.py)",
    )


# tests.support is imported inside the fixtures: it needs MLflow, Optuna and lm-eval, which a GPU
# image without network lacks, and its GPU tests (``make gpu-check``) need none of them.


@pytest.fixture
def repo_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support import use_repo_cache

    use_repo_cache(monkeypatch)


@pytest.fixture(scope="session")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Run the micro sweep once; the corpus cache is the repository's own (real packages)."""
    from tests.support import MICRO, swept

    yield from swept(tmp_path_factory.mktemp("micro"), MICRO)
