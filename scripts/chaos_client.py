"""chaos_client.py - the load, the samplers and the checks of scripts/chaos.sh (issue 16).

Standard library only. Subcommands:

  load URL OUT key=value...     multi-turn streamed chat load through the router until
                                `duration` s pass; one JSON line per request in OUT
  sample PIDFILE OUT            every second, the router's VmRSS and descriptors (the router's
                                pid is read from PIDFILE each time: it changes on restarts)
  settle ADMIN FLEET OUT        after the chaos: compares, per replica, the router's index
                                (/debug/replicas) with the replica's own cache (/debug/cache),
                                sending a request straight to a replica whose last event batch
                                the router has not applied yet (a dropped live batch shows as a
                                gap only when a later one arrives)
  report RESULTS CHAOS SAMPLES SETTLE key=value...
                                the figures and the checks; exits 1 if a check fails

A request's outcome (`load`):
  ok          200, the stream ended with `data: [DONE]` and carried no error event
  error_event 200, the stream carried a `data: {"error": ...}` event (a clean error)
  http_error  an error status with its body read whole (a clean error)
  conn_error  no response head: refused, reset or closed before it (the router restarting)
  truncated   200, the body ended (EOF, reset, bad chunk) without [DONE] or an error event
  hung        no byte for `timeout` s, or the whole request past `total` s
"""

import http.client
import json
import os
import random
import socket
import sys
import threading
import time
import urllib.request

WORDS = (
    "router cache block prefix replica token stream event index hash engine request "
    "latency queue batch decode prefill memory shard worker model kernel tensor"
).split()


def kv_args(argv):
    out = {}
    for a in argv:
        k, _, v = a.partition("=")
        out[k] = v
    return out


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---------------------------------------------------------------------------------------- load


def one_request(host, port, body, timeout, total):
    """Sends one streamed request; returns the outcome record (without times)."""
    rec = {"status": None, "outcome": None, "replica": None, "error": None, "chunks": 0, "reply": ""}
    deadline = time.monotonic() + total
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=json.dumps(body),
                headers={"content-type": "application/json"},
            )
            resp = conn.getresponse()
        except socket.timeout:
            rec.update(outcome="hung", error="no response head")
            return rec
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            rec.update(outcome="conn_error", error=f"{type(e).__name__}: {e}")
            return rec
        rec["status"] = resp.status
        rec["replica"] = resp.getheader("x-kinference-endpoint")
        if resp.status != 200:
            try:
                data = resp.read()
                rec.update(outcome="http_error", error=data[:300].decode("utf-8", "replace"))
            except socket.timeout:
                rec.update(outcome="hung", error="error body stalled")
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                rec.update(outcome="truncated", error=f"error body: {type(e).__name__}: {e}")
            return rec
        done = errored = False
        reply = []
        try:
            while True:
                if time.monotonic() > deadline:
                    rec.update(outcome="hung", error=f"over {total} s")
                    return rec
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                try:
                    ev = json.loads(data)
                except ValueError:
                    rec["error"] = f"bad event: {data[:120]!r}"
                    continue
                if "error" in ev:
                    errored = True
                    rec["error"] = json.dumps(ev["error"])[:300]
                    continue
                rec["chunks"] += 1
                for c in ev.get("choices") or []:
                    reply.append((c.get("delta") or {}).get("content") or "")
        except socket.timeout:
            rec.update(outcome="hung", error=f"no byte for {timeout} s")
            return rec
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            if not (done or errored):
                rec.update(outcome="truncated", error=f"{type(e).__name__}: {e}")
                return rec
        rec["reply"] = "".join(reply)
        if errored:
            rec["outcome"] = "error_event"
        elif done:
            rec["outcome"] = "ok"
        else:
            rec.update(outcome="truncated", error=rec["error"] or "EOF without [DONE]")
        return rec
    finally:
        conn.close()


def load(url, out, a):
    host, port = url.split("//", 1)[-1].rsplit(":", 1)
    port = int(port)
    duration = float(a.get("duration", "60"))
    workers = int(a.get("concurrency", "12"))
    timeout = float(a.get("timeout", "30"))
    total = float(a.get("total", "90"))
    turns = int(a.get("turns", "6"))
    model = a.get("model", "tiny")
    seed = int(a.get("seed", "1"))
    stop_at = time.time() + duration
    lock = threading.Lock()
    f = open(out, "w", buffering=1)
    counter = [0]
    # Shared system prompts: conversations of one "tenant" share a long prefix.
    base = random.Random(seed)
    systems = [f"You are assistant {i}. " + text(base, 150) for i in range(6)]

    def worker(w):
        rng = random.Random(seed * 1000 + w)
        while time.time() < stop_at:
            msgs = [{"role": "system", "content": rng.choice(systems)}]
            for turn in range(rng.randint(2, turns)):
                if time.time() >= stop_at:
                    return
                msgs.append({"role": "user", "content": text(rng, rng.randint(20, 80))})
                body = {
                    "model": model,
                    "messages": msgs,
                    "stream": True,
                    "max_tokens": rng.randint(16, 160),
                }
                with lock:
                    counter[0] += 1
                    rid = counter[0]
                t0 = time.time()
                rec = one_request(host, port, body, timeout, total)
                t1 = time.time()
                reply = rec.pop("reply")
                rec.update(id=rid, worker=w, turn=turn, start=t0, end=t1)
                with lock:
                    f.write(json.dumps(rec) + "\n")
                if rec["outcome"] != "ok":
                    # A failed turn ends the conversation, as a user would start over; after
                    # a refused connection (the router restarting), not in a tight loop.
                    if rec["outcome"] == "conn_error":
                        time.sleep(0.2)
                    break
                msgs.append({"role": "assistant", "content": reply})
                if rng.random() < 0.3:
                    time.sleep(rng.uniform(0.0, 0.5))  # think time

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f.close()


