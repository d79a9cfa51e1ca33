"""Golden vectors of upstream caliban's wire format (tests/fixtures/caliban-wire)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "caliban-wire"
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json")
META = {"provenance.json"}


def _provenance() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "provenance.json").read_text())
    return data


def _data_files() -> list[Path]:
    return sorted(
        p
        for p in FIXTURES.rglob("*")
        if p.is_file() and p.suffix in DATA_SUFFIXES and p.name not in META
    )


def _jsonl(name: str) -> list[dict[str, Any]]:
    lines = (FIXTURES / name).read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_every_file_is_non_empty_and_parses() -> None:
    files = _data_files()
    assert files
    for path in files:
        text = path.read_text()
        assert text.strip(), path
        if path.suffix in (".jsonl", ".ndjson"):
            assert text.endswith("\n"), path
            for line in text.splitlines():
                assert isinstance(json.loads(line), dict), (path, line)
        else:
            assert isinstance(json.loads(text), dict), path


def test_annotated_lines_have_unique_names() -> None:
    for path in FIXTURES.rglob("*.jsonl"):
        records = _jsonl(str(path.relative_to(FIXTURES)))
        names = [r["name"] for r in records]
        assert len(names) == len(set(names)), path
        for r in records:
            assert set(r) >= {"name", "type", "json"}, (path, r)


def test_provenance_counts_match_files() -> None:
    counts: dict[str, int] = _provenance()["files"]
    listed = {str(p.relative_to(FIXTURES)) for p in _data_files()}
    assert set(counts) == listed
    for name, count in counts.items():
        text = (FIXTURES / name).read_text()
        expected = len(text.splitlines()) if name.endswith((".jsonl", ".ndjson")) else 1
        assert count == expected, name


def test_readme_commit_equals_provenance() -> None:
    commit = _provenance()["commit"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    readme = (FIXTURES / "README.md").read_text()
    assert set(re.findall(r"\b[0-9a-f]{40}\b", readme)) == {commit}


_TAG_FIELDS = {
    "CtlRequest": "kind",
    "CtlReply": "kind",
    "SupervisorError": "kind",
    "Endpoint": "scheme",
    "TurnEvent": "type",
    "AttachInbound": "type",
    "ContentBlock": "type",
}


def _tag(type_name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    assert isinstance(value, dict)
    if type_name in _TAG_FIELDS:
        return str(value[_TAG_FIELDS[type_name]])
    (key,) = value
    return str(key)


@pytest.mark.parametrize(
    ("type_name", "file"),
    [
        ("CtlRequest", "requests.jsonl"),
        ("CtlReply", "replies.jsonl"),
        ("SupervisorError", "errors.jsonl"),
        ("AgentStatus", "agent_status.jsonl"),
        ("Endpoint", "endpoints.jsonl"),
        ("TurnEvent", "turn_events.jsonl"),
        ("StopCondition", "stop_conditions.jsonl"),
        ("AttachInbound", "attach_inbound.jsonl"),
        ("ContentBlock", "content_blocks.jsonl"),
    ],
)
def test_every_upstream_variant_is_covered(type_name: str, file: str) -> None:
    expected = set(_provenance()["kinds"][type_name])
    assert expected
    found = {_tag(type_name, r["json"]) for r in _jsonl(file) if r["type"] == type_name}
    assert found == expected


def test_reply_errors_cover_every_supervisor_error() -> None:
    kinds = set(_provenance()["kinds"]["SupervisorError"])
    found = {
        r["json"]["error"]["kind"] for r in _jsonl("replies.jsonl") if r["json"]["kind"] == "error"
    }
    assert found == kinds


def test_preamble_wire_is_the_json_line() -> None:
    (rec,) = _jsonl("preamble.jsonl")
    assert rec["wire"].endswith("\n")
    assert json.loads(rec["wire"]) == rec["json"]
    assert set(rec["json"]) == {"bearer"}


def test_stdout_ndjson_is_a_run() -> None:
    events = [json.loads(line) for line in (FIXTURES / "stdout.ndjson").read_text().splitlines()]
    assert events[0]["type"] == "TurnStart"
    assert events[-1]["type"] == "RunEnd"
    assert "TurnEnd" in {e["type"] for e in events}


def _upstream() -> Path | None:
    env = os.environ.get("CALIBAN_UPSTREAM")
    if env:
        return Path(env)
    found = sorted(glob.glob("/work/.mirror/caliban-ai+caliban/repo"))
    return Path(found[0]) if found else None


@pytest.mark.slow
def test_regeneration_is_byte_identical(tmp_path: Path) -> None:
    generator = os.environ.get("CALIBAN_WIRE_GENERATOR")
    upstream = _upstream()
    if not generator or not Path(generator).is_file():
        pytest.skip("CALIBAN_WIRE_GENERATOR (the vector generator, kept outside this repo) not set")
    if upstream is None or not upstream.exists():
        pytest.skip("no local upstream caliban git dir (set CALIBAN_UPSTREAM)")
    if shutil.which("cargo") is None:
        pytest.skip("cargo not on PATH")
    commit = _provenance()["commit"]
    out = tmp_path / "out"
    subprocess.run(
        [generator, "--upstream", str(upstream), "--commit", commit, "--out", str(out)],
        check=True,
        timeout=1800,
    )
    for path in _data_files():
        rel = path.relative_to(FIXTURES)
        assert (out / rel).read_bytes() == path.read_bytes(), rel
    regenerated = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert regenerated - META == {str(p.relative_to(FIXTURES)) for p in _data_files()}
