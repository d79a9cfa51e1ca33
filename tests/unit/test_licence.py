"""caliban-drain is Apache-2.0: the licence text at the root, the package metadata saying
so, and no file of what ships (the packages, ``deploy/``, ``scripts/``) under another
project's copyleft licence. The upstream files kept as test data
(``tests/fixtures/upstream``, each licence beside them, their README saying which) are
the only ones that carry caliban-operator's Affero GPL (the wheel's own carrying of
``LICENSE`` is ``tests/integration/test_packaging.py``'s). The samples upstream caliban's
types wrote (``tests/fixtures/formats``) are our data, not its source; their README names
its licence too, to say why none of its source is here."""

from __future__ import annotations

import hashlib
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
"""Of the Apache License 2.0 as the ASF publishes it (``LICENSE-2.0.txt``), and as Debian
ships it (``/usr/share/common-licenses/Apache-2.0``)."""
SHIPPED = ("orchestrator", "worker_agent", "deploy", "scripts")
COPYLEFT_MARKS = ("GNU " + "Affero", "AG" + "PL")  # in pieces: this file is no match
UPSTREAM_TEST_DATA = (
    "tests/fixtures/upstream/",
    "tests/fixtures/formats/README.md",
    "tests/fixtures/caliban-wire/README.md",
)


def tracked() -> list[str]:
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return [name for name in listed.splitlines() if (REPO / name).is_file()]


def marked(name: str) -> bool:
    text = (REPO / name).read_text(encoding="utf-8", errors="replace")
    return any(mark in text for mark in COPYLEFT_MARKS)


def test_the_licence_at_the_root_is_the_apache_license_2_0() -> None:
    text = (REPO / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    assert b"Apache License\n                           Version 2.0, January 2004" in text


def test_the_package_metadata_says_apache_2_0_and_names_the_licence_file() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert (project["license"], project["license-files"]) == ("Apache-2.0", ["LICENSE"])


def test_nothing_that_ships_carries_a_copyleft_licence() -> None:
    """What ``grep -rlE`` of the two marks over those folders finds: nothing."""
    files = [n for n in tracked() if n.startswith(tuple(f"{d}/" for d in SHIPPED))]
    assert len(files) > 100
    assert [n for n in files if marked(n)] == []


def test_only_the_upstream_test_data_and_its_readme_name_the_affero_gpl() -> None:
    found = sorted(n for n in tracked() if marked(n))
    assert found == [
        "tests/fixtures/caliban-wire/README.md",
        "tests/fixtures/formats/README.md",
        "tests/fixtures/upstream/README.md",
        "tests/fixtures/upstream/caliban-operator/LICENSE",
    ]
    assert all(n.startswith(UPSTREAM_TEST_DATA) for n in found)
