"""Kubernetes names as the API server validates them, in one module both halves use:
a subdomain of empty labels (``a..b``) is refused everywhere a task name is checked."""

from __future__ import annotations

import pytest

from worker_agent.contract import TaskNameError, check_task_name
from worker_agent.k8s_names import is_dns_label, is_dns_subdomain


@pytest.mark.parametrize(
    ("name", "label", "subdomain"),
    [
        ("a", True, True),
        ("team-a", True, True),
        ("0abc9", True, True),
        ("a" * 63, True, True),
        ("a" * 64, False, True),
        (".".join(["a" * 63] * 3) + "." + "a" * 61, False, True),  # 253 characters
        (".".join(["a" * 63] * 3) + "." + "a" * 62, False, False),  # 254
        ("a.b", False, True),
        ("a..b", False, False),
        (".a", False, False),
        ("a.", False, False),
        ("-a", False, False),
        ("a-", False, False),
        ("a.-b", False, False),
        ("A", False, False),
        ("a_b", False, False),
        ("", False, False),
        (None, False, False),
        (7, False, False),
    ],
    ids=repr,
)
def test_names_are_judged_as_the_api_server_judges_them(
    name: object, label: bool, subdomain: bool
) -> None:
    assert is_dns_label(name) is label
    assert is_dns_subdomain(name) is subdomain


@pytest.mark.parametrize("name", ["a..b", "a.-b", "a.", ".a"])
def test_a_task_name_of_an_empty_or_bad_label_is_refused(name: str) -> None:
    with pytest.raises(TaskNameError, match="is not a DNS-1123 subdomain"):
        check_task_name("team-a", name)
