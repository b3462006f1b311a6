"""A server's Prometheus metrics read with ``prometheus_client``'s own text parser (Triton's
``/metrics``, the OpenAI port's copy of it): the launcher, the benchmarks and the tests read
series through here, never by splitting lines."""

from __future__ import annotations

import urllib.request
from typing import Iterable, Optional

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def parse_samples(text: str) -> list[Sample]:
    """Every sample of an exposition text (a histogram's ``_bucket``/``_sum``/``_count`` too)."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def family_types(text: str) -> dict[str, str]:
    """family name -> its declared type ("gauge", "counter", "histogram", "unknown" ...)."""
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def scrape(url: str, timeout: float = 10.0) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_samples(response.read().decode())


def matching(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """The samples of series ``name`` whose labels include ``labels``."""
    return [
        s
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def sample_value(samples: Iterable[Sample], name: str, **labels: str) -> Optional[float]:
    """The value of the first sample of ``name`` with ``labels``; None when there is none."""
    found = matching(samples, name, **labels)
    return float(found[0].value) if found else None
