"""cells.py - what router-latency.sh measured in one cell, read from a line of its cells.jsonl.

A cell is one wrk run against one target: {"target", "round", "pair", "cell", "conns",
"router_ticks", "router_sys_ticks" (the kernel's part of router_ticks), "sim_ticks", "clk_tck",
"load", "wrk": {"requests", "duration_us", "errors_*", "p50_us", ...}}. router-latency.sh writes them; it and router-ab.sh read them here.

>>> r = {"router_ticks": 60, "sim_ticks": 90, "clk_tck": 100,
...      "wrk": {"requests": 30000, "duration_us": 6000000, "errors_connect": 0,
...              "errors_read": 1, "errors_write": 0, "errors_status": 2, "errors_timeout": 0}}
>>> rps(r)
5000.0
>>> cpu_ms(r)
0.02
>>> cpu_ms(r, "sim_ticks")
0.03
>>> errors(r)
3
>>> cpu_ms({"router_ticks": 0, "clk_tck": 100, "wrk": {"requests": 0}}) is None
True
"""


def rps(r):
    """Requests per second over the cell."""
    return r["wrk"]["requests"] / (r["wrk"]["duration_us"] / 1e6)


def errors(r):
    """wrk's errors of every kind."""
    w = r["wrk"]
    return sum(w[k] for k in ("errors_connect", "errors_read", "errors_write", "errors_status", "errors_timeout"))


def cpu_ms(r, key="router_ticks"):
    """CPU per request in milliseconds, of the router (or `key`'s processes); None without requests."""
    n = r["wrk"]["requests"]
    return 1000.0 * r[key] / r["clk_tck"] / n if n else None
