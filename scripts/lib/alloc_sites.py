#!/usr/bin/env python3
"""Allocation sites per request from `perf script -F comm,ip,sym` of allocator probes.

usage: alloc_sites.py STACKS_TXT PER_REQUEST [DEPTH]

Counts the stacks of the data-plane threads (kinf-data-*) by their first DEPTH frames that are
not the allocator, the standard library, the collections or `bytes` (the code that asked for
the memory), and prints each site's share of them times PER_REQUEST (the allocations per
request counted without stacks: perf drops stacks, at random with respect to the site), most
first.
"""
import collections
import re
import sys

SKIP = re.compile(
    r"^(_?mi_|alloc::|<alloc::|core::|<core::|std::|<std::|hashbrown::|<hashbrown|__rust|"
    r"\[unknown\]|bytes::|<bytes::|<T as alloc|<\[T\]|<str as|smallvec|<smallvec|0x)"
)


def stacks(path):
    """Yields (comm, frames leaf first) per sample."""
    comm, frames = None, []
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                if comm is not None:
                    yield comm, frames
                comm, frames = None, []
            elif line[0] in " \t":
                parts = line.strip().split(" ", 1)
                if len(parts) == 2:
                    frames.append(re.sub(r"\+0x[0-9a-f]+$", "", parts[1]))
            else:
                comm, frames = line.split()[0], []
    if comm is not None:
        yield comm, frames


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    path, per_request = sys.argv[1], float(sys.argv[2])
    depth = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    sites = collections.Counter()
    total = 0
    for comm, frames in stacks(path):
        if not comm.startswith("kinf-data-"):
            continue
        total += 1
        own = [f for f in frames if not SKIP.match(f)]
        key = " <- ".join(own[:depth]) if own else (frames[-1] if frames else "?")
        sites[key] += 1
    if total == 0:
        sys.exit("alloc_sites.py: no data-plane stacks were recorded")
    print(f"{total} data-plane stacks recorded; {per_request:.1f} allocations and reallocations per request")
    for key, n in sites.most_common(40):
        print(f"{per_request * n / total:7.2f}  {key}")


if __name__ == "__main__":
    main()
