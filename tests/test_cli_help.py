"""Every command line's ``--help`` works, answers before any heavy import, and offers only the flags
the command acts on; ``make help``, docs/commands.md and the command lines agree on what each target
runs.

``--help`` runs in a fresh interpreter, as a user runs it: a ``%`` in a help string once reached
argparse's formatter and crashed ``python -m sweep.cli --help`` with a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from sweep import browse, cli_parser
from tests.support import ROOT

PROGRAMS = {"sweep.cli": cli_parser.COMMANDS, "sweep.browse": browse.COMMANDS}
HELP_CASES = [(module, None) for module in PROGRAMS] + [
    (module, name) for module, commands in PROGRAMS.items() for name, _ in commands
]
WIDTH = 100
INTERNAL = {"worker"}  # started by `sweep --workers`, never by hand: no make target
ONE_SCREEN = 40  # lines


def _help(module: str, command: str | None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", module, *([command] if command else []), "--help"]
    env = {**os.environ, "COLUMNS": str(WIDTH)}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("module", "command"), HELP_CASES, ids=[f"{m} {c or ''}" for m, c in HELP_CASES])
def test_help_exits_0_with_readable_text(module: str, command: str | None) -> None:
    done = _help(module, command)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    usage = f"usage: python -m {module}{' ' + command if command else ''} [-h]"
    assert done.stdout.startswith(usage)
    assert max(len(line) for line in done.stdout.splitlines()) <= WIDTH
    text = " ".join(done.stdout.split())  # argparse wraps lines; compare the words
    if command is None:  # the program lists every command with what it does
        for name, what in PROGRAMS[module]:
            assert f"{name} {' '.join(what.split())}" in text
        assert "Exit status: 0" in text
    else:  # a command's page opens with what it does, the same words as the list
        what = dict(PROGRAMS[module])[command]
        assert f"{what[0].upper()}{what[1:]}." in text


def _make_help() -> str:
    done = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _phony_targets() -> set[str]:
    line = next(li for li in (ROOT / "Makefile").read_text().splitlines() if li.startswith(".PHONY:"))
    return set(line.removeprefix(".PHONY:").split())


def test_make_help_lists_every_target_on_one_screen() -> None:
    out = _make_help()
    listed = set(re.findall(r"^  ([a-z][a-z0-9-]*) ", out, flags=re.M))
    aliases = set(re.findall(r"old names: ([a-z-]+), ([a-z-]+)", out)[0])
    assert listed | aliases == _phony_targets()
    assert len(out.splitlines()) <= ONE_SCREEN
    assert (
        subprocess.run(["make", "-s"], cwd=ROOT, capture_output=True, text=True).stdout == out
    )  # the default


def test_make_help_names_every_command_of_the_command_lines() -> None:
    listed = set(re.findall(r"^  ([a-z][a-z0-9-]*) ", _make_help(), flags=re.M))
    commands = {name for commands in PROGRAMS.values() for name, _ in commands} - INTERNAL
    assert commands <= listed


def test_the_commands_page_has_every_target_and_every_variable() -> None:
    page = (ROOT / "docs" / "commands.md").read_text()
    documented_targets = set(re.findall(r"`make ([a-z][a-z0-9-]*)", page))
    assert _phony_targets() <= documented_targets
    makefile = (ROOT / "Makefile").read_text()
    variables = set(re.findall(r"^([A-Z][A-Z_]*) *\?=", makefile, flags=re.M))
    assert variables, "the scan finds the Makefile's variables"
    documented_variables = set(re.findall(r"^\| `([A-Z][A-Z_]*)`", page, flags=re.M))
    assert variables <= documented_variables


#: Modules that take seconds to import; ``--help`` must answer before any of them loads.
HEAVY = ("torch", "lightning", "mlflow", "optuna", "pandas", "sqlalchemy", "matplotlib", "transformers")


@pytest.mark.parametrize(("module", "command"), HELP_CASES, ids=[f"{m} {c or ''}" for m, c in HELP_CASES])
def test_help_answers_before_any_heavy_module_loads(module: str, command: str | None) -> None:
    """Structural, not timed: ``-X importtime`` lists every module the process imported before
    argparse printed the help and exited (it took 2.2-2.9 s when torch loaded first)."""
    argv = [sys.executable, "-X", "importtime", "-m", module, *([command] if command else []), "--help"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "argparse" in loaded  # the scan reads importtime's lines
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY) == []


def _options(module: str) -> dict[str, set[str]]:
    """Each command's option strings, from its parser."""
    top = cli_parser.parser() if module == "sweep.cli" else browse._parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


