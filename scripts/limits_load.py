"""limits_load.py - the hostile and excessive clients of scripts/limits.sh (issue 16).

usage: python3 limits_load.py PHASE DATA_ADDR ADMIN_ADDR ROUTER_PID [key=value ...]

Phases (each prints one JSON object on stdout):
  stalled  N conns send half a request head and stall; normal requests are served meanwhile;
           the router's descriptors (/proc/PID/fd) before, with the stalled conns open, and
           after they were all closed; how long the router took to close them.
  idle     N conns each make one kept-alive request (8 at a time) and stay open: the router's
           RSS before and with them open (/proc/PID/status VmRSS).
  burst    latency of completions unloaded (1 at a time), at the fleet's capacity (CAP at
           once), and in bursts of BURST simultaneous requests every WAVE_MS: statuses, and
           the latency of admitted and of shed requests.
"""

import asyncio
import json
import os
import statistics
import sys
import time


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def split(addr):
    host, port = addr.rsplit(":", 1)
    return host, int(port)


async def read_response(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    body = await reader.readexactly(n) if n else b""
    return status, headers, body


def request_bytes(method, path, body=b"", keep_alive=True):
    conn = "keep-alive" if keep_alive else "close"
    return (
        f"{method} {path} HTTP/1.1\r\nhost: router\r\nconnection: {conn}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


def completion(model, i, max_tokens):
    return json.dumps(
        {"model": model, "prompt": f"Request {i}: say something about routers.", "max_tokens": max_tokens}
    ).encode()


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000, 2)


async def one(addr, method, path, body=b""):
    host, port = split(addr)
    r, w = await asyncio.open_connection(host, port)
    t0 = time.monotonic()
    w.write(request_bytes(method, path, body, keep_alive=False))
    await w.drain()
    status, headers, payload = await read_response(r)
    dt = time.monotonic() - t0
    w.close()
    return status, headers, payload, dt


async def stalled(data, admin, pid, n=3000, **_):
    n = int(n)
    host, port = split(data)
    before = fds(pid)
    conns = []
    for i in range(n):
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-le")
        conns.append((r, w))
        if i % 200 == 199:
            await w.drain()
    opened = time.monotonic()
    await asyncio.sleep(0.5)  # let the router accept them all before counting
    during = fds(pid)
    # Normal clients meanwhile, one after another.
    lat, ok = [], 0
    for i in range(50):
        status, _, _, dt = await one(data, "GET", "/health")
        ok += status == 200
        lat.append(dt)

    async def closed(r):
        try:
            data = await r.read(64)
            return data == b""
        except ConnectionError:
            return True

    results = await asyncio.gather(*(closed(r) for r, _ in conns))
    all_closed = time.monotonic()
    await asyncio.sleep(0.5)
    after = fds(pid)
    for _, w in conns:
        w.close()
    return {
        "stalled": n,
        "closed_by_router": sum(results),
        "router_fds_before": before,
        "router_fds_stalled_open": during,
        "router_fds_after": after,
        "seconds_from_last_open_to_all_closed": round(all_closed - opened, 2),
        "normal_requests_ok": ok,
        "normal_p50_ms": pct(lat, 50),
        "normal_p99_ms": pct(lat, 99),
    }


async def idle(data, admin, pid, n=6000, **_):
    n = int(n)
    host, port = split(data)
    before = rss_mib(pid)
    fds_before = fds(pid)
    conns = []
    # Below the gate (--max-in-flight), so that every connection's request is served.
    sem = asyncio.Semaphore(8)

    async def open_one():
        async with sem:
            r, w = await asyncio.open_connection(host, port)
            w.write(request_bytes("GET", "/health"))
            await w.drain()
            status, _, _ = await read_response(r)
            conns.append((r, w))
            return status

    statuses = await asyncio.gather(*(open_one() for _ in range(n)))
    await asyncio.sleep(1)
    with_open = rss_mib(pid)
    fds_open = fds(pid)
    for _, w in conns:
        w.close()
    return {
        "connections": n,
        "requests_ok": sum(s == 200 for s in statuses),
        "router_rss_mib_before": round(before, 1),
        "router_rss_mib_with_idle_open": round(with_open, 1),
        "per_connection_kib": round((with_open - before) * 1024 / n, 1),
        "router_fds_before": fds_before,
        "router_fds_with_idle_open": fds_open,
    }


async def burst(data, admin, pid, model="tiny", cap=16, burst=160, waves=20, wave_ms=1000,
                max_tokens=16, seq=40, **_):
    cap, burst, waves, wave_ms = int(cap), int(burst), int(waves), int(wave_ms)
    max_tokens, seq = int(max_tokens), int(seq)
    path = "/v1/completions"
    out = {"capacity": cap, "burst": burst, "waves": waves, "wave_ms": wave_ms}

    # Unloaded: one at a time.
    lat = []
    for i in range(seq):
        s, _, _, dt = await one(data, "POST", path, completion(model, i, max_tokens))
        assert s == 200, s
        lat.append(dt)
    out["unloaded_p50_ms"], out["unloaded_p99_ms"] = pct(lat, 50), pct(lat, 99)

    # At capacity: CAP at once, repeated.
    lat = []
    for k in range(max(1, seq // 4)):
        res = await asyncio.gather(
            *(one(data, "POST", path, completion(model, 1000 * k + i, max_tokens)) for i in range(cap))
        )
        for s, _, _, dt in res:
            assert s == 200, s
            lat.append(dt)
    out["at_capacity_p50_ms"], out["at_capacity_p99_ms"] = pct(lat, 50), pct(lat, 99)

    # Bursts of BURST at once.
    admitted, shed, statuses, retry_after = [], [], {}, set()

    async def timed(i):
        try:
            s, h, _, dt = await one(data, "POST", path, completion(model, i, max_tokens))
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
            return
        statuses[s] = statuses.get(s, 0) + 1
        if s == 200:
            admitted.append(dt)
        else:
            shed.append(dt)
            retry_after.add(h.get("retry-after"))

    tasks = []
    t0 = time.monotonic()
    for wv in range(waves):
        tasks += [asyncio.create_task(timed(100000 * (wv + 1) + i)) for i in range(burst)]
        await asyncio.sleep(max(0, t0 + (wv + 1) * wave_ms / 1000 - time.monotonic()))
    await asyncio.gather(*tasks)
    out["burst_statuses"] = {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))}
    out["burst_retry_after"] = sorted(str(x) for x in retry_after)
    out["admitted_p50_ms"], out["admitted_p99_ms"] = pct(admitted, 50), pct(admitted, 99)
    out["shed_p50_ms"], out["shed_p99_ms"] = pct(shed, 50), pct(shed, 99)
    if out["admitted_p50_ms"] and out["at_capacity_p50_ms"]:
        out["admitted_p50_vs_at_capacity"] = round(out["admitted_p50_ms"] / out["at_capacity_p50_ms"], 2)
        out["admitted_p50_vs_unloaded"] = round(out["admitted_p50_ms"] / out["unloaded_p50_ms"], 2)
    return out


def main():
    phase, data, admin, pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    kw = dict(a.split("=", 1) for a in sys.argv[5:])
    fn = {"stalled": stalled, "idle": idle, "burst": burst}[phase]
    print(json.dumps(asyncio.run(fn(data, admin, pid, **kw))))


if __name__ == "__main__":
    main()
