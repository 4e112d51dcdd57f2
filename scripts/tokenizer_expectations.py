#!/usr/bin/env python3
"""Expected token ids for kinference-tokenize, computed with Python transformers.

For every tokenizer in ../shared/data/tokenizers (plus the tiny-llama one vLLM was run with)
this writes SET.jsonl.gz into the output directory: a header line, then one line per case with
the case's description and sha256 digests (first 16 hex digits) of the expected ids and text.

- chat sets (tokenizers with a chat template): ShareGPT conversations cut after a user turn,
  some with a system/developer message, content parts, tools or chat_template_kwargs, plus a
  few hand-written requests (tool calls, null content, ...). Expected ids are
  `tok.apply_chat_template(conversation, tools=..., add_generation_prompt=..., tokenize=True,
  return_dict=False, **kwargs)`, where `conversation` is the request normalized the way vLLM 0.32
  normalizes it (see `vllm_conversation` below; the Rust crate does the same).
- completion sets (every tokenizer): ShareGPT texts and edge strings,
  `tok.encode(text, add_special_tokens=True)`.

Loading: AutoTokenizer.from_pretrained(dir), as vLLM does, except where the directory lacks the
config.json that decides the class for the real model: deepseek-v3 (real model_type
"deepseek_v3", which transformers maps to TokenizersBackend, i.e. tokenizer.json as is) and the
Mistral files (vLLM serves Mistral models through mistral-common, whose sentencepiece ids equal
tokenizer.json as is; transformers' LlamaTokenizer class would rebuild the pipeline and differ on
leading spaces). Those load with TokenizersBackend.from_pretrained(dir).

usage: tokenizer_expectations.py [--out DIR] [--shared DIR] [--cases N] [--sets a,b]
  DIR defaults to $KINFERENCE_TOKENIZER_EXPECT_DIR. Packages: scripts/tokenizer-requirements.txt
  (scripts/python-deps.sh installs them).
"""
import argparse
import array
import gzip
import hashlib
import json
import os
import random
import sys
from pathlib import Path

import transformers
import tokenizers
import jinja2
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in at most three sentences.\nUse Markdown when it helps.",
    "  Système: réponds en français, s'il te plaît. 日本語も可。 ",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City, e.g. Zürich"},
                                                      "unit": {"type": "string", "enum": ["c", "f"]}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                                      "strict": True}},
]
EDGE_TEXTS = [
    "Hello world", " leading space", "trailing space ", "  two  spaces\n\n\n", "\n\nnewlines\r\n",
    "<|endoftext|> x", "<s> hi </s>", "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|>x",
    "日本語のテキスト 😀 emoji 👩‍👩‍👧", "é vs e\u0301 nfc?", "tabs\tand\x0bvertical", "1234567890 3.14159",
    "\u00a0nbsp\u3000ideographic", "a" * 3000, "code:\n    def f(x):\n        return x ** 2\n",
]


def digest_ids(ids):
    return hashlib.sha256(array.array("I", ids).tobytes()).hexdigest()[:16]


def digest_text(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def load_sharegpt(shared):
    path = shared / "data/traces/sharegpt/sharegpt_v3_multiturn_3000.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["conversations"] for line in f]


def load_tokenizer(path, loader):
    if loader == "TokenizersBackend":
        from transformers import TokenizersBackend
        return TokenizersBackend.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


# ---- vLLM 0.32's request normalization (renderers/chat_utils.py, renderers/hf.py) ----------

def vllm_content(parts):
    texts = []
    for p in parts:
        if isinstance(p, str):
            texts.append(p)
            continue
        ty = p.get("type")
        key = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}.get(ty)
        if key is None:
            raise ValueError(f"unsupported part {ty}")
        if p.get(key) is None and ty in ("text", "refusal"):
            continue
        texts.append(p[key])
    return "\n".join(texts)  # "string" content format: every template here is one


def vllm_message(m):
    content = m.get("content")
    parts = [] if content is None else ([{"type": "text", "text": content}] if isinstance(content, str) else content)
    out = {"role": m["role"], "content": vllm_content(parts)}
    if m["role"] == "assistant":
        if m.get("tool_calls") is not None:
            out["tool_calls"] = json.loads(json.dumps(m["tool_calls"]))
        if m.get("reasoning") is not None:
            out["reasoning"] = m["reasoning"]
            out["reasoning_content"] = m["reasoning"]
    elif m["role"] == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if m["role"] == "developer":
        out["tools"] = m.get("tools")
    return out


