"""Reading the components' ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP (on
127.0.0.1 only), for the metrics and probe tests."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""A scrape: (series name, its labels) → value."""


def fetch(url: str) -> tuple[int, str]:
    """The status and body ``url`` answers; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> Samples:
    status, text = fetch(url)
    assert status == 200, f"{url} answered {status}"
    return parse(text)


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name{labels}``; 0 when absent (a labelled series not yet touched)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
