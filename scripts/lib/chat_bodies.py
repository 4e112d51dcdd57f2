"""chat_bodies.py - the chat workload of scripts/router-latency.sh and router-instructions.sh.

usage: python3 chat_bodies.py OUT_TSV [MAX_CONVERSATIONS]
       python3 chat_bodies.py --check   (exits 1, saying why, when the sample is missing)

The last 1,000 conversations of ../shared's ShareGPT sample (the trace benchmarks read from its
start), each human turn with its whole history as one chat request, bodies up to 16 kB, taken
in turn order across conversations as a live service sees them (every first turn, then every
second turn, ...). MAX_CONVERSATIONS keeps only the first that many of those conversations.
One request per line, `HEAD<TAB>TAIL`: HEAD is the JSON of `"messages":[...` cut inside the
last message's content string and TAIL closes it, so that a client can put a unique tag where
the cut is (see scripts/router-latency.lua).
"""
import gzip
import json
import os
import sys

# The one place the benchmark scripts name the sample: ../shared beside the repository.
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared",
                   "data", "traces", "sharegpt", "sharegpt_v3_multiturn_3000.jsonl.gz")
SRC = os.path.normpath(SRC)
if not os.path.isfile(SRC):
    sys.exit(f"the chat workload reads {SRC}, which is missing")
if sys.argv[1:] == ["--check"]:
    sys.exit(0)
dst = sys.argv[1]
limit = int(sys.argv[2]) if len(sys.argv) > 2 else None
convs = [json.loads(line) for line in gzip.open(SRC, "rt")][2000:][:limit]
turns = []  # per conversation: the message lists ending at each human turn
for c in convs:
    msgs, mine = [], []
    for m in c["conversations"]:
        msgs.append({"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]})
        if m["from"] == "human":
            mine.append(list(msgs))
    turns.append(mine)
lines, size = [], 0
for k in range(max(len(t) for t in turns)):
    for t in turns:
        if k < len(t):
            body = '"messages":' + json.dumps(t[k], ensure_ascii=False)
            if len(body.encode()) <= 16384:
                cut = len(body) - 3  # before the closing `"}]`
                assert body[cut:] == '"}]'
                lines.append(body[:cut] + "\t" + body[cut:])
                size += len(body.encode())
with open(dst, "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"{len(lines)} chat requests, mean {size / len(lines):,.0f} bytes of messages", file=sys.stderr)
