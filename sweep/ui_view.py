"""How the MLflow UI opens on a grid's runs (``make ui``).

MLflow 3's UI shows a new experiment as GenAI work (traces, "No data available") unless the
experiment is tagged as model training, and its run table's default columns show no metric. So
every experiment the harness creates carries two tags:

- ``mlflow.experimentKind = custom_model_development``: the UI's "Model training" view, whose
  "Runs" tab lists the runs;
- ``mlflow.sharedViewState.<VIEW_KEY>``: a saved view of that tab (the JSON the UI's "Share"
  button saves): the cell runs only (``tags.kind = 'cell'``), sorted by validation Avg PPL, with
  the columns of a table: Avg PPL, its domains, the gate, the seed, the status.

:func:`runs_url` is the address that opens that view.
"""

from __future__ import annotations

import json
from urllib.parse import quote

from experiments import names as N
from experiments.names import Kind

KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
VIEW_KEY = "table"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"

#: The run table's columns, as the UI names them (``<type>.`<key>```).
COLUMNS = (
    f"metrics.`{N.VAL_PPL_AVG}`",
    f"metrics.`{N.GATE_SCORE_MEAN}`",
    f"metrics.`{N.F_ATTN}`",
    "params.`model.gate.position`",
    "params.`model.gate.granularity`",
    "params.`model.gate.activation`",
    "params.`model.gate.sharing`",
    "tags.`row`",
    "tags.`seed`",
    "tags.`status`",
    "tags.`grid`",
)


def view_state() -> dict[str, object]:
    """The saved view: cell runs only, best Avg PPL first, :data:`COLUMNS` shown."""
    return {
        "searchFilter": f"tags.kind = '{Kind.CELL}'",
        "orderByKey": f"metrics.`{N.VAL_PPL_AVG}`",
        "orderByAsc": True,
        "selectedColumns": list(COLUMNS),
    }


def experiment_tags() -> dict[str, str]:
    """The tags that make the UI open an experiment on its runs (module docstring)."""
    return {KIND_TAG: MODEL_TRAINING, VIEW_TAG: json.dumps(view_state())}


def runs_url(base: str, experiment_id: str) -> str:
    """The address of the experiment's runs with the saved view, e.g.
    ``http://127.0.0.1:5000/#/experiments/3/runs?viewStateShareKey=table``."""
    query = f"viewStateShareKey={quote(VIEW_KEY)}&workflowType=machine_learning"
    return f"{base.rstrip('/')}/#/experiments/{quote(str(experiment_id))}/runs?{query}"