def vllm_postprocess(conv):
    for m in conv:
        if m["role"] == "assistant" and "tool_calls" in m:
            if len(m["tool_calls"]) == 0:
                m.pop("tool_calls")
                continue
            for item in m["tool_calls"]:
                f = item["function"]
                a = f.get("arguments")
                if a:
                    if isinstance(a, str):
                        try:
                            a = json.loads(a)
                        except json.JSONDecodeError:
                            a = None
                    f["arguments"] = a if isinstance(a, dict) else {}
                else:
                    f["arguments"] = {}


def vllm_developer(conv, template):
    if not any(m["role"] == "developer" for m in conv) or '"developer"' in template or "'developer'" in template:
        return conv
    conv = [dict(m, role="system") if m["role"] == "developer" else m for m in conv]
    for m in conv:
        m.pop("tools", None) if m["role"] == "system" else None
    contents, others, needed = [], [], False
    for i, m in enumerate(conv):
        if m["role"] != "system":
            others.append(m)
            continue
        if i > 0 or contents:
            needed = True
        if m.get("content"):
            contents.append(m["content"])
    return [{"role": "system", "content": "\n\n".join(contents)}] + others if needed else conv


def vllm_tool(t):
    f = t["function"]
    fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
    if f.get("strict") is not None:
        fn["strict"] = f["strict"]
    return {"type": "function", "function": fn}


def vllm_apply(tok, template, request, tokenize):
    conv = [vllm_message(m) for m in request["messages"]]
    vllm_postprocess(conv)
    conv = vllm_developer(conv, template)
    tools = [vllm_tool(t) for t in request["tools"]] if request.get("tools") is not None else None
    kwargs = {k: v for k, v in (request.get("chat_template_kwargs") or {}).items() if v not in (None, "auto")}
    agp = request.get("add_generation_prompt", True)
    out = tok.apply_chat_template(conv, tools=tools, chat_template=template, add_generation_prompt=agp,
                                  tokenize=tokenize, return_dict=False, **kwargs)
    return out


# ---- cases ------------------------------------------------------------------------------------

def sharegpt_request(convs, case):
    conv = convs[case["conv"]]
    msgs = []
    if case.get("system") is not None:
        msgs.append({"role": case.get("system_role", "system"), "content": SYSTEM_PROMPTS[case["system"]]})
    for turn in conv[: case["k"]]:
        role = "user" if turn["from"] == "human" else "assistant"
        text = turn["value"]
        if case.get("parts") and role == "user":
            half = len(text) // 2
            msgs.append({"role": role, "content": [{"type": "text", "text": text[:half]},
                                                   {"type": "text", "text": text[half:]}]})
        else:
            msgs.append({"role": role, "content": text})
    return dict({"messages": msgs}, **case.get("extra", {}))


def inline_requests():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}
    return [
        {"messages": [{"role": "user", "content": "What's the weather in Zürich?"}], "tools": TOOLS},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                      {"role": "user", "content": "Thanks. And tomorrow?"}], "tools": TOOLS},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
                      {"role": "user", "content": "again"}]},
        {"messages": [{"role": "developer", "content": "Dev rules."}, {"role": "user", "content": "x"},
                      {"role": "developer", "content": "More rules."}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
         "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "no generation prompt"}], "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "think?"}], "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [{"role": "assistant", "content": "starts with assistant"}, {"role": "user", "content": "ok"}]},
        {"messages": [{"role": "user", "content": ""}]},
        {"messages": [{"role": "user", "content": "  \u00a0spaces and trim \x1f\n"}]},
    ]


def chat_cases(name, convs, n, template):
    rng = random.Random(f"chat:{name}")
    cases = []
    for i in range(n):
        conv = convs[i % len(convs)]
        # Mostly the first turns (keeps the Rust test fast), a tenth of them whole conversations.
        user_turns = (len(conv) + 1) // 2
        r = rng.random()
        turns = rng.randrange(min(2, user_turns)) if r < 0.7 else (rng.randrange(user_turns) if r < 0.9 else user_turns - 1)
        k = 2 * turns + 1
        case = {"conv": i % len(convs), "k": k}
        if rng.random() < 0.3:
            case["system"] = rng.randrange(len(SYSTEM_PROMPTS))
            if rng.random() < 0.3:
                case["system_role"] = "developer"
        if rng.random() < 0.15:
            case["parts"] = True
        extra = {}
        if rng.random() < 0.1:
            extra["tools"] = TOOLS
        if "enable_thinking" in template and rng.random() < 0.3:
            extra["chat_template_kwargs"] = {"enable_thinking": False}
        if extra:
            case["extra"] = extra
        cases.append(case)
    return cases + [{"request": r} for r in inline_requests()]


