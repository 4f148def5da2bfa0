"""Reading cgpud's Prometheus endpoint in tests: a free port to serve it on,
one scrape parsed by the official client's parser, one sample by labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(samples: Samples, name: str, default: float | None = None, **labels: str) -> float:
    """The one sample of `name` with these labels; `default` when there is
    none and one is given (a counter whose labels never occurred)."""
    found = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    if not found and default is not None:
        return default
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]
