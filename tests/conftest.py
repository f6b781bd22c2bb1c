"""Shared fixtures: the micro sweep (three rows, a few steps, real corpus) that several test files read."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import MICRO, swept, use_repo_cache


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/micro.json from this run (tests/test_golden.py)",
    )


@pytest.fixture
def repo_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    use_repo_cache(monkeypatch)


@pytest.fixture(scope="session")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Run the micro sweep once; the corpus cache is the repository's own (real packages)."""
    yield from swept(tmp_path_factory.mktemp("micro"), MICRO)
