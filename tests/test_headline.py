"""The README's headline figure (``sweep.report.headline``): drawn from the three-seed tables'
CSVs, each dot and whisker the table's own numbers, all or nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sweep.report import headline
from sweep.report.headline import PANELS, headline_figure, redraw_if_input, verdict, write_headline

TINY, LONG = PANELS[0][1], PANELS[1][1]


def _table(deltas: dict[str, tuple[float, float, float] | None], baseline_ppl: float) -> pd.DataFrame:
    rows = [("baseline", baseline_ppl, 0.0, np.nan, np.nan, 0.0)]
    for i, (row_id, d) in enumerate(deltas.items()):
        mean, low, high = d if d is not None else (np.nan,) * 3
        rows.append((row_id, baseline_ppl + mean, mean, low, high, -0.1 * (i + 1)))
    frame = pd.DataFrame(
        rows, columns=["id", "avg_ppl", "delta_avg_ppl", "delta_ci95_low", "delta_ci95_high", "paper_delta"]
    )
    frame["row"] = range(1, len(frame) + 1)
    frame["label"] = [f"Row {r}" for r in frame["id"]]
    frame["paper_avg_ppl"] = 6.026
    return frame


def test_the_verdict_is_where_the_interval_lies() -> None:
    assert verdict(-3.0, -0.1) == "better"
    assert verdict(0.2, 4.0) == "worse"
    assert verdict(-1.0, 1.0) == "noise"


def test_each_dot_and_whisker_is_the_tables_own_numbers() -> None:
    tiny = _table({"g1": (-88.0, -154.0, -22.0), "kv8": (17.0, -18.0, 52.0)}, 393.6)
    long = _table({"g1": (-4.9, -7.4, -2.4), "kv8": None}, 52.5)  # kv8 not run at cpu_long
    fig = headline_figure({TINY: tiny, LONG: long})
    tiny_ax, long_ax, paper_ax = fig.axes[:3]

    def bars(ax) -> list[tuple[float, float, float]]:  # (mean, low, high) per errorbar, top row first
        out = []
        for container in ax.containers:
            (x,), _ = container.lines[0].get_data()
            segment = container.lines[2][0].get_segments()[0]
            out.append((x, segment[0][0], segment[1][0]))
        return out

    assert np.array(bars(tiny_ax)) == pytest.approx(np.array([(-88.0, -154.0, -22.0), (17.0, -18.0, 52.0)]))
    assert np.array(bars(long_ax)) == pytest.approx(np.array([(-4.9, -7.4, -2.4)]))
    assert "not run" in [t.get_text() for t in long_ax.texts]
    paper = paper_ax.collections[0].get_offsets()
    assert list(paper[:, 0]) == pytest.approx([-0.1, -0.2])  # the paper's Δ of each row
    labels = dict(zip(tiny_ax.get_yticks(), (t.get_text() for t in tiny_ax.get_yticklabels())))
    g1_y = tiny_ax.containers[0].lines[0].get_data()[1][0]
    assert labels[g1_y] == "#2 Row g1" and labels[g1_y - 1] == "#3 Row kv8"  # the table's order, top down
    assert (
        "393.6" in tiny_ax.get_title() and "52.5" in long_ax.get_title() and "6.026" in paper_ax.get_title()
    )


def test_write_headline_writes_the_figure_and_its_manifest_or_nothing(tmp_path: Path) -> None:
    assert write_headline(tmp_path) is None  # no tiny table: nothing to draw
    assert list(tmp_path.iterdir()) == []
    _table({"g1": (-88.0, -154.0, -22.0)}, 393.6).to_csv(tmp_path / TINY, index=False)
    path = write_headline(tmp_path)
    assert path == tmp_path / "figures" / "headline.png" and path.read_bytes()[:4] == b"\x89PNG"
    manifest = json.loads((tmp_path / headline.MANIFEST).read_text())
    assert manifest["inputs"] == [TINY] and manifest["files"] == ["figures/headline.png"]


def test_only_the_panels_tables_redraw_it(tmp_path: Path) -> None:
    _table({"g1": (-88.0, -154.0, -22.0)}, 393.6).to_csv(tmp_path / TINY, index=False)
    redraw_if_input(tmp_path, tmp_path / "table2.csv")
    assert not (tmp_path / "figures").exists()
    redraw_if_input(tmp_path, tmp_path / LONG)
    assert (tmp_path / "figures" / "headline.png").is_file()


def test_the_committed_figure_reads_the_committed_tables() -> None:
    results = Path(__file__).resolve().parents[1] / "results"
    manifest = json.loads((results / headline.MANIFEST).read_text())
    assert sorted(manifest["inputs"]) == sorted([TINY, LONG])
    assert all((results / name).is_file() for name in manifest["inputs"])
