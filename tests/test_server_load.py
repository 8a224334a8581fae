"""Load on `ferrokv serve`: 200 concurrent streaming requests (httpx.AsyncClient), short
max_tokens, completions and chat mixed, prompts sharing prefixes (so aborted requests share
prefix-cache blocks with running ones), and a KV cache too small for all of them at once (so
requests wait and may be preempted). A seeded 25 % of the clients disconnect at a random point:
before the response starts, right after the headers, or after a random number of events.

Afterwards: every other request was answered (200, its stream ended with [DONE], one "length"
finish per choice -- a tenth ask for n=2 -- and usage right when asked for), no disconnect raised
anything in the server (no traceback in its log), the server still answers, and /metrics reaches
0 running, 0 waiting and every block free (polled: aborts are applied in the engine's next step).
A second test checks that a disconnect really aborts a long request, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from helpers.server import metric_values, serve, sse_events, wait_for_metrics

MODEL = "tiny-load"
SEED = 1313
NUM_CLIENTS = 200
DISCONNECT_FRACTION = 0.25
TIMEOUT = httpx.Timeout(300.0, connect=60.0)
MAX_MODEL_LEN = 512
PREFIXES = [
    "The cat runs the red ball today. " * 3,
    "A dog sees the blue sky in Paris. " * 3,
    "Our model samples many tokens with joy. " * 3,
    "Le café owner likes crème brûlée 中文 🚀. " * 2,
]


@dataclass(slots=True)
class Plan:
    index: int
    path: str
    body: dict[str, Any]
    cut: str | None  # None: read to the end; "time": cancel at a random moment; "headers"; "events"
    cut_after_events: int = 0
    cut_after_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    plan: Plan
    status: int | None = None
    events: list[str] | None = None
    cut: bool = False  # the client disconnected as planned before the stream ended


def make_plans(rng: random.Random) -> list[Plan]:
    cutters = set(rng.sample(range(NUM_CLIENTS), int(NUM_CLIENTS * DISCONNECT_FRACTION)))
    plans = []
    for i in range(NUM_CLIENTS):
        max_tokens = rng.randint(4, 12)
        text = rng.choice(PREFIXES) + f"Item {i}."
        common = {"model": MODEL, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "seed": i,
                  "stream": True, "ignore_eos": True}
        if rng.random() < 0.5:
            common["stream_options"] = {"include_usage": True}
        if rng.random() < 0.1:
            common["n"] = 2  # forked sequences share the prompt's blocks: aborts must free both
        if i % 2:
            path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
        else:
            path, body = "/v1/completions", {**common, "prompt": text}
        plan = Plan(i, path, body, None)
        if i in cutters:
            plan.cut = rng.choice(["time", "headers", "events", "events"])
            plan.cut_after_events = rng.randint(1, max_tokens)
            plan.cut_after_s = rng.uniform(0.0, 0.5)
        plans.append(plan)
    return plans


async def read_stream(client: httpx.AsyncClient, plan: Plan, out: Outcome) -> None:
    async with client.stream("POST", plan.path, json=plan.body) as resp:
        out.status = resp.status_code
        out.events = []
        if plan.cut == "headers":
            out.cut = True
            return  # leaving the block closes the connection with the body unread
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                out.events.append(line)
                if plan.cut == "events" and len(out.events) >= plan.cut_after_events:
                    out.cut = sse_events(out.events)[-1:] != ["[DONE]"]
                    return


async def run_client(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    out = Outcome(plan)
    if plan.cut == "time":
        # A random disconnect point, not a synchronisation: whatever state the request is in then.
        try:
            await asyncio.wait_for(read_stream(client, plan, out), timeout=plan.cut_after_s)
        except TimeoutError:
            out.cut = True
    else:
        await read_stream(client, plan, out)
    return out


def check_answered(out: Outcome) -> str | None:
    """None if ``out`` is a complete, well-formed answer, else what is wrong with it."""
    plan = out.plan
    if out.status != 200:
        return f"status {out.status}"
    events = sse_events(out.events or [])
    if events[-1:] != ["[DONE]"]:
        return f"no [DONE] (last events {events[-2:]})"
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = [c["finish_reason"] for ch in chunks for c in ch.get("choices", []) if c.get("finish_reason")]
    n = plan.body.get("n", 1)
    if reasons != ["length"] * n:
        return f"finish reasons {reasons}"
    usage = [ch["usage"] for ch in chunks if ch.get("usage")]
    if "stream_options" in plan.body:
        if len(usage) != 1 or usage[0]["completion_tokens"] != n * plan.body["max_tokens"]:
            return f"usage {usage} for max_tokens {plan.body['max_tokens']}"
    elif usage:
        return f"usage without include_usage: {usage}"
    return None


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # 96 blocks of 16 tokens: room for about 30 of the 200 requests at once.
    with serve(tiny_model_dir("llama-serve"), "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
               "--num-kv-blocks", "96") as s:
        yield s


def test_200_concurrent_streams_with_disconnects(server):
    plans = make_plans(random.Random(SEED))

    async def main() -> list[Outcome]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 20, max_keepalive_connections=20)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as client:
            return await asyncio.gather(*(run_client(client, p) for p in plans))

    outcomes = asyncio.run(main())
    problems = []
    for out in outcomes:
        if out.cut:
            if out.status not in (None, 200):
                problems.append(f"client {out.plan.index} (disconnecting): status {out.status}")
            continue
        why = check_answered(out)
        if why:
            problems.append(f"client {out.plan.index} {out.plan.path}: {why}")
    assert not problems, f"{len(problems)} bad answers:\n" + "\n".join(problems[:20])
    assert sum(o.cut for o in outcomes) > 0, "no client disconnected: the test lost its point"

    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "The cat", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    values = wait_for_metrics(server.url, _idle, timeout=120)
    assert values["ferrokv:num_blocks"] > 0
    log = server.stderr()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:][:6000]


def _idle(m: dict[str, float]) -> bool:
    return (m["ferrokv:num_requests_running"] == 0 and m["ferrokv:num_requests_waiting"] == 0
            and m["ferrokv:num_free_blocks"] == m["ferrokv:num_blocks"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_aborts_a_long_request(server, stream):
    """A client that goes away mid-request gets its request aborted, streamed or not: the engine
    stops generating for it (far fewer than its max_tokens tokens are generated) and frees its blocks."""
    max_tokens = MAX_MODEL_LEN - 16  # seconds of decoding on a CPU; the abort must come well before
    body = {"model": MODEL, "prompt": "The cat runs", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    before = wait_for_metrics(server.url, _idle, timeout=120)["ferrokv:generation_tokens_total"]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            if stream:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            break  # leaving the block closes the connection mid-stream
                return
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            # Disconnect once the request runs (polled; the task is the request, not a timer).
            deadline = asyncio.get_running_loop().time() + 120
            while True:
                if metric_values((await client.get("/metrics")).text)["ferrokv:num_requests_running"] >= 1:
                    break
                assert not task.done(), "the request ended before it could be disconnected"
                assert asyncio.get_running_loop().time() < deadline, "the request never ran"
                await asyncio.sleep(0.02)  # poll interval
            task.cancel()  # closes its connection
            try:
                await task
            except asyncio.CancelledError:
                pass

    asyncio.run(main())
    after = wait_for_metrics(server.url, _idle, timeout=120)["ferrokv:generation_tokens_total"]
    assert after - before < max_tokens, f"the disconnected request generated {after - before} of {max_tokens} tokens"