def completion_cases(convs, n):
    rng = random.Random("completion")
    out = []
    for i in range(n):
        conv = convs[i % len(convs)]
        if rng.random() < 0.05:
            out.append({"conv": i % len(convs), "joined": True})
        else:
            out.append({"conv": i % len(convs), "msg": rng.randrange(len(conv))})
    return out + [{"text": t} for t in EDGE_TEXTS]


def completion_text(convs, case):
    if "text" in case:
        return case["text"]
    conv = convs[case["conv"]]
    if case.get("joined"):
        return "\n".join(t["value"] for t in conv)
    return conv[case["msg"]]["value"]


def sets(shared):
    tk = shared / "data/tokenizers"
    tiny = shared / "golden/real_vllm_0.32/tiny-llama-tokenizer"
    qwen25 = tk / "chat_templates/qwen2.5-instruct.jinja"
    # name -> (dir, loader, template override file, chat?)
    return {
        "llama3": (tk / "llama3", "Auto", None, True),
        "llama3.1": (tk / "llama3.1", "Auto", None, True),
        "qwen3": (tk / "qwen3", "Auto", None, True),
        "deepseek-v3": (tk / "deepseek-v3", "TokenizersBackend", None, True),
        "qwen2": (tk / "qwen2", "Auto", None, False),
        "qwen2+qwen2.5-template": (tk / "qwen2", "Auto", qwen25, True),
        "gpt2": (tk / "gpt2", "Auto", None, False),
        "mistral-v1": (tk / "mistral-v1", "TokenizersBackend", None, False),
        "mistral-v3": (tk / "mistral-v3", "TokenizersBackend", None, False),
        "tiny-llama": (tiny, "Auto", None, True),
    }


def write_set(out_dir, shared, name, spec, convs, n):
    path, loader, template_file, chat = spec
    tok = load_tokenizer(path, loader)
    header = {"set": name, "dir": os.path.relpath(path, shared), "loader": loader,
              "template": os.path.relpath(template_file, shared) if template_file else None,
              "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                           "jinja2": jinja2.__version__}}
    lines = []
    for case in completion_cases(convs, n):
        ids = tok.encode(completion_text(convs, case), add_special_tokens=True)
        lines.append({"completion": case, "n": len(ids), "ids": digest_ids(ids)})
    if chat:
        template = template_file.read_text(encoding="utf-8") if template_file else tok.chat_template
        for case in chat_cases(name, convs, n, template):
            req = case["request"] if "request" in case else sharegpt_request(convs, case)
            try:
                ids = vllm_apply(tok, template, req, tokenize=True)
                text = vllm_apply(tok, template, req, tokenize=False)
                lines.append({"case": case, "n": len(ids), "ids": digest_ids(ids), "text": digest_text(text)})
            except Exception as e:  # the template rejected it: Rust must reject it too
                lines.append({"case": case, "error": f"{type(e).__name__}: {e}"[:300]})
    tmp = out_dir / f".{name}.jsonl.gz.tmp"
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    tmp.rename(out_dir / f"{name}.jsonl.gz")
    return len(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("KINFERENCE_TOKENIZER_EXPECT_DIR"))
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared"))
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--sets", default=None)
    args = ap.parse_args()
    if not args.out:
        sys.exit("give --out or set KINFERENCE_TOKENIZER_EXPECT_DIR")
    shared = Path(args.shared).resolve()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    convs = load_sharegpt(shared)
    wanted = args.sets.split(",") if args.sets else None
    for name, spec in sets(shared).items():
        if wanted and name not in wanted:
            continue
        count = write_set(out_dir, shared, name, spec, convs, args.cases)
        print(f"{name}: {count} cases", flush=True)
    (out_dir / "COMPLETE").write_text(json.dumps({"cases": args.cases}) + "\n")


if __name__ == "__main__":
    main()
