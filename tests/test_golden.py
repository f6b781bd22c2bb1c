"""Golden numbers: the micro sweep's dense, gated and MoE cells train to the losses and validation
PPLs in ``tests/golden/micro.json``, so no change moves a number unseen (issue 26).

The cells are the session's micro sweep (``conftest.MICRO``: the real corpus, the CLI's sequential
path, MLflow), so the test pins what a user's sweep records, not a side path. The file keeps the
numbers of each pinned CPU arithmetic (:mod:`experiments.numerics`: Intel CPUs with AVX-512, and
without; every CPU of a class computes the same bits) and compares with this machine's; elsewhere
(AMD, ARM, ``GATED_ATTN_CPU_ARITH=native``) the test says why it cannot compare and skips.

A change meant to move the numbers: bump ``experiments.numerics.NUMBERS_VERSION`` (every run key
changes with it, so sweeps retrain instead of reusing runs of the old numbers), then ``make
golden`` rewrites the file for both arithmetics (``pytest tests/test_golden.py --update-golden``,
once as the machine pins and once with ``MKL_CBWR=AVX2``); commit both with the reason.
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
    PINNED_ARITHMETICS,
    X86,
    cpu_arithmetic,
    cpu_vendor,
    mkl_branch,
    pin_cpu_arithmetic,
)

GOLDEN = Path(__file__).with_name("golden") / "micro.json"
ROWS = ("baseline", "sdpa_elementwise", "moe")  # dense, dense + G1, MoE
DOMAINS = ("code", "law", "literature")
KEYS = (N.TRAIN_LOSS, N.VAL_PPL_AVG, *(N.val_ppl(d) for d in DOMAINS), N.TRAIN_LB_LOSS)
#: Relative tolerance. The pinned arithmetic repeats to the last bit; this leaves room only for
#: the float32 -> float64 round trip through the store. The final RMSNorm's eps at 1e-5 instead of
#: 1e-6 moves the baseline's first loss by 1.5e-5 of itself.
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


def write_golden(arithmetic: str, got: dict) -> None:
    """Store ``got`` as ``arithmetic``'s golden numbers; refused while they moved but the numbers
    version did not. The other arithmetic's numbers stay only if they are of this version."""
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"numbers": None, "arithmetics": {}}
    if old["numbers"] == NUMBERS_VERSION and differences(old["arithmetics"].get(arithmetic, got), got):
        pytest.fail(
            f"the numbers moved but NUMBERS_VERSION is still {NUMBERS_VERSION}: bump it in "
            "experiments/numerics.py first (every run key changes with it), then make golden"
        )
    kept = old["arithmetics"] if old["numbers"] == NUMBERS_VERSION else {}
    sections = {**kept, arithmetic: got}

    def section(rows: dict) -> str:  # a line per history: readable diffs
        return ",\n".join(
            f'   "{row}": {{\n'
            + ",\n".join(f'    "{key}": {json.dumps(points)}' for key, points in histories.items())
            + "\n   }"
            for row, histories in rows.items()
        )

    body = ",\n".join(f'  "{name}": {{\n{section(rows)}\n  }}' for name, rows in sorted(sections.items()))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(f'{{\n "numbers": {NUMBERS_VERSION},\n "arithmetics": {{\n{body}\n }}\n}}\n')


def test_the_micro_cells_train_to_their_golden_numbers(micro: dict, request: pytest.FixtureRequest) -> None:
    reason = why_not_comparable()
    if reason:
        pytest.skip(reason)
    arithmetic = cpu_arithmetic()
    assert arithmetic in PINNED_ARITHMETICS, (
        f"this process computes '{arithmetic}', none of the pinned {PINNED_ARITHMETICS}: something "
        "ran a torch op before experiments.numerics.pin_cpu_arithmetic, or MKL_CBWR names another branch"
    )
    assert micro["code"] == 0
    got = measured(micro["results"])
    if request.config.getoption("--update-golden"):
        write_golden(arithmetic, got)
    golden = json.loads(GOLDEN.read_text())
    assert golden["numbers"] == NUMBERS_VERSION, (
        f"{GOLDEN} holds numbers version {golden['numbers']}, the code {NUMBERS_VERSION}: run make golden"
    )
    rows = golden["arithmetics"].get(arithmetic)
    assert rows is not None, f"{GOLDEN} has no numbers for '{arithmetic}': make golden on such a machine"
    assert set(rows) == set(ROWS)
    assert len(rows["baseline"][N.TRAIN_LOSS]) == 8  # every step of the micro cells
    assert N.TRAIN_LB_LOSS in rows["moe"]
    moved = differences(rows, got)
    assert not moved, (
        f"{len(moved)} golden numbers moved (a change meant to move them: bump NUMBERS_VERSION in "
        "experiments/numerics.py, then pytest tests/test_golden.py --update-golden):\n"
        + "\n".join(moved[:12])
    )


PINNED = ("ATEN_CPU_CAPABILITY", "MKL_CBWR")


def test_a_process_pins_the_arithmetic_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    import experiments.numerics as numerics

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for key in PINNED:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")  # the user's own choice stays
    pin_cpu_arithmetic()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["MKL_CBWR"] == "COMPATIBLE"
    monkeypatch.delenv("MKL_CBWR")
    flags = "fpu sse2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl avx512_vnni"
    monkeypatch.setattr(numerics, "cpu_info", lambda: {"vendor_id": "GenuineIntel", "flags": flags})
    pin_cpu_arithmetic()
    assert os.environ["MKL_CBWR"] == "AVX512"
    monkeypatch.delenv("MKL_CBWR")
    monkeypatch.setattr(numerics, "cpu_info", lambda: {"flags": flags.replace(" avx512bw", "")})
    assert mkl_branch() == "AVX2"  # a partial AVX-512 (Xeon Phi's) is not MKL's AVX-512 branch
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

    monkeypatch.setenv("MKL_CBWR", "AVX512")
    monkeypatch.setattr(numerics, "cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_arithmetic().endswith(", mkl auto, AuthenticAMD")  # MKL ignores the branch there
    monkeypatch.setattr(numerics, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_arithmetic().endswith(", mkl AVX512, GenuineIntel")
    monkeypatch.setenv("MKL_CBWR", "avx2,strict")
    assert cpu_arithmetic().endswith(", mkl AVX2, GenuineIntel")
    monkeypatch.delenv("MKL_CBWR")
    assert cpu_arithmetic().endswith(", mkl auto, GenuineIntel")
