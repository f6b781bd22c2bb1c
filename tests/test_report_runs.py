"""How the report recognises a run's gate (``sweep.report.runs.gate_signature``): the figures pick
their runs by it, so a run logged before a gate field existed must still be found."""

from __future__ import annotations

from experiments.config import GateConfig, to_dict
from sweep.report.figures import BASELINE, SDPA_ELEMENTWISE
from sweep.report.runs import gate_signature
from sweep.store import flatten


def _logged(gate: GateConfig | None, leave_out: tuple[str, ...] = ()) -> dict[str, str]:
    """Params as MLflow holds them (strings), less ``leave_out`` (fields a run never logged)."""
    params = flatten({"model": {"gate": to_dict(gate)}})
    return {k: str(v) for k, v in params.items() if k.removeprefix("model.gate.") not in leave_out}


def test_a_g1_run_logged_before_static_init_existed_is_still_g1() -> None:
    old = _logged(GateConfig(position="sdpa"), leave_out=("static_init",))
    assert "model.gate.static_init" not in old and any(k.startswith("model.gate.") for k in old)
    assert gate_signature(old) == gate_signature(_logged(GateConfig(position="sdpa"))) == SDPA_ELEMENTWISE


def test_a_gate_that_differs_in_a_field_is_another_gate() -> None:
    constant = GateConfig(position="sdpa", input_dependent=False)
    scaled = GateConfig(position="sdpa", input_dependent=False, static_init=4.0)
    assert gate_signature(_logged(scaled)) != gate_signature(_logged(constant)) != SDPA_ELEMENTWISE
    assert gate_signature(_logged(GateConfig(position="dense"))) != SDPA_ELEMENTWISE
    assert gate_signature(_logged(None)) == BASELINE == "none"
