"""Every command line's ``--help`` works, and ``make help`` and docs/commands.md name every command.

``--help`` runs in a fresh interpreter, as a user runs it: a ``%`` in a help string once reached
argparse's formatter and crashed ``python -m sweep.cli --help`` with a traceback.
"""

from __future__ import annotations

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