# -------------------------------------------------------------------------------------- sample


def proc_sample(pid):
    rss = None
    with open(f"/proc/{pid}/status") as s:
        for line in s:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def sample(pidfile, out, stop_file):
    with open(out, "w", buffering=1) as f:
        while not os.path.exists(stop_file):
            try:
                pid = int(open(pidfile).read().strip())
                rss, fds = proc_sample(pid)
                f.write(json.dumps({"t": time.time(), "pid": pid, "rss_mib": rss, "fds": fds}) + "\n")
            except (OSError, ValueError):
                pass  # between two routers, or the file being rewritten
            time.sleep(1)


# -------------------------------------------------------------------------------------- settle


def get_json(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def settle(admin, fleet_file, out, a):
    """fleet_file: one line per replica, `INDEX URL` (the sim's own HTTP address)."""
    rounds = int(a.get("flushes", "12"))
    model = a.get("model", "tiny")
    fleet = []
    for line in open(fleet_file):
        i, url = line.split()
        fleet.append((int(i), url))
    results = {}
    for i, url in fleet:
        res = {"replica": i, "url": url, "flushes": 0}
        for attempt in range(rounds + 1):
            try:
                cache = get_json(f"{url}/debug/cache")["ranks"][0]
                reps = [
                    r
                    for p in get_json(f"http://{admin}/debug/replicas")["pools"]
                    for r in p["replicas"]
                    if r["url"].rstrip("/") == url.rstrip("/")
                ]
            except (OSError, ValueError, KeyError) as e:
                res["error"] = str(e)
                time.sleep(1)
                continue
            rep = reps[0] if reps else {}
            wk = (rep.get("workers") or [{}])[0]
            ev = wk.get("events") or {}
            res.update(
                sim_cached=cache["cached_blocks"],
                sim_published=cache["published_batches"],
                router_entries=wk.get("index_entries"),
                applied_seq=ev.get("applied_seq"),
                sync=ev.get("sync"),
                gaps=ev.get("gaps"),
                resets=ev.get("resets"),
                repeats=ev.get("repeats"),
                replays=ev.get("replays_succeeded"),
                unrecoverable=ev.get("unrecoverable_gaps"),
                scorable=rep.get("scorable"),
                unscorable_reason=rep.get("unscorable_reason"),
                health=rep.get("health"),
            )
            res.pop("error", None)
            caught_up = (
                cache["published_batches"] is not None
                and ev.get("applied_seq") == cache["published_batches"] - 1
                and ev.get("sync") in ("synced", "resynced")
            )
            if caught_up:
                break
            if attempt == rounds:
                break
            # The router has not applied the last batch: send one more request straight to
            # the replica, so that a dropped tail batch shows as a gap and is replayed.
            res["flushes"] += 1
            body = json.dumps(
                {"model": model, "prompt": f"flush {i} {attempt} " + text(random.Random(attempt), 40), "max_tokens": 4}
            ).encode()
            try:
                req = urllib.request.Request(
                    f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
                )
                urllib.request.urlopen(req, timeout=10).read()
            except OSError as e:
                res["flush_error"] = str(e)
            time.sleep(1)
        results[i] = res
    with open(out, "w") as f:
        json.dump([results[i] for i, _ in fleet], f, indent=1)


# -------------------------------------------------------------------------------------- report


def report(results_file, chaos_file, samples_file, settle_file, a):
    grace = float(a.get("grace", "3"))
    seed_replica = int(a.get("seed_replica", "-1"))
    max_rss = float(a.get("max_rss_mib", "512"))
    max_fds = int(a.get("max_fds", "1024"))
    reqs = [json.loads(l) for l in open(results_file) if l.strip()]
    # Chaos log lines: `T replica_down I`, `T replica_up I`, `T router_down`, `T router_up`,
    # `T seed_flip I`.
    windows = []  # (start, end, kind, replica)
    open_at = {}
    t_end = time.time()
    for line in open(chaos_file):
        parts = line.split()
        if len(parts) < 2:
            continue
        t, what = float(parts[0]), parts[1]
        who = parts[2] if len(parts) > 2 else "router"
        if what.endswith("_down"):
            open_at[who] = t
        elif what.endswith("_up") and who in open_at:
            windows.append((open_at.pop(who), t + grace, "router" if who == "router" else "replica", who))
    for who, t in open_at.items():
        windows.append((t, t_end, "router" if who == "router" else "replica", who))
    replica_of_addr = {}
    for line in a.get("fleet_addrs", "").split(","):
        if "=" in line:
            i, addr = line.split("=", 1)
            replica_of_addr[addr] = i

    def explained(r):
        kinds = []
        for s, e, kind, who in windows:
            if r["start"] <= e and r["end"] >= s:
                rep = replica_of_addr.get(r.get("replica") or "")
                if kind == "router":
                    kinds.append("router")
                elif rep is None or rep == who:
                    kinds.append("replica")
        return kinds

    counts = {}
    unexplained = []
    by_cause = {"router": 0, "replica": 0}
    for r in reqs:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        if r["outcome"] != "ok":
            k = explained(r)
            if not k:
                unexplained.append(r)
            else:
                by_cause["router" if "router" in k else "replica"] += 1
    conn_router = sum(1 for r in reqs if r["outcome"] == "conn_error" and "router" in explained(r))
    samples = [json.loads(l) for l in open(samples_file) if l.strip()]
    settle_rows = json.load(open(settle_file))

    checks = []

    def check(name, ok, figure):
        checks.append((name, ok, figure))

    n = len(reqs)
    check("requests sent", n > 0, f"{n} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})")
    check("none hung past its timeout", counts.get("hung", 0) == 0, str(counts.get("hung", 0)))
    check("none truncated without an error event", counts.get("truncated", 0) == 0, str(counts.get("truncated", 0)))
    check(
        "failures only in kill / restart windows",
        not unexplained,
        f"{n - counts.get('ok', 0)} failed: {by_cause['replica']} in a replica's window, "
        f"{by_cause['router']} in the router's ({conn_router} connection errors), {len(unexplained)} outside",
    )
    for r in settle_rows:
        if r.get("replica") == seed_replica:
            check(
                f"replica {seed_replica} (other hash seed) unscorable",
                r.get("scorable") is False,
                f"scorable={r.get('scorable')} reason={r.get('unscorable_reason')!r}",
            )
        same = r.get("router_entries") == r.get("sim_cached")
        caught = r.get("sim_published") is not None and r.get("applied_seq") == r.get("sim_published") - 1
        check(
            f"replica {r['replica']} index = cache",
            same and caught and r.get("sync") in ("synced", "resynced"),
            f"router {r.get('router_entries')} / replica {r.get('sim_cached')} blocks; "
            f"applied {r.get('applied_seq')} / published {r.get('sim_published')}; {r.get('sync')}; "
            f"gaps {r.get('gaps')} resets {r.get('resets')} repeats {r.get('repeats')} "
            f"replays {r.get('replays')} "
            f"unrecoverable {r.get('unrecoverable')}; flushes {r.get('flushes')}",
        )
    if samples:
        pids = []
        for s in samples:
            if not pids or pids[-1] != s["pid"]:
                pids.append(s["pid"])
        rss = [s["rss_mib"] for s in samples if s["rss_mib"] is not None]
        fds = [s["fds"] for s in samples]
        last = [s for s in samples if s["pid"] == pids[-1]]
        lrss = [s["rss_mib"] for s in last]
        lfds = [s["fds"] for s in last]
        check(
            "router RSS bounded",
            max(rss) <= max_rss,
            f"max {max(rss):.1f} MiB, final {rss[-1]:.1f} MiB (last router: first {lrss[0]:.1f}, "
            f"max {max(lrss):.1f} over {len(last)} s; limit {max_rss:.0f}); {len(pids)} router processes",
        )
        check(
            "router fds bounded",
            max(fds) <= max_fds,
            f"max {max(fds)}, final {fds[-1]} (last router: first {lfds[0]}, max {max(lfds)}; limit {max_fds})",
        )
    else:
        check("router sampled", False, "no samples")

    kills = sum(1 for w in windows if w[2] == "replica")
    restarts = sum(1 for w in windows if w[2] == "router")
    # A soak whose actions ran late must not pass without the restart it is there to test.
    check("the router was restarted", restarts > 0, f"{restarts} times")
    print(f"chaos: {kills} replica kills/restarts, {restarts} router restarts")
    width = max(len(c[0]) for c in checks)
    print(f"{'check':<{width}}  result  figures")
    for name, ok, fig in checks:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL':<6}  {fig}")
    for r in unexplained[:10]:
        print("unexplained failure:", json.dumps(r))
    bad = [r for r in reqs if r["outcome"] in ("truncated", "hung")]
    for r in bad[:10]:
        print("bad request:", json.dumps(r))
    return 0 if all(ok for _, ok, _ in checks) else 1


def main():
    cmd = sys.argv[1]
    if cmd == "load":
        load(sys.argv[2], sys.argv[3], kv_args(sys.argv[4:]))
    elif cmd == "sample":
        sample(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "settle":
        settle(sys.argv[2], sys.argv[3], sys.argv[4], kv_args(sys.argv[5:]))
    elif cmd == "report":
        sys.exit(report(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], kv_args(sys.argv[6:])))
    else:
        sys.exit(f"unknown subcommand {cmd}")


if __name__ == "__main__":
    main()
