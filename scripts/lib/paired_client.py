"""paired_client.py - one connection to each of two routers, requests sent to them in turn.

usage: python3 paired_client.py URL_A URL_B CHAT_BODIES REQUESTS WARMUP OUT_DIR [--stream]

Each pair sends the same chat request (CHAT_BODIES: chat_bodies.py's HEAD<TAB>TAIL lines, a
unique tag where the cut is) to A and to B, one after the other on a kept-alive connection
each, A first in even pairs and B first in odd ones, so that whatever the machine does
meanwhile (another process's burst, a frequency change) falls on both sides alike and neither
is always the one that runs right after the other. A pair's latency is from the first byte of
the request sent to the last byte of the response read, measured here (time.perf_counter_ns).
The first WARMUP pairs are not recorded. Every response must be 200; streamed responses must
end with `data: [DONE]`.

Writes OUT_DIR/pairs.tsv (one line per recorded pair: A's and B's latency in microseconds)
and prints a summary: each side's median and 90th percentile, the median of the per-pair
differences B - A with its 95 % confidence interval (order statistics of the differences,
distribution-free), and the share of pairs where B was faster; the same figures in
OUT_DIR/result.json.
"""
import http.client
import json
import math
import os
import sys
import time
import urllib.parse


def connect(url):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=60)


def main():
    url_a, url_b, bodies, n, warmup, out = sys.argv[1:7]
    stream = "--stream" in sys.argv[7:]
    n, warmup = int(n), int(warmup)
    lines = [l.rstrip("\n").split("\t") for l in open(bodies, encoding="utf-8") if "\t" in l]
    if not lines:
        sys.exit(f"no requests in {bodies}")
    extra = ',"stream":true' if stream else ""
    conns = [connect(url_a), connect(url_b)]
    headers = {"content-type": "application/json"}

    def one(side, i):
        head, tail = lines[i % len(lines)]
        body = (f'{{"model":"bench",{head} [pair-{i}]{tail},"max_tokens":8,'
                f'"temperature":0{extra}}}').encode()
        c = conns[side]
        t0 = time.perf_counter_ns()
        c.request("POST", "/v1/chat/completions", body, headers)
        r = c.getresponse()
        data = r.read()
        t1 = time.perf_counter_ns()
        if r.status != 200:
            sys.exit(f"{'AB'[side]} answered request {i} with HTTP {r.status}: {data[:300]!r}")
        if stream and not data.rstrip().endswith(b"data: [DONE]"):
            sys.exit(f"{'AB'[side]}'s stream for request {i} did not end with [DONE]")
        return (t1 - t0) / 1000.0

    pairs = []
    for i in range(warmup + n):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        got = [0.0, 0.0]
        for side in order:
            got[side] = one(side, i)
        if i >= warmup:
            pairs.append(got)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "pairs.tsv"), "w") as f:
        f.write("a_us\tb_us\n")
        for a, b in pairs:
            f.write(f"{a:.1f}\t{b:.1f}\n")

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    a = [p[0] for p in pairs]
    b = [p[1] for p in pairs]
    d = sorted(p[1] - p[0] for p in pairs)
    k = len(d)
    # The median's 95 % interval from the order statistics (normal approximation of the
    # binomial): no assumption about the differences' distribution.
    half = 1.96 * math.sqrt(k) / 2
    lo, hi = d[max(0, int(k / 2 - half))], d[min(k - 1, int(math.ceil(k / 2 + half)))]
    print(f"pairs: {k} (after {warmup} not recorded){', streamed' if stream else ''}")
    print(f"A: median {pct(a, 0.5):.1f} us, p90 {pct(a, 0.9):.1f} us")
    print(f"B: median {pct(b, 0.5):.1f} us, p90 {pct(b, 0.9):.1f} us")
    print(f"B - A per pair: median {pct(d, 0.5):+.1f} us (95 % interval {lo:+.1f} to {hi:+.1f} us)")
    print(f"B faster in {100.0 * sum(1 for x in d if x < 0) / k:.1f} % of pairs")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"pairs": k, "a_median_us": pct(a, 0.5), "b_median_us": pct(b, 0.5),
                   "diff_median_us": pct(d, 0.5), "diff_lo_us": lo, "diff_hi_us": hi}, f)


if __name__ == "__main__":
    main()
