"""The official openai SDK against a running `kinference sim` replica.

usage: python sim_clients_openai.py BASE_URL MODEL

Completions and chat, plain and streaming (with usage), n > 1, stop strings, logprobs and
the errors the SDK maps to exceptions. Every check is an assert: the first failure exits
non-zero with its message. Prints one line per check that passed.
"""

import sys

import openai

BASE, MODEL = sys.argv[1], sys.argv[2]
PROMPT = (
    "The router keeps a map from block hashes to the servers that hold them. When a new "
    "request arrives it tokenizes the prompt, splits it into blocks and hashes every block "
    "together with its parent. Which server caches the longest prefix?"
)
client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=60)
passed = 0


def ok(what: str) -> None:
    global passed
    passed += 1
    print(f"ok  {what}")


def check_usage(u, completion_tokens: int) -> None:
    assert u is not None, "no usage"
    assert u.prompt_tokens > 0, u
    assert u.completion_tokens == completion_tokens, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    assert u.prompt_tokens_details is not None, u
    assert u.prompt_tokens_details.cached_tokens >= 0, u


models = [m.id for m in client.models.list()]
assert MODEL in models, models
ok(f"models.list -> {models}")

first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
assert first.object == "text_completion", first
assert first.choices[0].text.strip(), first
assert first.choices[0].finish_reason == "length", first
check_usage(first.usage, 8)
again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
cached = again.usage.prompt_tokens_details.cached_tokens
assert cached > 0 and cached < again.usage.prompt_tokens, again.usage
ok(f"completions: {first.usage.prompt_tokens} prompt tokens, {cached} cached on repeat")

chunks = list(
    client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
)
text_chunks = [c for c in chunks if c.choices]
assert len(text_chunks) == 6, chunks
assert text_chunks[-1].choices[0].finish_reason == "length", text_chunks[-1]
assert "".join(c.choices[0].text for c in text_chunks).strip()
check_usage(chunks[-1].usage, 6)
ok(f"completions stream: {len(text_chunks)} token chunks + usage")

messages = [
    {"role": "system", "content": "You answer questions about caches."},
    {"role": "user", "content": PROMPT},
]
chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
assert chat.object == "chat.completion", chat
assert chat.choices[0].message.role == "assistant", chat
assert chat.choices[0].message.content.strip(), chat
check_usage(chat.usage, 5)
ok("chat completions")

stream = client.chat.completions.create(
    model=MODEL,
    messages=messages,
    max_tokens=4,
    stream=True,
    stream_options={"include_usage": True},
)
parts, roles, usage, finish = [], [], None, None
for c in stream:
    if c.usage is not None:
        usage = c.usage
    for ch in c.choices:
        if ch.delta.role:
            roles.append(ch.delta.role)
        if ch.delta.content:
            parts.append(ch.delta.content)
        if ch.finish_reason:
            finish = ch.finish_reason
assert roles == ["assistant"], roles
assert len(parts) == 4 and "".join(parts).strip(), parts
assert finish == "length", finish
check_usage(usage, 4)
assert usage.prompt_tokens_details.cached_tokens > 0, usage
ok("chat stream: role, 4 content chunks, usage with cached tokens")

multi = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=3)
assert sorted(c.index for c in multi.choices) == [0, 1, 2], multi
check_usage(multi.usage, 9)
ok("n=3: three choices, usage counts all")

probe = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                  extra_headers={"X-Request-Id": "sdk-stop"})
words = probe.choices[0].text.split()
stop = " " + words[5]
cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=[stop],
                                extra_headers={"X-Request-Id": "sdk-stop"})
c = cut.choices[0]
assert c.finish_reason == "stop", c
assert c.text == probe.choices[0].text[: probe.choices[0].text.find(stop)], (c.text, stop)
ok(f"stop={stop!r}: text cut before it, finish_reason stop")

lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=2)
l = lp.choices[0].logprobs
assert len(l.tokens) == 3 and "".join(l.tokens) == lp.choices[0].text, l
assert all(x <= 0 for x in l.token_logprobs), l
assert all(len(t) == 2 for t in l.top_logprobs), l
clp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                     logprobs=True, top_logprobs=3)
content = clp.choices[0].logprobs.content
assert len(content) == 2 and all(len(x.top_logprobs) == 3 for x in content), content
ok("logprobs: completions top-2, chat top-3")

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    assert "does not exist" in str(e), e
try:
    client.completions.create(model=MODEL, prompt=PROMPT * 400, max_tokens=1)
    raise AssertionError("over-long prompt accepted")
except openai.BadRequestError as e:
    assert "maximum context length" in str(e), e
ok("errors: NotFoundError, BadRequestError")

print(f"openai {openai.__version__}: {passed} passed, 0 failed")
