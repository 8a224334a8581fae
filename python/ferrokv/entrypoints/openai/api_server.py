"""The OpenAI-compatible HTTP server: ``build_app(async_llm, ServerConfig)`` and ``run_server``
(``ferrokv serve``).

Every request first passes ``_Gate``, a plain ASGI layer: while the server drains it answers 503
(``/metrics`` stays open); with ``--api-key`` every path but the health checks and ``/metrics`` needs
``Authorization: Bearer KEY`` (compared with ``hmac.compare_digest``); a body larger than
``--max-body-bytes`` is a 413 before the endpoint sees it (the body is read once, up to the
limit, and replayed); requests in progress are counted for the drain. Outside it, CORS
(``--allowed-origins`` ..., vLLM's flags and defaults) answers browsers' preflights.

Invariants: every error is OpenAI's JSON ``{"error": {message, type, param, code}}``; user input
never causes a 500 (a 500 is a bug, logged with its traceback, its detail not sent); one request's
failure ends only its own engine requests. On SIGTERM/SIGINT the server drains: new requests get
503, requests in flight may finish for ``--drain-timeout`` seconds, the rest are aborted (their
streams end with finish_reason "abort"), then uvicorn stops and the process exits 0; a second
signal aborts them all at once (answered as aborted, for up to ``_STOP_GRACE_S`` seconds), a third
stops the server without waiting. What startup made (model, tokenizer, app) is frozen out of the
garbage collector's view (``gc.freeze``) before serving, so no full collection walks it mid-stream.
A connection whose request head does not come in time is closed (``connections``).
Costs: per request one body copy (at most ``--max-body-bytes``) and O(1) checks.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import re
import signal
import socket
import threading
import uuid
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from ferrokv import __version__
from ferrokv.checks import shown
from ferrokv.entrypoints.openai.connections import HeadTimeoutH11, raise_fd_limit
from ferrokv.entrypoints.openai.metrics import ServerMetrics
from ferrokv.entrypoints.openai.protocol import OpenAIError, error_body
from ferrokv.entrypoints.openai.protocol_tokenize import parse_detokenize_request, parse_tokenize_request
from ferrokv.entrypoints.openai.serving import ServerState, error_response, to_openai_error
from ferrokv.entrypoints.openai.serving_chat import create_chat_completion
from ferrokv.entrypoints.openai.serving_completion import create_completion
from ferrokv.entrypoints.openai.serving_responses import create_response, not_found
from ferrokv.entrypoints.openai.server_config import ServerConfig, body_limit
from ferrokv.entrypoints.openai.tool_parsers import check_tool_call_parser
from ferrokv.stats_log import LOG_STATS_INTERVAL_S

logger = logging.getLogger("ferrokv.serve")

__all__ = ["ServerConfig", "build_app", "run_server"]

_OPEN_PATHS = ("/health", "/ping", "/metrics", "/load")
_STATS_PERIOD = 0.5  # seconds: the most a /metrics gauge lags behind the engine while it is busy
_STOP_GRACE_S = 5.0  # seconds: after a second signal, for the aborted requests to send their last answer


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(OpenAIError(status, message, param)), status_code=status)


def _route_path(scope: Any) -> str:
    """The path the routes see: under ``--root-path`` (the app's root path, as vLLM sets it) a
    request's path with the prefix or without it (a proxy that strips it) is the same route
    (Starlette's rule: the prefix counts only when a ``/`` or the end follows it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


class _Gate:
    """The ASGI layer in front of the app (module docs)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        config = state.config
        self.app = app
        self.state = state
        self.limit = body_limit(config.max_body_bytes, state.llm.max_model_len)
        self.keys = tuple(k.encode() for k in config.api_keys())
        self.request_id_headers = config.enable_request_id_headers

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.request_id_headers:
            send = _with_request_id(scope, send)
        path = _route_path(scope)
        if self.state.draining and path != "/metrics":
            return await _error(503, "the server is shutting down")(scope, receive, send)
        if self.keys and path not in _OPEN_PATHS and not self._authorized(scope):
            response = _error(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        replay = receive
        if scope["method"] not in ("GET", "HEAD"):
            try:
                body = await self._read_body(scope, receive)
            except asyncio.CancelledError:
                if not self.state.draining:
                    raise
                # uvicorn's shutdown cancels a client still sending its body: answered, not a traceback.
                return await _error(503, "the server is shutting down")(scope, receive, send)
            if body is None:
                return await _error(413, f"the request body is larger than --max-body-bytes={self.limit}")(
                    scope, receive, send)
            replay = _replay(body, receive)
        if path in _OPEN_PATHS:
            return await self._serve(scope, replay, send)
        self.state.http_in_flight += 1
        try:
            await self._serve(scope, replay, send)
        finally:
            self.state.http_in_flight -= 1

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        """The app, with an unexpected error answered here as a JSON 500 (logged with its
        traceback): Starlette's own handler would answer and then re-raise it, and the server
        would drop the client's keep-alive connection."""
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started:
                raise  # the response is under way: nothing can be answered any more
            await error_response(e)(scope, receive, send)

    def _authorized(self, scope: Any) -> bool:
        got = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                got = value
        scheme, _, token = got.partition(b" ")
        token = token.strip()
        # Every key is compared (no early exit), so the time taken does not tell which one matched.
        matches = [hmac.compare_digest(token, key) for key in self.keys]
        return scheme.lower() == b"bearer" and any(matches)

    async def _read_body(self, scope: Any, receive: Any) -> bytes | None:
        """The whole body, or None when it is larger than the limit (by its declared length, or
        as read)."""
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    if int(value) > self.limit:
                        return None
                except ValueError:
                    pass  # a bad header: the body as read decides
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay


async def _json(request: Request) -> Any:
    # vLLM's rule: JSON bodies only. A text/plain or form POST is a CORS "simple request" that a
    # browser sends from any page without asking first; refusing it keeps such pages off the server.
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise OpenAIError(415, f"Unsupported Media Type: only 'application/json' is allowed "
                               f"(the request's Content-Type is {shown(content_type) if content_type else 'missing'})")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON ({type(e).__name__}: {shown(str(e))})") from None
    # Fewer opening brackets than the cap (nearly every body) cannot nest past it: no scan.
    depth = json_depth(raw) if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH else 0
    if depth > MAX_JSON_DEPTH:  # the checks and renderers after the parse recurse as deep
        raise OpenAIError(400, f"the request body nests {depth} levels of arrays and objects; at most "
                               f"{MAX_JSON_DEPTH} are allowed")
    return body


# Past any real request (a JSON schema deep enough for the grammar compiler to refuse by name
# included); well below the ~950 levels where the recursive checks after the parse overflow.
MAX_JSON_DEPTH = 640
# A string, or an unclosed one to the end (so no input makes the match start over and over).
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\Z)', re.S)


def json_depth(raw: bytes) -> int:
    """How deep ``raw``'s arrays and objects nest (brackets inside strings do not count), by array
    operations over the bytes (a body may be megabytes)."""
    b = np.frombuffer(_JSON_STRING.sub(b"", raw), dtype=np.uint8)
    steps = np.isin(b, (0x5B, 0x7B)).astype(np.int32) - np.isin(b, (0x5D, 0x7D))
    return int(np.cumsum(steps).max(initial=0))


def build_app(async_llm: Any, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``async_llm`` (the caller owns it: the app does not shut it down)."""
    if config.enable_auto_tool_choice:
        check_tool_call_parser(config.tool_call_parser, async_llm.tokenizer)
    state_box: dict[str, ServerState] = {}
    metrics = ServerMetrics(async_llm, config.served_model_name, lambda: state_box["s"].http_in_flight,
                            async_llm.engine.cache_config.metrics_info())
    # The engine's reasoning parser: chat answers' reasoning is told apart.
    state = ServerState(async_llm, metrics, config, reasoning=async_llm.engine.reasoning)
    state_box["s"] = state
    app = FastAPI(title="ferrokv", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.root_path = config.root_path  # as vLLM sets it (the constructor's argument is deprecated)
    app.state.ferrokv = state
    _errors(app)
    _routes(app, state)
    # Inside Starlette's own error middleware, so that an error in the gate still answers JSON.
    app.add_middleware(_Gate, state=state)
    # Outermost: a browser's preflight is answered before the gate, and every answer (a 401 too)
    # carries the CORS headers.
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)
    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path!r}",
                   405: f"method {request.method} is not allowed on {request.url.path!r}"}.get(e.status_code, e.detail)
        return JSONResponse(error_body(OpenAIError(e.status_code, str(message))), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {shown(e.errors())}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return error_response(e)


def _model_routes(app: FastAPI, state: ServerState) -> None:
    """``/v1/models`` and OpenAI's retrieve, ``/v1/models/{id}`` (ids may hold '/'; with no id,
    the list, where vLLM's redirects to it)."""
    llm = state.llm
    # vLLM's root: the model as given to the server (its path or Hub id), whatever it is served as.
    root = llm.engine.args.model or state.model_names[0]  # the default model: its served name
    # vLLM's model card, its permission entry included (clients written against vLLM read it).
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": state.created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "ferrokv", "root": root,
                "parent": None, "max_model_len": llm.max_model_len, "permission": [permission]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(name) for name in state.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if not model_id:
            return await models()
        if model_id not in state.model_names:
            state.check_model(model_id)  # the 404 naming the served models
        return card(model_id)


def _routes(app: FastAPI, state: ServerState) -> None:
    llm = state.llm

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            return _error(503, "the engine is not running")
        return Response(status_code=200)

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) health check

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")
    async def load() -> dict[str, int]:  # vLLM's: 0 unless --enable-server-load-tracking
        return {"server_load": state.http_in_flight if state.config.enable_server_load_tracking else 0}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.render(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    _model_routes(app, state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await create_completion(request, state, await _json(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await create_chat_completion(request, state, await _json(request))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        return await create_response(request, state, await _json(request))

    async def stored_response(response_id: str) -> Any:
        return not_found(response_id)  # nothing is stored, as vLLM by default

    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", stored_response, methods=["POST"])

    @app.post("/invocations")
    async def invocations(request: Request) -> Any:
        """vLLM's (SageMaker's) one inference route: a chat request if the body has messages, else
        a completion request if it has a prompt."""
        body = await _json(request)
        if isinstance(body, dict) and "messages" in body:
            return await create_chat_completion(request, state, body)
        if not isinstance(body, dict) or "prompt" in body:  # completions names what is wrong with it
            return await create_completion(request, state, body)
        raise OpenAIError(400, "an /invocations body is a chat request (with messages) or a completion "
                               "request (with prompt); it has neither")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        req = parse_tokenize_request(await _json(request))
        state.check_model(req.model)
        template = state.template_for(req.template) if req.messages is not None else {}
        try:
            if req.messages is not None:
                ids = await llm.encode_chat(req.messages, req.add_generation_prompt, **template)
            else:
                ids = await llm.tokenize_text(req.prompt, req.add_special_tokens)
        except ValueError as e:  # a chat error names its field first (messages, chat_template, ...)
            raise (to_openai_error(e) if req.messages is not None else OpenAIError(400, str(e), "prompt")) from None
        strs = llm.engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        req = parse_detokenize_request(await _json(request), llm.engine.vocab_size)
        state.check_model(req.model)
        return {"prompt": await llm.decode(req.tokens)}


# ------------------------------------------------------------------------------------------------
# The process
class _Server(uvicorn.Server):
    """uvicorn, with the drain on the first SIGTERM/SIGINT (module docs) and exit status 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future[None] | None = None
        self._stopping = False  # a second signal came: everything is being aborted

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(self._keep_stats_fresh())]
        if not self._state.llm.engine.args.disable_log_stats:
            tasks.append(asyncio.ensure_future(self._log_stats()))
        try:
            await super().serve(sockets)
        finally:
            for task in tasks:
                task.cancel()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if sockets is not None and self.started:  # uvicorn logs its line only for sockets it bound itself
            self._log_started_message(sockets)

    async def _keep_stats_fresh(self) -> None:
        # LLMEngine.stats() serves, while a step runs, the snapshot taken at the end of the step
        # after the previous call: asking twice a second keeps /metrics' gauges that fresh.
        while True:
            self._state.llm.stats()
            await asyncio.sleep(_STATS_PERIOD)

    async def _log_stats(self) -> None:
        while True:  # vLLM's stats line (ferrokv.stats_log), as its server logs it
            await asyncio.sleep(LOG_STATS_INTERVAL_S)
            await self._state.llm.do_log_stats()

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not uvicorn's: it would re-raise the signal after the shutdown (exit status -15).
        if self._loop is None or self._stopping:
            logger.warning("signal %s: stopping now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        if self._state.draining:
            # Stop now, yet cleanly: every request ends as aborted (streams with finish_reason
            # "abort" and [DONE]) within a step or so. uvicorn's force exit would cancel their
            # tasks mid-answer (500s, cut streams); a third signal still does that.
            self._stopping = True
            logger.warning("second signal %s: aborting %d request(s) in flight and stopping",
                           signal.Signals(sig).name, self._state.http_in_flight)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._abort_then_exit(_STOP_GRACE_S)))
            return
        self._state.draining = True
        logger.info("signal %s: draining (new requests get 503; %d in flight, up to %gs)",
                    signal.Signals(sig).name, self._state.http_in_flight, self._drain_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _wait_idle(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._state.http_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)  # a server-side poll of a counter, 20 times a second

    async def _drain_then_exit(self) -> None:
        try:
            await self._wait_idle(self._drain_timeout)
            if self._state.http_in_flight and not self._stopping:
                logger.warning("drain timeout: aborting %d request(s) still in flight", self._state.http_in_flight)
                await self._abort_then_exit(10.0)  # each ends within one engine step
        finally:
            self.should_exit = True

    async def _abort_then_exit(self, grace: float) -> None:
        try:
            self._state.llm.abort_all()
            await self._wait_idle(grace)
        finally:
            self.should_exit = True


def _with_request_id(scope: Any, send: Any) -> Any:
    """``send`` that adds ``X-Request-Id`` to the response: the request's own (h11 has checked its
    bytes), else a new one (vLLM's ``--enable-request-id-headers``)."""
    given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
    request_id = given or uuid.uuid4().hex.encode()

    async def tagged(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
        await send(message)

    return tagged


def run_server(llm: Any, config: ServerConfig, exits_after: bool = False,
               listener: socket.socket | None = None) -> int:
    """Serves ``llm`` until a signal drains and stops the server; returns the exit status.
    ``exits_after``: the process ends once this returns (``ferrokv serve``), so signals that come
    during the teardown are handled for good (``_signals_during_teardown``). ``listener``: a socket
    bound to ``config``'s address (``ferrokv serve`` binds it before the model loads); None:
    uvicorn binds it."""
    try:
        app = build_app(llm, config)
    except BaseException:
        llm.shutdown()  # a configuration the model cannot serve (a ValueError naming the flag)
        raise
    raise_fd_limit()
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, uds=config.uds,
                               log_level=config.uvicorn_log_level, access_log=config.uvicorn_access_log,
                               http=HeadTimeoutH11, ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                               ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs,
                               h11_max_incomplete_event_size=config.h11_max_incomplete_event_size,
                               timeout_graceful_shutdown=5, lifespan="off",
                               **({"log_config": config.log_config_file} if config.log_config_file else {}))
    server = _Server(uv_config, app.state.ferrokv, config.drain_timeout)
    host = f"[{config.host}]" if ":" in config.host else config.host  # an IPv6 address, as a URL writes it
    port = config.port or "<a free port, see uvicorn's line>"
    if listener is not None and config.uds is None:
        port = listener.getsockname()[1]
    where = f"{host}:{port}" if config.uds is None else f"unix:{config.uds}"
    scheme = "https" if config.ssl_certfile else "http"
    logger.info("serving %r on %s://%s%s (API key %s)", config.served_model_name, scheme, where, config.root_path,
                "required" if config.api_keys() else "off")
    try:
        _freeze_startup_heap()
        server.run(sockets=None if listener is None else [listener])
    finally:
        if exits_after:
            _signals_during_teardown()
        llm.shutdown()
    return 0


def _signals_during_teardown() -> None:
    """Once the server stopped, uvicorn's signal handlers are gone: a further Ctrl-C or SIGTERM
    (a second press is common) would land in the engine's shutdown or the interpreter's teardown,
    as a traceback or the process killed by the signal. The first is told and ignored, so the
    process still exits 0; the next exits at once (128 + the signal), with no traceback."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return
    seen: list[int] = []

    def handler(sig: int, frame: Any) -> None:
        if seen:
            os._exit(128 + sig)
        seen.append(sig)
        logger.warning("signal %s: the server is stopping already (another signal exits at once)",
                       signal.Signals(sig).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _freeze_startup_heap() -> None:
    """The model, the tokenizer and the app live as long as the process. A full collection walks
    every tracked object (the tokenizer's alone are hundreds of thousands), stalling every
    stream: as vLLM does, what startup made leaves the collector's view. A Ctrl-C or SIGTERM during
    the collection would land in a finalizer or weakref callback, where Python drops what its
    handler raises: it is held until the collection is done, then sent again to the handler."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        gc.collect()
        gc.freeze()
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, frame: held.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        gc.collect()
        gc.freeze()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        signal.raise_signal(held[0])
