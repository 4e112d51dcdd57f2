#!/usr/bin/env python3
"""A libzmq (pyzmq) peer for the KV-event interop tests (crates/interop/tests/pyzmq.rs).

Two roles, each able to bind or connect, as vLLM's own sockets do:

  pub  --endpoint EP (--bind|--connect) --topic T --count N --hash-base B
       A PUB-compatible socket sending vLLM's live frames [topic, seq (8 bytes BE), msgpack
       batch]. Batch i stores block B+i (parent B+i-1; none for i = 0), 16 tokens of value i.
       It is an XPUB (wire-identical to vLLM's PUB) so that it can wait for the subscription
       instead of sleeping, then sends everything and waits for "quit" on stdin.
  sub  --endpoint EP (--bind|--connect) [--topic T]
       A SUB socket; every message is decoded and printed as one JSON line:
       {"topic", "seq", "events": [{"type", "block_hashes", "parent_block_hash", "token_ids",
       "block_size", "medium"}...]}. Ends on "quit" on stdin.

Stdout carries a first line "ready ENDPOINT" (the bound endpoint, or the one dialled), then
the role's output. Batches are encoded and decoded with vLLM's own msgspec classes when vLLM is
importable (the real-vLLM venv), otherwise with msgpack in vLLM's 0.34 layout (spec/vllm.md).
The decoder in use is printed on stderr.
"""

import argparse
import json
import select
import sys
import time

import zmq

try:  # vLLM's own classes, when this interpreter has vLLM.
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    CODEC = "vllm-msgspec"
except ImportError:
    import msgpack

    CODEC = "msgpack"


def hex_or_int(h):
    return h.hex() if isinstance(h, (bytes, bytearray)) else h


def encode_stored(i, base):
    parent = base + i - 1 if i > 0 else None
    tokens = [i] * 16
    if CODEC == "vllm-msgspec":
        ev = BlockStored(
            block_hashes=[base + i],
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
        )
        return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[ev], data_parallel_rank=0))
    ev = {
        "type": "BlockStored",
        "block_hashes": [base + i],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    return msgpack.packb([time.time(), [ev], 0])


def decode(payload):
    if CODEC == "vllm-msgspec":
        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
        out = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                out.append({
                    "type": "BlockStored",
                    "block_hashes": [hex_or_int(h) for h in ev.block_hashes],
                    "parent_block_hash": hex_or_int(ev.parent_block_hash),
                    "token_ids": list(ev.token_ids),
                    "block_size": ev.block_size,
                    "medium": ev.medium,
                })
            elif isinstance(ev, BlockRemoved):
                out.append({
                    "type": "BlockRemoved",
                    "block_hashes": [hex_or_int(h) for h in ev.block_hashes],
                    "medium": ev.medium,
                })
            elif isinstance(ev, AllBlocksCleared):
                out.append({"type": "AllBlocksCleared"})
        return out
    ts, events, _rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float), ts
    out = []
    for ev in events:
        if isinstance(ev, list):  # legacy array layout
            names = {
                "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
                "BlockRemoved": ["block_hashes", "medium"],
                "AllBlocksCleared": [],
            }[ev[0]]
            ev = dict(zip(["type"] + names, ev))
        kind = ev["type"]
        item = {"type": kind}
        if kind != "AllBlocksCleared":
            item["block_hashes"] = [hex_or_int(h) for h in ev["block_hashes"]]
            item["medium"] = ev.get("medium")
        if kind == "BlockStored":
            item["parent_block_hash"] = hex_or_int(ev["parent_block_hash"])
            item["token_ids"] = list(ev["token_ids"])
            item["block_size"] = ev["block_size"]
        out.append(item)
    return out


def open_socket(ctx, kind, args):
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if args.bind:
        sock.bind(args.endpoint)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        sock.connect(args.endpoint)
        endpoint = args.endpoint
    return sock, endpoint


def quit_requested(timeout):
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(ready) and sys.stdin.readline().strip() in ("quit", "")


def run_pub(ctx, args):
    sock, endpoint = open_socket(ctx, zmq.XPUB, args)
    sock.set_hwm(100_000)
    print(f"ready {endpoint}", flush=True)
    topic = args.topic.encode()
    while True:  # the subscription message: b"\x01" + prefix
        msg = sock.recv()
        if msg[:1] == b"\x01" and topic.startswith(msg[1:]):
            break
    for i in range(args.count):
        sock.send_multipart([topic, i.to_bytes(8, "big"), encode_stored(i, args.hash_base)])
    print(f"sent {args.count}", flush=True)
    while not quit_requested(1.0):
        pass


def run_sub(ctx, args):
    sock, endpoint = open_socket(ctx, zmq.SUB, args)
    sock.setsockopt_string(zmq.SUBSCRIBE, args.topic)
    print(f"ready {endpoint}", flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if dict(poller.poll(100)).get(sock):
            frames = sock.recv_multipart()
            topic, seq, payload = frames  # vLLM's 3-frame live message, nothing else
            print(json.dumps({
                "topic": topic.decode(),
                "seq": int.from_bytes(seq, "big"),
                "events": decode(payload),
            }), flush=True)
        elif quit_requested(0):
            return


def main():
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["pub", "sub"])
    p.add_argument("--endpoint", required=True)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--bind", action="store_true")
    mode.add_argument("--connect", action="store_true")
    p.add_argument("--topic", default="")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--hash-base", type=int, default=1)
    args = p.parse_args()
    print(f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, codec {CODEC}", file=sys.stderr, flush=True)
    ctx = zmq.Context.instance()
    (run_pub if args.role == "pub" else run_sub)(ctx, args)


if __name__ == "__main__":
    main()
