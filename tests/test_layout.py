"""The code's shape: imports run one way, no cycles, no module too long to read in one sitting, and
a layout CONTRIBUTING.md shows as it is.

``experiments`` (the science) never imports ``sweep`` (the harness). Inside ``sweep``, the four
jobs - ``sweep.run`` (train cells), ``sweep.report`` (tables and figures), ``sweep.eval``
(benchmark scores), ``sweep.export`` (transformers folders) - import ``experiments`` and the
shared base (``sweep.grid``, ``sweep.gridfile``, ``sweep.store``, ``sweep.studies``,
``sweep.signals``), never one another, and nothing imports the
entry points (``sweep.cli``, ``sweep.browse``) or the operational scripts of ``tools`` (outside
the installed package).

``python -m tests.test_layout`` prints the layout tree that CONTRIBUTING.md must hold.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("experiments", "sweep", "tools")
JOBS = ("sweep.run", "sweep.report", "sweep.eval", "sweep.export")
ENTRY_POINTS = ("sweep.cli", "sweep.browse", "tools")
#: Code lines per module at most: docstrings, comments and blank lines do not count, so a module
#: keeps room to explain itself.
MAX_CODE_LINES = 300
#: Modules allowed over the cap for now, each with the reason; empty when none is.
OVER_THE_CAP: dict[str, str] = {}

#: The layout CONTRIBUTING.md shows: (a folder or files, what they hold, the entries inside a
#: folder). A folder without entries covers every module under it; one with entries must name each
#: of its modules (``test_every_module_has_a_place_in_the_layout``).
LAYOUT: tuple = (
    (
        "experiments/",
        "the science, usable without the harness (never imports sweep)",
        (
            ("config.py", "RunConfig, one trainable cell; re-exports every config class"),
            (
                "model_config.py",
                "ModelConfig, GateConfig, MoEConfig; analytic parameter counts",
            ),
            ("train_config.py", "TrainConfig: optimiser, schedule, budget, probes, checkpoints, placement"),
            ("data_config.py", "DataConfig, BackcopyConfig: the corpus recipe and the synthetic sink task"),
            ("strict.py", "the strict dataclass loader every config and the grid schema go through"),
            (
                "names.py",
                "every name the user sees: metric keys, statuses, outcomes, table columns",
            ),
            ("numerics.py", "the pinned CPU arithmetic and NUMBERS_VERSION"),
            ("gating.py", "the paper's whole gate space as one module"),
            (
                "model.py, moe.py",
                "decoder-only LM (pre-RMSNorm, RoPE, GQA, qk-norm, SwiGLU or MoE); the MoE FFN",
            ),
            ("experts.py", "the MoE experts' kernels: grouped_mm or the loop, the combine; no host sync"),
            ("devices.py", "what the device changes: auto precision, scoring autocast, RNG, GPU arithmetic"),
            (
                "corpus/",
                "the corpus: package, file and hub sources; build, streaming build, reader",
            ),
            (
                "checksums.py",
                "size and sha256 of every file a build wrote, checked on use",
            ),
            (
                "data.py, lit.py",
                "the LightningDataModule; the LightningModule (AdamW, warmup + cosine, PPL per domain)",
            ),
            ("loss.py", "the next-token loss, whole or a chunk of tokens at a time (train.loss_chunk)"),
            ("train.py", "the training recipe: a RunConfig in, a trained and probed model out"),
            ("checkpointing.py", "crash-safe step checkpoints, saved at a step's start"),
            (
                "sharding.py, meta_init.py",
                "FSDP2 through Lightning (the paper scales); a meta-device build initialised as on one CPU",
            ),
            ("sharded_checkpoints.py", "a sharded run's checkpoint: a folder of shards, atomic, checksummed"),
            ("memory.py", "per-GPU memory of a run, planned on the meta device (make params)"),
            ("probes.py, stability.py", "gate scores, F-Attn, M-Act, sparsity; loss spikes and divergence"),
            ("init_stats.py", "the gate at initialisation: logit std, branch scale (make init-table)"),
            ("lm_wrapper.py", "our checkpoints as an lm-evaluation-harness model"),
            (
                "longctx.py, passkey.py",
                "long context (Table 5): PPL, passkey, F-Attn by length, with and without YaRN",
            ),
            ("longctx_config.py", "the grid's longctx: settings (no torch import)"),
            ("hf/", "a trained model as a transformers folder: its class, renamed weights, custom code"),
        ),
    ),
    (
        "sweep/",
        "the harness: which cell, which run, which store",
        (
            ("grid.py, gridfile.py", "YAML grid -> validated cells with run_key; one-line errors"),
            ("gridcheck.py, evalspec.py", "a grid's cross-references; its eval: and longctx: sections"),
            ("store.py, studies.py", "MLflow glue; Optuna storage (shared by run, report and eval)"),
            (
                "store_urls.py, passwords.py",
                "where the stores are, whether they answer; passwords hidden",
            ),
            ("sqlite_lock.py", "one process at a time creates a database's schema"),
            ("fingerprints.py", "which runs trained on the corpus bytes found here"),
            ("signals.py", "every signal handled, who handles it, and the stop it causes"),
            (
                "run/",
                "runner, queue, worker, driver (WORKERS), gpus, cell, ranks, slurm (LAUNCHER), resume, tune",
            ),
            (
                "report/",
                "store queries, tables, figures, the headline figure, budget, LR and ladder reports",
            ),
            (
                "eval/",
                "benchmark scores: offline suite, lm-eval, HumanEval executor, long context, RULER",
            ),
            ("export/", "finished runs as transformers folders: which runs, the checks, the model card"),
            ("paper/", "the paper's own numbers, one CSV per table"),
            (
                "cli.py, cli_parser.py",
                "python -m sweep.cli: the commands the Makefile calls, and their options",
            ),
            (
                "browse.py, ui_view.py",
                "python -m sweep.browse (ui, compare, dashboard); the UI's saved view",
            ),
        ),
    ),
    (
        "tools/",
        "operational scripts, not installed: GPU, UI and servers checks, benchmarks, doc_stats",
        (),
    ),
    ("grids/ notebooks/ results/ tests/ docs/", "", ()),
)
COLUMN = 18  # where the tree's descriptions start; a longer name is followed by two spaces


def layout_tree() -> str:
    """:data:`LAYOUT` as the tree CONTRIBUTING.md shows (the body of its Layout code block)."""
    lines = []

    def add(indent: str, names: str, what: str) -> None:
        text = f"{indent}{names}"
        pad = max(2, COLUMN - len(text)) if what else 0
        lines.append(f"{text}{' ' * pad}{what}".rstrip())

    for folder, what, entries in LAYOUT:
        add("", folder, what)
        for names, inner in entries:
            add("  ", names, inner)
    return "\n".join(lines) + "\n"


def _entries() -> list[tuple[Path, bool]]:
    """Every path the layout names, and whether it is a folder whose modules it covers whole."""
    out = []
    for folder, _, entries in LAYOUT:
        for name in folder.split():
            out.append((ROOT / name, not entries))
        for names, _ in entries:
            for name in names.split(", "):
                out.append((ROOT / folder / name, name.endswith("/")))
    return out


def code_lines(text: str) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring (a string
    standing alone as a statement: a module's, class's or function's docstring, or an attribute's
    below its field)."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    code = set()
    skipped = (
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    )
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skipped:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """Our modules that ``name`` imports anywhere in its file (function-level imports included)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _entry(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in ENTRY_POINTS)


