"""Prometheus text exposition read back: parse a scrape, look one sample up."""

from __future__ import annotations

import re
import urllib.request

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Text exposition -> {(name, labels): value}; fails on a malformed line."""
    out = {}
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        match = _SAMPLE.match(line)
        assert match, f"malformed exposition line: {line!r}"
        name, _, labels, value = match.groups()
        pairs = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels or ""))
        out[(name, pairs)] = float(value)
    assert types, "no # TYPE lines"
    return out


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=")  # the text exposition
        return parse(response.read().decode())


def value(samples, metric, **labels) -> float:
    return samples.get((metric, frozenset(labels.items())), 0.0)
