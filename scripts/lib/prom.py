"""prom.py - the scripts' one reader of a /metrics page (Prometheus' text format).

usage: python3 prom.py SOURCE NAME [LABEL=VALUE ...]
       prints the sum of NAME's samples whose labels include every LABEL=VALUE given;
       SOURCE is a URL (http:// or https://) or a file. Exits 1, saying why, when SOURCE
       cannot be read.

From Python (a script's inline code, with this directory on PYTHONPATH):
    import prom
    text = prom.page(SOURCE)
    prom.total(text, "kinference_decisions_total", reason="cached_prefix")
    prom.by_label(text, "kinference_decisions_total", "reason")  # {"cached_prefix": 12.0, ...}

A sample's name must equal NAME (a histogram's buckets are NAME_bucket), so one metric's name
being the start of another's does not add the other in. Label values are read with their
escapes (backslash, quote, newline), so a value holding a quote or a comma does not cut a
sample short. Comments (# HELP, # TYPE, # EOF) are skipped; a line that is not a sample is an
error, not a zero.

>>> text = '''# HELP x_total Things.
... # TYPE x_total counter
... x_total{kind="a",pool="p"} 2
... x_total{kind="b",pool="p"} 3.5
... x_total{kind="a",pool="q \\\\"quoted\\\\", too"} 1
... x_total_created{kind="a"} 1e9
... up 1
... '''
>>> total(text, "x_total")
6.5
>>> total(text, "x_total", kind="a")
3.0
>>> by_label(text, "x_total", "pool")
{'p': 5.5, 'q "quoted", too': 1.0}
>>> total(text, "up"), total(text, "missing")
(1.0, 0.0)
"""
import re
import sys
import urllib.request

# name, then optional {labels}, then the value (and an optional timestamp, ignored).
_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|\})')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def page(source, timeout=5):
    """The text at SOURCE: a URL (http:// or https://) or a file's path."""
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=timeout) as r:
            return r.read().decode()
    with open(source) as f:
        return f.read()


def _labels(block, line):
    out, at = {}, 1
    while True:
        if block[at:].strip() == "}":  # an empty set, or a comma before the brace
            return out
        m = _LABEL.match(block, at)
        if not m:
            raise ValueError(f"not a label set: {line!r}")
        out[m.group(1)] = re.sub(r"\\.", lambda e: _UNESCAPE.get(e.group(0), e.group(0)),
                                 m.group(2))
        at = m.end()
        if m.group(3) == "}":
            if block[at:].strip():
                raise ValueError(f"not a label set: {line!r}")
            return out


def samples(text):
    """Every sample of the page: (name, labels as a dict, value)."""
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise ValueError(f"not a sample: {line!r}")
        labels = _labels(m.group(2), line) if m.group(2) else {}
        yield m.group(1), labels, float(m.group(3))


def _matching(text, name, match):
    for n, labels, value in samples(text):
        if n == name and all(labels.get(k) == v for k, v in match.items()):
            yield labels, value


def total(text, name, **match):
    """The sum of NAME's samples whose labels include MATCH (0.0 when there are none)."""
    return sum((v for _, v in _matching(text, name, match)), 0.0)


def by_label(text, name, label, **match):
    """NAME's samples that have LABEL (and include MATCH), summed by LABEL's value."""
    out = {}
    for labels, v in _matching(text, name, match):
        if label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + v
    return out


def main(argv):
    if len(argv) < 2 or any("=" not in a for a in argv[2:]):
        sys.exit(__doc__.split("\n\n")[0])
    source, name = argv[0], argv[1]
    match = dict(a.split("=", 1) for a in argv[2:])
    try:
        text = page(source)
    except OSError as e:
        sys.exit(f"prom.py: cannot read {source}: {e}")
    print(repr(total(text, name, **match)))


if __name__ == "__main__":
    main(sys.argv[1:])
