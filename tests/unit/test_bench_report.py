"""The benchmark harness's records: ``--write`` of some scenarios keeps the others'
results, and every scenario with ``data["curves"]`` gets its PNG (``bench.plot``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import plot, report
from bench.report import Check, Scenario

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HOST = {
    "nproc": 2, "ram_gib": 8.0, "python": "3.11.7 (CPython)", "kernel": "Linux 6",
    "load_1min_at_start": 0.5, "foreign_processes_at_start": 0,
}  # fmt: skip
CURVES = {
    "x_label": "agents",
    "y_label": "median latency (ms)",
    "series": {"drain": [[1, 12.0], [10, 30.5], [100, 210.0]],
               "floor (fresh spawn)": [[1, 10.0], [10, 22.0], [100, 160.0]]},
}  # fmt: skip


def scenario(name: str, figure: str, **data: Any) -> Scenario:
    return Scenario(
        name=name, title=f"Scenario {name}", setup=[f"{name} set up"],
        table=[("a figure", figure)], checks=[Check("a check", True, figure)],
        runs=[f"{name} ran"], data=data, blocks=[("a plan", f"{name} plan")],
    )  # fmt: skip


def test_a_scenario_with_curves_is_drawn_as_a_png(tmp_path: Path) -> None:
    drawn = report.plots([scenario("drain", "1", curves=CURVES), scenario("other", "2")], tmp_path)

    assert list(drawn) == ["drain"]
    png = drawn["drain"].read_bytes()
    assert drawn["drain"] == tmp_path / "drain.png"
    assert png.startswith(PNG_MAGIC)
    assert len(png) > 10_000  # axes, two lines, labels and a legend; a blank PNG is ~2 KB


@pytest.mark.parametrize(
    ("curves", "message"),
    [
        ([1, 2], 'scenario s: data["curves"] must be a dict, not list'),
        ({**CURVES, "x_label": ""}, "['x_label'] must be a non-empty string"),
        ({"x_label": "n", "y_label": "ms"}, "['series'] must be a non-empty dict"),
        ({**CURVES, "series": {"drain": []}}, "['series']['drain'] must be a non-empty list"),
        ({**CURVES, "series": {"drain": [[1, 2, 3]]}},
         "['series']['drain'][0] must be [x, y], two finite numbers, not [1, 2, 3]"),
        ({**CURVES, "series": {"drain": [[1, "fast"]]}}, "two finite numbers, not [1, 'fast']"),
        ({**CURVES, "series": {"drain": [[1, float("nan")]]}}, "two finite numbers"),
        ({**CURVES, "log_x": True, "series": {"drain": [[0, 1.0]]}}, "log_x needs every x above 0"),
    ],
    ids=["not-a-dict", "empty-label", "no-series", "empty-series", "three-values",
         "a-string", "nan", "log-of-zero"],
)  # fmt: skip
def test_malformed_curves_are_refused_saying_what_is_wrong(
    tmp_path: Path, curves: object, message: str
) -> None:
    with pytest.raises(plot.CurvesError) as refused:
        report.plots([scenario("s", "1", curves=curves)], tmp_path)
    assert message in str(refused.value)
    assert not list(tmp_path.iterdir())


def test_writing_some_scenarios_keeps_the_others_results_and_their_runs(tmp_path: Path) -> None:
    results_json, results_md = tmp_path / "results.json", tmp_path / "RESULTS.md"
    results_md.write_text(f"# Benchmarks\n\n{report.BEGIN}\nold\n{report.END}\n\n## Notes\nkept\n")
    first = "python -m bench --write"
    report.write(
        [scenario("drain", "10 ms", curves=CURVES), scenario("ledger", "1 ms")], first, HOST,
        False, results_json, results_md,
    )  # fmt: skip
    before = json.loads(results_json.read_text())["scenarios"]["ledger"]

    again = "python -m bench --scenario drain --write"
    report.write(
        [scenario("drain", "20 ms", curves=CURVES)], again, {**HOST, "nproc": 4}, False,
        results_json, results_md,
    )  # fmt: skip

    document = json.loads(results_json.read_text())
    assert list(document["scenarios"]) == ["drain", "ledger"]
    assert document["scenarios"]["ledger"] == before
    drain = document["scenarios"]["drain"]
    assert (drain["command"], drain["machine"]["nproc"], drain["plot"]) == (
        again, 4, "plots/drain.png"
    )  # fmt: skip
    assert drain["checks"][0]["detail"] == "20 ms"
    text = results_md.read_text()
    block = text.partition(report.BEGIN)[2].partition(report.END)[0]
    drain_part, _, ledger_part = block.partition("### Scenario ledger")
    assert f"- Command: `{again}`" in drain_part and "| a figure | 20 ms |" in drain_part
    assert "![drain: latency against scale, with the floor](plots/drain.png)" in drain_part
    assert "#### a plan\n\n```\ndrain plan\n```" in drain_part
    assert f"- Command: `{first}`" in ledger_part and "| a figure | 1 ms |" in ledger_part
    assert "old" not in block and "10 ms" not in block
    assert text.endswith(f"{report.END}\n\n## Notes\nkept\n")
    assert (tmp_path / "plots" / "drain.png").read_bytes().startswith(PNG_MAGIC)


def test_a_scenario_recorded_before_sections_keeps_its_section_and_its_run(
    tmp_path: Path,
) -> None:
    """Tried: results.json and RESULTS.md as written before each scenario carried its own
    command, date and machine, then one scenario written anew."""
    results_json, results_md = tmp_path / "results.json", tmp_path / "RESULTS.md"
    old_block = (
        "## Measured results\n\n- Command: `python -m bench`\n- Date: 2026-12-01 10:00 UTC\n"
        "- Machine: old\n\n### Drain\n\n- drained\n\n| measure | value |\n\n"
        "### Delete\n\n- deleted\n\n| measure | value |"
    )
    results_md.write_text(f"# Benchmarks\n\n{report.BEGIN}\n{old_block}\n{report.END}\n")
    results_json.write_text(json.dumps({
        "command": "python -m bench", "date": "2026-12-01T10:00:00+00:00", "machine": HOST,
        "quick": False, "scenarios": {"drain": {"data": {}, "checks": []},
                                      "delete": {"data": {}, "checks": []}},
    }))  # fmt: skip

    report.write([scenario("drain", "5 ms")], "python -m bench --scenario drain --write", HOST,
                 False, results_json, results_md)  # fmt: skip

    block = results_md.read_text().partition(report.BEGIN)[2].partition(report.END)[0]
    assert "### Scenario drain" in block and "### Drain" not in block
    delete = block.partition("### Delete")[2]
    assert delete.startswith("\n\n- Command: `python -m bench`\n- Date: 2026-12-01 10:00 UTC\n")
    assert "- deleted" in delete


@pytest.mark.parametrize("jobs", ["0", "-3", "four"])
def test_a_jobs_count_that_is_not_a_positive_number_is_refused_in_one_line(jobs: str) -> None:
    """Tried: ``--jobs 0``, a negative count and a word. Nothing runs: exit 2, the reason
    on stderr's last line, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--jobs", jobs, "--scenario", "drain"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert "--jobs" in last, last