def test_force_and_seeds_are_offered_only_by_the_commands_that_act_on_them() -> None:
    """``--force`` was offered by every command and acted in two; ``--seeds`` and ``--results``
    where nothing read them."""
    options = _options("sweep.cli")
    assert {c for c, o in options.items() if "--force" in o} == {"sweep", "export"}
    assert {c for c, o in options.items() if "--seeds" in o} == {
        "sweep",
        "tables",
        "budget",
        "eval",
        "worker",
    }
    assert {c for c, o in options.items() if "--results" not in o} == {"params", "data"}
    page = (ROOT / "docs" / "commands.md").read_text()
    seeds_row = next(line for line in page.splitlines() if line.startswith("| `SEEDS` |"))
    assert set(re.findall(r"`(?:make )?([a-z]+)`", seeds_row)) == {"sweep", "tables", "budget", "eval"}
    force_row = next(line for line in page.splitlines() if line.startswith("| `FORCE` |"))
    assert set(re.findall(r"`make ([a-z]+)`", force_row)) == {"sweep", "export"}


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["tables", "--force"], "error: python -m sweep.cli tables: does not take --force"),
        (["params", "--seeds", "3"], "error: python -m sweep.cli params: does not take --seeds 3"),
        (["data", "--results", "elsewhere"], "error: python -m sweep.cli data: does not take --results"),
    ],
)
def test_a_flag_a_command_does_not_act_on_is_refused_in_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sweep.cli import main

    def started(*args: object) -> None:  # should the refusal regress: fail here, run nothing
        raise AssertionError("the flag got past the parser: the command started")

    monkeypatch.setattr("sweep.cli._main", started)
    monkeypatch.setattr(subprocess, "Popen", started)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(said) and err.count("\n") == 1


def _recipes() -> dict[str, str]:
    """Each Makefile target's recipe (its prerequisites, then its command lines, joined)."""
    out: dict[str, str] = {}
    target = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if match := re.match(r"^([a-z][a-z0-9 -]*):(?!=)(.*)$", line):
            target = match.group(1).split()
            for name in target:
                out[name] = match.group(2)
        elif line.startswith("\t") and target:
            for name in target:
                out[name] += "\n" + line.strip()
        elif not line.strip():
            target = None
    return out


def _page_runs() -> dict[str, str]:
    """docs/commands.md's "runs" cell of each target, from the tables with a runs column."""
    out = {}
    for line in (ROOT / "docs" / "commands.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`make "):
            for target in re.findall(r"`make ([a-z][a-z0-9-]*)`", cells[0]):
                out[target] = cells[1]
    return out


def test_the_commands_page_says_what_each_target_runs() -> None:
    """Each target's "runs" cell names the modules its recipe runs with ``python -m``, and every
    target it runs with ``$(MAKE)``: the page once said every target ran ``python -m sweep.cli
    <target>``, false for headline and results."""
    recipes, runs = _recipes(), _page_runs()
    assert set(runs) == _phony_targets()
    for target, cell in runs.items():
        recipe = recipes[target]
        ran = set(re.findall(r"\) -m ((?:sweep\.cli|sweep\.browse) [a-z]+|[a-z_.]+)", recipe))  # $(PY) -m
        ran -= {"pip", "venv"}  # set-up steps, named by the cell in words
        named = set(re.findall(r"python -m ((?:sweep\.cli|sweep\.browse) [a-z]+|[a-z_.]+)", cell))
        assert named - {"pip", "venv"} == ran, target
        made = set(re.findall(r"\$\(MAKE\) ([a-z-]+)", recipe)) | set(re.findall(r"^ *([a-z-]+)$", recipe))
        assert {
            t for t in re.findall(r"`(?:make )?([a-z][a-z0-9-]*)`", cell) if t in _phony_targets()
        } == made, target


def test_make_help_headings_say_what_their_targets_run() -> None:
    """``Train and report (python -m sweep.cli TARGET, but results and headline)``: each target
    under such a heading runs that module with its own name, but the ones named after "but"."""
    recipes, heading, headings = _recipes(), None, 0
    for line in _make_help().splitlines():
        if match := re.match(r"^\S.*\(python -m ([a-z_.]+) (?:TARGET|COMMAND)(?:, but (.+))?\)$", line):
            heading = (match.group(1), set(re.split(r", | and ", match.group(2) or "")) - {""})
            headings += 1
        elif not line.startswith("  "):
            heading = None
        elif heading is not None:
            target = line.split()[0]
            runs = f"-m {heading[0]} {target}" in recipes[target]
            assert runs != (target in heading[1]), target
    assert headings == 2  # sweep.cli's and sweep.browse's


def test_the_budget_file_has_one_name_in_the_cli_make_help_the_page_and_on_disk() -> None:
    from sweep.grid import load_grid
    from sweep.report.write import table_paths

    name = "results/<table>_budget.{md,csv}"
    assert name in dict(cli_parser.COMMANDS)["budget"]
    assert name in _make_help() and name in (ROOT / "docs" / "commands.md").read_text()
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    table = table_paths(grid, "cpu_long", ROOT / "results", [0, 1, 2])["md"]  # <table>.md
    assert table.with_name(f"{table.stem}_budget.md").is_file()  # the committed budget report


def test_the_makefiles_scale_comment_names_every_scale_of_the_shipped_grids() -> None:
    from sweep.grid import load_grid

    scales = {s for path in (ROOT / "grids").glob("*.yaml") for s in load_grid(path).scales}
    comment = next(li for li in (ROOT / "Makefile").read_text().splitlines() if li.startswith("#   SCALE"))
    row = next(
        li for li in (ROOT / "docs" / "commands.md").read_text().splitlines() if li.startswith("| `SCALE`")
    )
    assert scales <= set(re.findall(r"[a-z_]+", comment)) and scales <= set(re.findall(r"`([a-z_]+)`", row))