def _owner(name: str) -> str | None:
    return next((job for job in JOBS if name == job or name.startswith(job + ".")), None)


def test_the_science_never_imports_the_harness() -> None:
    offenders = {
        m: sorted(t for t in GRAPH[m] if t.startswith("sweep")) for m in GRAPH if m.startswith("experiments")
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_run_report_and_eval_never_import_each_other_or_the_entry_points() -> None:
    crossings = {}
    for module, targets in GRAPH.items():
        job = _owner(module)
        for target in targets:
            other = _owner(target)
            if _entry(target) and not _entry(module):
                crossings[module] = target
            elif job and other and other != job:
                crossings[module] = target
    assert crossings == {}


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_has_more_code_lines_than_the_cap(module: str) -> None:
    lines = code_lines(MODULES[module].read_text())
    if module in OVER_THE_CAP:
        pytest.xfail(f"{lines} code lines: {OVER_THE_CAP[module]}")
    assert lines <= MAX_CODE_LINES


def test_code_lines_leave_out_docstrings_comments_and_blank_lines() -> None:
    text = '''"""A module's docstring,
on two lines."""

import os  # a comment after code counts

# a comment alone does not


class A:
    """A class's docstring."""

    x: int = 1
    """An attribute's docstring."""

    def f(self) -> str:
        return (
            "a string inside code counts"
        )
'''
    assert code_lines(text) == 7  # import, class, x, def, return, the string, the parenthesis


def test_every_module_has_a_place_in_the_layout() -> None:
    entries = _entries()
    assert [p for p, _ in entries if not p.exists()] == []
    whole = [p for p, covers in entries if covers]
    named = {p for p, covers in entries if not covers}
    homeless = [
        str(p.relative_to(ROOT))
        for p in MODULES.values()
        if p.name != "__init__.py" and p not in named and not any(f in p.parents for f in whole)
    ]
    assert homeless == []


def test_contributing_shows_this_layout() -> None:
    """CONTRIBUTING.md's Layout block is :func:`layout_tree` (``python -m tests.test_layout``
    prints it)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = re.search(r"## Layout\n.*?```\n(.*?)```", text, flags=re.S)
    assert block is not None, "CONTRIBUTING.md has a Layout section with one code block"
    assert block.group(1) == layout_tree()


def test_the_graph_sees_real_imports() -> None:
    """The checks above mean something only if the scan finds the imports we know exist."""
    assert "experiments.config" in GRAPH["experiments.gating"]
    assert "sweep.store" in GRAPH["sweep.run.runner"]
    assert "sweep.run.driver" in GRAPH["sweep.cli"]  # a function-level import counts too


if __name__ == "__main__":
    print(layout_tree(), end="")
