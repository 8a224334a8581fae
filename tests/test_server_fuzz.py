"""Fuzzing `ferrokv serve`: a few hundred seeded random and mutated JSON bodies against POST
/v1/completions, /v1/chat/completions, /tokenize and /detokenize. None may get a 5xx or lose its
connection; every non-2xx answer is an OpenAI-shaped error; every stream ends with [DONE]. A
valid greedy request interleaved every few bodies must keep its exact answer (one bad request
never affects another), and afterwards the server answers and holds no request and no block.

Bodies: typed random JSON (any shape), a valid body with one field replaced by an "interesting"
value, deleted, or joined by an unknown field, and byte-level mutations of valid bodies
(truncations, flips, insertions: mostly malformed JSON, some invalid UTF-8, NaN/Infinity).
Cost: most answers are 400s in milliseconds; valid ones generate <= the 64-token context.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest
from helpers.server import assert_openai_error, serve, sse_events, wait_for_metrics

MODEL = "tiny-fuzz"
SEED = 20261201
NUM_BODIES = 320
CHECK_EVERY = 40
TIMEOUT = httpx.Timeout(120.0, connect=30.0)

PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

INTERESTING: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 5, 17, 2 ** 31, -(2 ** 31), 2 ** 63, 2 ** 64 + 1, 10 ** 30, 0.0, -0.0, 0.5,
    1.5, -2.5, 1e-9, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), "", "x", "0", "true", "null",
    "\u0000", "\ud800", "é中🚀", "a" * 3000, [], [1, 2], [-1], [10 ** 9], ["a", ""], [[1, 2]], [None], {},
    {"a": 1}, {"include_usage": True}, {"role": "user", "content": "hi"}, [{"role": "user", "content": "hi"}],
    [{"role": "user"}], [{"role": "user", "content": None}], [{"content": "hi"}], [{"role": 3, "content": "x"}],
    MODEL, "no-such-model",
    # response_format, structured_outputs, guided_*, logit_bias, bad_words values
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {}}}}},
    {"regex": "[0-9]+"}, {"choice": ["a", "b"]}, {"json": {"type": "integer"}}, {"grammar": "start: \"x\""},
    {"json_object": True}, "[a-", ["a", "b"], {"type": "string", "maxLength": 3}, {"5": 100}, {"5": -1e9}, {"x": 1},
    ["the"],
]

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
          "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty",
          "frequency_penalty", "user", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
          "cache_salt", "priority", "tokens", "add_special_tokens", "echo", "suffix", "best_of", "logit_bias",
          "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_whitespace_pattern", "allowed_token_ids", "bad_words", "prompt_logprobs"]


def valid_body(path: str, rng: random.Random) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": rng.choice(["The cat", "A dog runs", [5, 6, 7]]), "max_tokens": 3,
                "temperature": rng.choice([0, 0.7]), "stream": rng.random() < 0.3}
    if path == "/v1/chat/completions":
        return {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(["hi", "Le café"])}],
                "max_tokens": 3, "temperature": 0, "stream": rng.random() < 0.3}
    if path == "/tokenize":
        return {"model": MODEL, "prompt": rng.choice(["The cat", "中文 🚀"])}
    return {"model": MODEL, "tokens": [rng.randrange(400) for _ in range(rng.randrange(1, 6))]}


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(INTERESTING)
    if kind == 1:
        return rng.randint(-10 ** 6, 10 ** 6)
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.uniform(-1e3, 1e3)
    if kind == 4:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = FIELDS if kind == 5 else [f"k{i}" for i in range(5)]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def _dumps(body: Any) -> bytes:
    # allow_nan: NaN/Infinity are not JSON, but Python's own parser accepts them, so servers see them.
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


def mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(pos, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[pos:]
        elif op == 2:
            data[pos:pos] = rng.choice([b"{", b"}", b"[", b'"', b",", b":", b"\\", b"\xff", b"\xc3", b"NaN", b"-",
                                         b"1e999", b"\x00", b" null"])
        else:
            del data[pos:pos + rng.randint(1, 8)]
    return bytes(data)


def make_body(path: str, rng: random.Random) -> bytes:
    mode = rng.randrange(4)
    if mode == 0:
        return _dumps(random_json(rng))
    body = valid_body(path, rng)
    if mode == 1:
        body[rng.choice(FIELDS)] = rng.choice(INTERESTING)
        return _dumps(body)
    if mode == 2:
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.5 and body:
                body.pop(rng.choice(list(body)))
            else:
                body[rng.choice(FIELDS)] = random_json(rng)
        return _dumps(body)
    return mutate_bytes(_dumps(body), rng)


def check_response(resp: httpx.Response, streamed_lines: list[str] | None, raw: bytes) -> None:
    where = f"body {raw[:300]!r}"
    assert resp.status_code < 500, f"{resp.status_code} for {where}: {resp.text[:1000]}"
    if resp.status_code >= 400:
        assert_openai_error(resp, resp.status_code)
        return
    assert resp.status_code == 200, where
    if streamed_lines is not None:
        events = sse_events(streamed_lines)
        assert events and events[-1] == "[DONE]", f"stream did not end with [DONE] for {where}: {events[-3:]}"
        for e in events[:-1]:
            payload = json.loads(e)
            assert "error" not in payload, f"error inside a 200 stream for {where}: {e}"
    else:
        assert isinstance(resp.json(), dict), where


def send(client: httpx.Client, path: str, raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    try:
        with client.stream("POST", path, content=raw, headers=headers) as resp:
            is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            lines = list(resp.iter_lines()) if is_sse else None
            if not is_sse:
                resp.read()
            check_response(resp, lines, raw)
    except httpx.TransportError as e:
        raise AssertionError(f"connection lost on {path} with body {raw[:300]!r}: {e!r}") from e


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve(tiny_model_dir("llama-serve"), "--served-model-name", MODEL, "--max-model-len", "64") as s:
        yield s


def test_fuzzed_bodies_never_5xx(server):
    rng = random.Random(SEED)
    probe = {"model": MODEL, "prompt": "The cat runs", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        baseline = client.post("/v1/completions", json=probe)
        assert baseline.status_code == 200, baseline.text
        expected = baseline.json()["choices"][0]["text"]
        for i in range(NUM_BODIES):
            path = PATHS[i % len(PATHS)]
            send(client, path, make_body(path, rng))
            if (i + 1) % CHECK_EVERY == 0:
                again = client.post("/v1/completions", json=probe)
                assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected, \
                    f"after {i + 1} fuzzed bodies: {again.status_code} {again.text[:500]}"
        assert client.get("/health").status_code == 200
    wait_for_metrics(server.url, lambda m: m["ferrokv:num_requests_running"] == 0
                     and m["ferrokv:num_requests_waiting"] == 0
                     and m["ferrokv:num_free_blocks"] == m["ferrokv:num_blocks"], timeout=120)


def test_fuzzed_bodies_concurrently(server):
    """The same kind of bodies 8 at a time: errors in one request never disturb the others."""
    async def worker(client: httpx.AsyncClient, k: int) -> None:
        rng = random.Random(SEED + 1 + k)
        for i in range(12):
            path = PATHS[(i + k) % len(PATHS)]
            raw = make_body(path, rng)
            try:
                async with client.stream("POST", path, content=raw,
                                         headers={"content-type": "application/json"}) as resp:
                    is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
                    lines = [line async for line in resp.aiter_lines()] if is_sse else None
                    if not is_sse:
                        await resp.aread()
                    check_response(resp, lines, raw)
            except httpx.TransportError as e:
                raise AssertionError(f"connection lost on {path} with body {raw[:300]!r}: {e!r}") from e

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            await asyncio.gather(*(worker(client, k) for k in range(8)))

    asyncio.run(main())
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2})
        assert r.status_code == 200, r.text


ODD_FRAMING: list[tuple[dict[str, str], bytes]] = [
    ({}, b'{"model": "tiny-fuzz", "prompt": "hi", "max_tokens": 2}'),  # no content-type
    ({"content-type": "text/plain"}, b'{"model": "tiny-fuzz", "prompt": "hi", "max_tokens": 2}'),
    ({"content-type": "multipart/form-data; boundary=x"}, b"--x\r\n\r\nhi\r\n--x--"),
    ({"content-type": "application/json", "content-encoding": "gzip"}, b"\x1f\x8b not really gzip"),
    ({"content-type": "application/json"}, '{"model": "tiny-fuzz", "prompt": "hi"}'.encode("utf-16")),
    ({"content-type": "application/json"}, b"[" * 50000 + b"]" * 50000),  # nesting deeper than the recursion limit
    ({"content-type": "application/json"}, b'{"a": ' * 20000 + b"1" + b"}" * 20000),
    ({"content-type": "application/json"}, b'{"model": "tiny-fuzz", "prompt": "' + b"\\u0000" * 5 + b'"}'),
    ({"content-type": "application/json"}, b'{"model": "tiny-fuzz", "prompt": "hi", "prompt": 5}'),  # duplicate key
]


@pytest.mark.parametrize("path", PATHS)
def test_odd_framing_never_5xx(server, path):
    """Content types, encodings and nesting a JSON parser can trip on: never a 5xx nor a lost connection."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        for headers, raw in ODD_FRAMING:
            try:
                resp = client.post(path, content=raw, headers=headers)
            except httpx.TransportError as e:
                raise AssertionError(f"connection lost on {path} with {headers} {raw[:80]!r}: {e!r}") from e
            check_response(resp, None, raw)
        assert client.get("/health").status_code == 200
