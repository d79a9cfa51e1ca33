"""A scenario's latency against scale, with its floor, as a PNG (matplotlib, Agg).

The contract a scenario meets to be drawn: ``Scenario.data["curves"]`` is

    {"x_label": str, "y_label": str, "series": {name: [[x, y], ...], ...}}

with an optional ``"log_x": bool``. x is the scale (agents, tasks, checkpoints), y the
latency; a series whose name contains ``floor`` is the floor and is drawn dashed, the
others solid, every point marked. ``curves`` validates that shape and says what is wrong
with one that is not; ``draw`` writes the PNG. Nothing here measures or judges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CurvesError(ValueError):
    """``data["curves"]`` is not the shape this module draws."""


@dataclass(frozen=True)
class Curves:
    x_label: str
    y_label: str
    series: dict[str, list[tuple[float, float]]]
    log_x: bool = False


def curves(scenario: str, raw: object) -> Curves:
    """``raw`` (a scenario's ``data["curves"]``) checked and typed, or ``CurvesError``
    naming the scenario and what is wrong."""
    where = f'scenario {scenario}: data["curves"]'
    if not isinstance(raw, dict):
        raise CurvesError(f"{where} must be a dict, not {type(raw).__name__}")
    for key in ("x_label", "y_label"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise CurvesError(f"{where}[{key!r}] must be a non-empty string")
    series = raw.get("series")
    if not isinstance(series, dict) or not series:
        raise CurvesError(f"{where}['series'] must be a non-empty dict of name → [[x, y], ...]")
    typed: dict[str, list[tuple[float, float]]] = {}
    for name, points in series.items():
        if not isinstance(points, list) or not points:
            raise CurvesError(f"{where}['series'][{name!r}] must be a non-empty list of [x, y]")
        typed[str(name)] = [_point(f"{where}['series'][{name!r}][{i}]", p) for i, p in
                            enumerate(points)]  # fmt: skip
    log_x = raw.get("log_x", False)
    if not isinstance(log_x, bool):
        raise CurvesError(f"{where}['log_x'] must be true or false")
    if log_x and any(x <= 0 for points in typed.values() for x, _ in points):
        raise CurvesError(f"{where}: log_x needs every x above 0")
    return Curves(raw["x_label"], raw["y_label"], typed, log_x)


def _point(where: str, point: Any) -> tuple[float, float]:
    if (
        not isinstance(point, list | tuple)
        or len(point) != 2
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in point)
        or not all(math.isfinite(v) for v in point)
    ):
        raise CurvesError(f"{where} must be [x, y], two finite numbers, not {point!r}")
    return float(point[0]), float(point[1])


def draw(title: str, drawn: Curves, path: Path) -> Path:
    """The PNG of ``drawn`` at ``path`` (its directory created)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 5), dpi=100)
    try:
        for name, points in drawn.series.items():
            xs, ys = zip(*sorted(points), strict=True)
            style = "--" if "floor" in name.lower() else "-"
            axes.plot(xs, ys, style, marker="o", label=name)
        if drawn.log_x:
            axes.set_xscale("log")
        axes.set_xlabel(drawn.x_label)
        axes.set_ylabel(drawn.y_label)
        axes.set_ylim(bottom=0)
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png")
    finally:
        pyplot.close(figure)
    return path
