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
    """Whether a ``-m`` expression selects the ``gpu`` tests (marked ``gpu`` alone, as they all
    are), evaluated as pytest evaluates it: ``gpu``, ``gpu or slow`` do; ``not gpu``,
    ``not (slow or gpu)``, ``slow`` and none do not."""
    if not markexpr.strip():
        return False
    from _pytest.mark.expression import Expression

    expression = Expression.compile(markexpr)
    return expression.evaluate(lambda name, **kw: name == "gpu")


def pytest_configure(config: pytest.Config) -> None:
    if not selects_gpu_tests(config.getoption("markexpr", "") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA; children inherit it


@pytest.fixture(autouse=True)
def _cpu_unless_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a session that selects GPU tests beside others (``-m "gpu or slow"``), every test not
    marked ``gpu`` still runs on the CPU, and so do the processes it starts."""
    if request.node.get_closest_marker("gpu") is None and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        import torch

        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


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
