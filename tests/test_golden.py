"""Golden numbers: the micro sweep's dense, gated and MoE cells train to the losses and validation
PPLs in ``tests/golden/micro.json``, so no change moves a number unseen (issue 26).

The cells are the session's micro sweep (``conftest.MICRO``: the real corpus, the CLI's sequential
path, MLflow), so the test pins what a user's sweep records, not a side path. The numbers hold for
the pinned CPU arithmetic (:mod:`experiments.numerics`: every Intel x86-64 CPU computes the same
bits); elsewhere the test says why it cannot compare and skips.

A change meant to move the numbers: bump ``experiments.numerics.NUMBERS_VERSION`` (every run key
changes with it, so sweeps retrain instead of reusing runs of the old numbers), then
``pytest tests/test_golden.py --update-golden`` rewrites the file; commit both with the reason.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import pytest
from mlflow import MlflowClient

from experiments import names as N
from experiments.numerics import (
    NUMBERS_VERSION,
    OPT_OUT,
    PINNED,
    PINNED_ARITHMETIC,
    X86,
    cpu_arithmetic,
    cpu_vendor,
    pin_cpu_arithmetic,
)

GOLDEN = Path(__file__).with_name("golden") / "micro.json"
ROWS = ("baseline", "sdpa_elementwise", "moe")  # dense, dense + G1, MoE
DOMAINS = ("code", "law", "literature")
KEYS = (N.TRAIN_LOSS, N.VAL_PPL_AVG, *(N.val_ppl(d) for d in DOMAINS), N.TRAIN_LB_LOSS)
#: Relative tolerance. The pinned arithmetic repeats to the last bit; this leaves room only for
#: the float32 -> float64 round trip through the store. An eps of 1e-6 -> 1e-5 in RMSNorm moves
#: the baseline's final loss by 2e-6 of itself.
RTOL = 2e-7


def why_not_comparable() -> str | None:
    """Why this machine cannot compute the golden arithmetic, or None when it can."""
    if os.environ.get(OPT_OUT, "").lower() == "native":
        return f"{OPT_OUT}=native: the CPU's own kernels, not the pinned arithmetic"
    if platform.machine() not in X86:
        return f"a {platform.machine()} CPU: the golden numbers are x86-64 AVX2 arithmetic"
    if cpu_vendor() != "GenuineIntel":
        return f"a {cpu_vendor()} CPU: MKL's AVX2 branch, and so the golden arithmetic, is Intel's only"
    return None


def measured(results: Path) -> dict[str, dict[str, list[list[float]]]]:
    """Each golden row's metric histories in the micro store: key -> [[step, value], ...]."""
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    runs = {r.data.tags["row"]: r for r in client.search_runs([exp.experiment_id], "tags.kind = 'cell'")}
    out = {}
    for row in ROWS:
        histories = {}
        for key in KEYS:
            points = client.get_metric_history(runs[row].info.run_id, key)
            if points:
                histories[key] = [[m.step, m.value] for m in sorted(points, key=lambda m: m.step)]
        out[row] = histories
    return out


def differences(golden: dict, got: dict) -> list[str]:
    """One line per golden number the run does not reproduce within :data:`RTOL`."""
    lines = []
    for row, histories in golden.items():
        for key, points in histories.items():
            have = dict((int(s), v) for s, v in got.get(row, {}).get(key, []))
            for step, want in points:
                value = have.get(int(step))
                if value is None or not math.isclose(value, want, rel_tol=RTOL, abs_tol=0.0):
                    lines.append(f"{row} {key} step {int(step)}: golden {want!r}, now {value!r}")
        for key in set(got.get(row, {})) - set(histories):
            lines.append(f"{row} {key}: logged now, not in the golden file")
    return lines


def write_golden(got: dict) -> None:
    """Rewrite the golden file with ``got``; refused while the numbers moved but the version did not."""
    if GOLDEN.exists():
        old = json.loads(GOLDEN.read_text())
        if old["numbers"] == NUMBERS_VERSION and differences(old["rows"], got):
            pytest.fail(
                f"the numbers moved but NUMBERS_VERSION is still {NUMBERS_VERSION}: bump it in "
                "experiments/numerics.py first (every run key changes with it), then --update-golden"
            )
    rows = ",\n".join(
        f'  "{row}": {{\n'
        + ",\n".join(f'   "{key}": {json.dumps(points)}' for key, points in histories.items())
        + "\n  }"
        for row, histories in got.items()
    )
    head = f'{{\n "numbers": {NUMBERS_VERSION},\n "arithmetic": "{PINNED_ARITHMETIC}",\n'
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(f'{head} "rows": {{\n{rows}\n }}\n}}\n')  # a line per history: readable diffs


@pytest.mark.slow
def test_the_micro_cells_train_to_their_golden_numbers(micro: dict, request: pytest.FixtureRequest) -> None:
    reason = why_not_comparable()
    if reason:
        pytest.skip(reason)
    assert cpu_arithmetic() == PINNED_ARITHMETIC, (
        f"this process computes '{cpu_arithmetic()}', not the pinned '{PINNED_ARITHMETIC}': something "
        "ran a torch op before experiments.numerics.pin_cpu_arithmetic"
    )
    assert micro["code"] == 0
    got = measured(micro["results"])
    if request.config.getoption("--update-golden"):
        write_golden(got)
    golden = json.loads(GOLDEN.read_text())
    assert golden["numbers"] == NUMBERS_VERSION, (
        f"{GOLDEN} holds numbers version {golden['numbers']}, the code {NUMBERS_VERSION}: "
        "run pytest tests/test_golden.py --update-golden"
    )
    assert set(golden["rows"]) == set(ROWS)
    assert len(golden["rows"]["baseline"][N.TRAIN_LOSS]) == 8  # every step of the micro cells
    assert N.TRAIN_LB_LOSS in golden["rows"]["moe"]
    moved = differences(golden["rows"], got)
    assert not moved, (
        f"{len(moved)} golden numbers moved (a change meant to move them: bump NUMBERS_VERSION in "
        "experiments/numerics.py, then pytest tests/test_golden.py --update-golden):\n"
        + "\n".join(moved[:12])
    )


def test_a_process_pins_the_arithmetic_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for key in PINNED:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")  # the user's own choice stays
    pin_cpu_arithmetic()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"
    for key in PINNED:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(OPT_OUT, "native")
    pin_cpu_arithmetic()
    assert not any(key in os.environ for key in PINNED)
    monkeypatch.delenv(OPT_OUT)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # nothing to pin there
    pin_cpu_arithmetic()
    assert not any(key in os.environ for key in PINNED)


def test_the_arithmetic_a_run_records_names_what_mkl_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import experiments.numerics as numerics

    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.setattr(numerics, "cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_arithmetic().endswith(", mkl auto, AuthenticAMD")  # MKL ignores the branch there
    monkeypatch.setattr(numerics, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_arithmetic().endswith(", mkl AVX2, GenuineIntel")
    monkeypatch.delenv("MKL_CBWR")
    assert cpu_arithmetic().endswith(", mkl auto, GenuineIntel")
