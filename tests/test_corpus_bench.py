"""``make corpus-bench``: its builds run the code of the checkout they name, and it reports what it
compares (a 1 MB file, so the figures themselves mean nothing here)."""

import re
from pathlib import Path

import pytest

from tools import corpus_bench

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_a_child_imports_the_checkout_it_is_given(tmp_path: Path) -> None:
    # A stand-in checkout whose experiments package says where it is: the child must import it
    # and not this repository (the editable install, or a working folder put first on sys.path).
    fake = tmp_path / "other"
    (fake / "experiments" / "corpus").mkdir(parents=True)
    (fake / "experiments" / "__init__.py").write_text(
        "import sys\nsys.exit(7 if 'other' in __file__ else 9)\n"
    )
    with pytest.raises(SystemExit, match="exit status 7"):
        corpus_bench.child("import experiments", [], root=fake)


def test_the_bench_compares_against_a_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = corpus_bench.main(["--mb", "1", "--rounds", "1", "--dir", str(tmp_path), "--against", str(ROOT)])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"round 1: \S+'s build [\d.]+ MB/s .* token files identical: True", out)
    assert re.search(r"build / \S+'s build, the rounds' mean: [\d.]+x", out)
    assert "rerun after the kill" in out and "token files identical: False" not in out


def test_a_folder_that_is_not_a_checkout_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        corpus_bench.main(["--against", str(tmp_path)])
    assert stop.value.code == 2
    assert f"--against {tmp_path}: not a checkout of this project" in capsys.readouterr().err
