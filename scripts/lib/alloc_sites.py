#!/usr/bin/env python3
"""Allocation sites per request from `perf script -F comm,ip,sym` of allocator probes.

usage: alloc_sites.py STACKS_TXT DATA_PER_REQUEST OTHER_PER_REQUEST [DEPTH]

Counts the stacks of the data-plane threads (kinf-data-*), then those of the other threads
(KV events, scrapes), by their first DEPTH frames that are not the allocator, the standard
library, the collections or `bytes` (the code that asked for the memory), and prints each
site's share of its group times the group's allocations per request (counted without stacks:
perf drops stacks, at random with respect to the site), most first.
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
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    path = sys.argv[1]
    per_request = {"data-plane": float(sys.argv[2]), "other": float(sys.argv[3])}
    depth = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    sites = {group: collections.Counter() for group in per_request}
    for comm, frames in stacks(path):
        group = "data-plane" if comm.startswith("kinf-data-") else "other"
        own = [f for f in frames if not SKIP.match(f)]
        key = " <- ".join(own[:depth]) if own else (frames[-1] if frames else "?")
        sites[group][key] += 1
    if not sites["data-plane"]:
        sys.exit("alloc_sites.py: no data-plane stacks were recorded")
    for group, counted in sites.items():
        total = sum(counted.values())
        print(f"{group} threads: {total} stacks recorded; "
              f"{per_request[group]:.1f} allocations and reallocations per request")
        for key, n in counted.most_common(40 if group == "data-plane" else 15):
            print(f"{per_request[group] * n / max(total, 1):7.2f}  {key}")


if __name__ == "__main__":
    main()
