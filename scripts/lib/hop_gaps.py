"""hop_gaps.py - a router's own time per request at one connection, from its syscalls.

usage: python3 hop_gaps.py SYSCALLS SOCKETS

SYSCALLS: `perf script --ns -F pid,tid,time,event,trace` of `perf record -e
raw_syscalls:sys_enter,raw_syscalls:sys_exit` on the router's processes. SOCKETS: lines
`PID FD ROLE`, ROLE `client` (the client's connection) or `upstream` (a replica's), taken from
/proc while the connections were open.

With one client connection and one request at a time, each request is: reads from the client,
writes to a replica, reads from the replica, writes to the client (a router may interleave the
first two, forwarding the request's first bytes before it has read the rest). Printed, over the requests
traced: from the end of the last read of the client's request to the start of the write to a
replica that follows it (the router's work before forwarding: parsing, and for kinference tokenizing,
hashing, looking up and choosing), and from the end of the last read from the replica to the
start of the first write to the client (relaying the response). Time spent in the kernel on
either side of these is not in them, so the two routers' figures compare their own code.
"""
import re
import statistics
import sys

READS = {0, 17, 19, 45, 47, 295}  # read, pread64, readv, recvfrom, recvmsg, preadv
WRITES = {1, 18, 20, 44, 46, 296, 307}  # write, pwrite64, writev, sendto, sendmsg, pwritev, sendmmsg


def gaps(lines, role):
    """The two gaps of each request, in microseconds: (forward, relay), from `perf script`
    lines and `role[(pid, fd)]`. Here the router (pid 7) reads a request in two parts and
    forwards its head after the first (as nginx does); the gap counted is the one after the
    last read. A read that returns nothing (-11, EAGAIN) ends no read.

    >>> role = {(7, 3): "client", (7, 9): "upstream"}
    >>> trace = [
    ...     "7/7 100.000010000: raw_syscalls:sys_enter: NR 45 (3, 0, 400, 0, 0, 0)",
    ...     "7/7 100.000011000:  raw_syscalls:sys_exit: NR 45 = 512",
    ...     "7/7 100.000015000: raw_syscalls:sys_enter: NR 20 (9, 0, 2, 0, 0, 0)",
    ...     "7/7 100.000016000:  raw_syscalls:sys_exit: NR 20 = 512",
    ...     "7/7 100.000020000: raw_syscalls:sys_enter: NR 45 (3, 0, 400, 0, 0, 0)",
    ...     "7/7 100.000021000:  raw_syscalls:sys_exit: NR 45 = 100",
    ...     "7/7 100.000022000: raw_syscalls:sys_enter: NR 45 (3, 0, 400, 0, 0, 0)",
    ...     "7/7 100.000023000:  raw_syscalls:sys_exit: NR 45 = -11",
    ...     "7/7 100.000030000: raw_syscalls:sys_enter: NR 1 (9, 0, 100, 0, 0, 0)",
    ...     "7/7 100.000031000:  raw_syscalls:sys_exit: NR 1 = 100",
    ...     "7/7 100.000100000: raw_syscalls:sys_enter: NR 45 (9, 0, 400, 0, 0, 0)",
    ...     "7/7 100.000101000:  raw_syscalls:sys_exit: NR 45 = 300",
    ...     "7/7 100.000104500: raw_syscalls:sys_enter: NR 44 (3, 0, 300, 0, 0, 0)",
    ...     "7/7 100.000105000:  raw_syscalls:sys_exit: NR 44 = 300",
    ... ]
    >>> [[round(g, 1) for g in x] for x in gaps(trace, role)]
    [[9.0], [3.5]]
    """
    enter = {}  # thread -> its syscall in progress (number, fd)
    last_client_read = {}
    last_upstream_read = {}
    # A router may forward a request in parts as it reads it (nginx does): the gap counted is
    # the one after the request's last read, known once the response starts coming back.
    pending = {}
    forward, relay = [], []
    pat = re.compile(r"\s*(\d+)/(\d+)\s+([\d.]+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+)(.*)")
    for line in lines:
        m = pat.match(line)
        if not m:
            continue
        pid, tid, t, kind, nr = int(m[1]), int(m[2]), float(m[3]), m[4], int(m[5])
        if kind == "enter":
            args = re.match(r" \((\w+)", m[6])
            fd = int(args[1], 16) if args else -1
            enter[tid] = (nr, fd)
            r = role.get((pid, fd))
            if nr in WRITES and r == "upstream" and pid in last_client_read:
                pending[pid] = (t - last_client_read.pop(pid)) * 1e6
            elif nr in WRITES and r == "client" and pid in last_upstream_read:
                relay.append((t - last_upstream_read.pop(pid)) * 1e6)
            continue
        ret = re.match(r" = (-?\d+)", m[6])
        nr_fd = enter.pop(tid, None)
        if nr_fd is None or nr_fd[0] != nr or nr not in READS or not ret or int(ret[1]) <= 0:
            continue
        r = role.get((pid, nr_fd[1]))
        if r == "client":
            last_client_read[pid] = t
        elif r == "upstream":
            last_upstream_read[pid] = t
            if pid in pending:
                forward.append(pending.pop(pid))
    return forward, relay


def main():
    syscalls, sockets = sys.argv[1:3]
    role = {}
    for line in open(sockets):
        pid, fd, r = line.split()
        role[(int(pid), int(fd))] = r
    forward, relay = gaps(open(syscalls, errors="replace"), role)
    for name, g in (("client's request read -> written to a replica", forward),
                    ("replica's response read -> written to the client", relay)):
        if not g:
            sys.exit(f"no requests seen for {name!r}: were the sockets mapped?")
        g.sort()
        q = lambda p: g[min(len(g) - 1, int(p * len(g)))]
        print(f"  {name}: p10 {q(0.1):.1f} us, median {statistics.median(g):.1f} us, "
              f"p90 {q(0.9):.1f} us ({len(g)} requests)")


if __name__ == "__main__":
    main()
