"""``ferrokv serve``: its own flags (defaults from ``ServerConfig``) and the command, which checks
every flag it can before the model loads (files, TLS, the chat template's syntax, the address)
and then runs the OpenAI-compatible server (``ferrokv.entrypoints.openai.api_server``).

Invariants: a bad flag is a ``ValueError`` naming it (``ferrokv.cli`` prints it, status 2), raised
before torch is imported; importing this module imports neither torch nor the server.
Costs: startup only.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
from typing import Any

from ferrokv.chat_content_format import CONTENT_FORMATS
from ferrokv.cli import _json_object, _json_strings, add_engine_flags, human_readable_int
from ferrokv.engine_args import EngineArgs, help_with_default
from ferrokv.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from ferrokv.inputs import template_kwargs

__all__ = ["serve", "serve_flags"]


def _http_flags(g: Any, d: Any) -> None:
    """``serve``'s HTTP flags: the path prefix, TLS, CORS, request id headers, vLLM's no-ops."""
    g.add_argument("--root-path", default=d.root_path, metavar="PATH",
                   help="the path prefix a proxy serves the server under; requests are served with or without it "
                        "(default: none)")
    for flag, already in (("--disable-fastapi-docs", "no /docs, /redoc or /openapi.json is served"),
                          ("--enable-prompt-tokens-details", "usage always has prompt_tokens_details"),
                          ("--disable-frontend-multiprocessing", "the server and the engine share one process")):
        g.add_argument(flag, action="store_true", help=f"vLLM's flag, accepted: {already} (default: always so)")
    for name, what in (("keyfile", "the TLS private key"), ("certfile", "the TLS certificate: serve HTTPS"),
                       ("ca-certs", "CA certificates that verify clients' certificates")):
        g.add_argument(f"--ssl-{name}", default=None, metavar="FILE", help=f"{what} (default: none)")
    g.add_argument("--ssl-cert-reqs", type=int, default=d.ssl_cert_reqs, metavar="N",
                   help="whether clients must show a certificate --ssl-ca-certs verifies: 0 no, 1 optional, 2 "
                        "required (Python's ssl.CERT_*) (default: 0)")
    g.add_argument("--h11-max-incomplete-event-size", type=human_readable_int, default=None, metavar="BYTES",
                   help="the largest request head still being received that is accepted; a larger one gets 400 "
                        "(default: h11's 16 KiB)")
    g.add_argument("--log-config-file", default=None, metavar="FILE",
                   help="a logging configuration (JSON, YAML or INI, as uvicorn reads it) for the server's and "
                        "uvicorn's loggers (default: none)")
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        g.add_argument(f"--allowed-{name}", type=_json_strings, default=getattr(d, f"allowed_{name}"), metavar="JSON",
                       help=f"CORS: the {what} browsers may use, a JSON list (default: [\"*\"], any)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (default: off)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer every request with an X-Request-Id header: the client's own, else a new id "
                        "(default: off)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:N' unless a request says otherwise (default: off)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with its usage, as if it asked stream_options.include_usage (default: off)")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load counts the generation requests being served (default: off: it says 0)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="a chat with tool_choice 'none' shows its template no tools (default: off: the tools reach it)")
    g.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix domain socket instead of --host/--port (default: none)")
    g.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="vLLM's count of API server processes: ferrokv serves from one, so only 1 is accepted "
                        "(default: 1)")


def serve_flags(p: argparse.ArgumentParser) -> None:
    """``serve``'s own flags; their defaults are ``ServerConfig``'s."""
    from ferrokv.entrypoints.openai.server_config import BODY_BYTES_PER_TOKEN, ServerConfig

    d = ServerConfig()
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (default: the embedded SmolLM2-135M-Instruct)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host,
                   help=help_with_default("address to listen on; 0.0.0.0 exposes the server to the network",
                                          d.host))
    g.add_argument("--port", type=int, default=d.port,
                   help=help_with_default("TCP port to listen on", d.port))
    g.add_argument("--api-key", default=None, nargs="+", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (any of the keys given) on every path but the health "
                        "checks, /metrics and /load (default: none, else $FERROKV_API_KEY, else $VLLM_API_KEY)")
    g.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="the model name(s) clients may send; a response shows the first, as vLLM's (default: the model "
                        "argument)")
    g.add_argument("--max-body-bytes", type=human_readable_int, default=d.max_body_bytes,
                   help=f"largest request body accepted; larger ones get 413 (default: {BODY_BYTES_PER_TOKEN} "
                        "bytes per token of max_model_len, at least 1 MiB)")
    g.add_argument("--max-waiting-requests", type=human_readable_int, default=d.max_waiting_requests,
                   help=help_with_default("sequences (prompts x n) accepted beyond the max_num_seqs running ones; more get 503",
                                          d.max_waiting_requests))
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help=help_with_default("seconds requests in flight may run on after SIGTERM/SIGINT before "
                                          "they are aborted", d.drain_timeout))
    g.add_argument("--log-prompts", "--enable-log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters (default: off)")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="log each request's outputs (each choice's text and finish reason) as they finish "
                        "(default: off)")
    g.add_argument("--max-log-len", type=human_readable_int, default=d.max_log_len, metavar="N",
                   help="characters of a prompt --log-prompts logs, or of an output --enable-log-outputs logs "
                        "(default: all)")
    g.add_argument("--response-role", default=d.response_role, metavar="ROLE",
                   help=help_with_default("the role of chat answers (a chat that continues its last message: that "
                                          "message's)", d.response_role))
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="keyword arguments every chat's template gets, under the request's own "
                        "chat_template_kwargs, e.g. '{\"enable_thinking\": false}' (default: none)")
    g.add_argument("--disable-log-requests", dest="log_prompts", action="store_false",
                   help="vLLM's older flag: requests are not logged (default: not logged)")
    g.add_argument("--uvicorn-log-level", choices=_UVICORN_LEVELS, default=d.uvicorn_log_level,
                   help=help_with_default("uvicorn's log level", d.uvicorn_log_level))
    g.add_argument("--uvicorn-access-log", dest="uvicorn_access_log", action="store_true",
                   default=d.uvicorn_access_log, help="log a line per HTTP request (default: off)")
    g.add_argument("--disable-uvicorn-access-log", dest="uvicorn_access_log", action="store_false",
                   help="vLLM's flag: no line per HTTP request (default: no lines)")
    _http_flags(g, d)
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent in a request (default: off, such requests get 400: a "
                        "template is code the server runs, sandboxed, but free to spend its CPU and memory)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template chats use instead of the tokenizer's: a file, or the template "
                        "itself (default: the tokenizer's)")
    g.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default=d.chat_template_content_format,
                   help=help_with_default("how the template reads a message's content: one string, a list of "
                                          "OpenAI text parts, or auto (what the template reads)",
                                          d.chat_template_content_format))
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": the model\'s tool calls are read from its text with '
                        "--tool-call-parser (default: off, such requests get 400)")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the format the model writes tool calls in, for --enable-auto-tool-choice (hermes: "
                        "<tool_call>{...}</tool_call>, as Hermes, Qwen2.5 and Qwen3 models; llama3_json: a reply "
                        'of {"name", "parameters"} objects, as Llama 3.1+ models; mistral: [TOOL_CALLS] then a '
                        'JSON array of {"name", "arguments"}, as Mistral models; pythonic: a reply '
                        "[name(key=value, ...), ...], as Llama 3.2 and 4 models) (default: none)")
    add_engine_flags(p)


_UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _api_keys(given: list[str] | None) -> tuple[str, ...]:
    """``--api-key``'s keys, else ``$FERROKV_API_KEY``'s, else ``$VLLM_API_KEY``'s (vLLM's), so a
    deployment that sets vLLM's variable is never left open."""
    env = os.environ.get("FERROKV_API_KEY") or os.environ.get("VLLM_API_KEY")
    keys = given if given is not None else [env] if env else []
    for key in keys:
        if not key or not key.isprintable():
            raise ValueError("--api-key must be a non-empty printable string")
    return tuple(keys)


def _check_files(**paths: str | None) -> None:
    for flag, path in paths.items():
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path!r}: no such file")


def _check_tls(keyfile: str | None, certfile: str | None, ca_certs: str | None) -> None:
    """Loads the certificate chain (and CA file) once, as uvicorn will, so that a file that is
    not PEM, or a key that does not match its certificate, is told naming the flags before the
    model loads."""
    import ssl

    if certfile is None:
        return

    class _Encrypted(Exception):
        pass

    def no_passphrase() -> str:  # OpenSSL would prompt on the terminal (uvicorn gets no passphrase)
        raise _Encrypted

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=no_passphrase)
    except _Encrypted:
        raise ValueError(f"--ssl-keyfile {keyfile!r}: the key is encrypted; give an unencrypted key") from None
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile {certfile!r} / --ssl-keyfile {keyfile!r}: not a usable certificate and key "
                         f"({e})") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-ca-certs {ca_certs!r}: not a usable CA certificate file ({e})") from None


def _check_template_syntax(template: str | None) -> None:
    """``--chat-template`` parses as Jinja (as transformers renders it), or the flag is refused;
    not a 400 blaming each client later."""
    if template is None:
        return
    from jinja2 import TemplateSyntaxError

    try:  # transformers' own environment and tags (private: without it, rendering reports errors)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template ({(e.message or '').rstrip('.')}, "
                         f"line {e.lineno})") from None


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template itself when it is one (vLLM's rule)."""
    from pathlib import Path

    if value is None or any(c in value for c in "{}\n"):
        return value
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {value!r}: not a readable template file ({e}); give a Jinja file or "
                         "the template itself") from None


def _listener(host: str, port: int, uds: str | None) -> socket.socket:
    """The socket the server listens on, bound before the model loads (as vLLM's), so that a bad
    host, a port in use or a bad ``--uds`` path is reported naming the flag, and no other server
    takes the address during the load. As vLLM's (and uvicorn's own): one socket, IPv6 when the
    host is an IPv6 address (``::`` then takes IPv4 too), else IPv4 (``localhost`` is 127.0.0.1,
    ``''`` every IPv4 address). It listens at once, since a socket only bound can be bound again
    by one that reuses addresses, as uvicorn's do; a client that connects during the load waits
    for the server."""
    if uds is not None:
        return _unix_listener(uds)
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on the connections of a TCP socket it knows as
    # one (proto 6), and streams need it (Nagle would hold small writes back).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError as e:  # socket.gaierror included
        sock.close()
        raise ValueError(f"--host {host!r} --port {port}: cannot listen there ({e})") from None
    return sock


def _unix_listener(path: str) -> socket.socket:
    """``--uds``: a socket file left by a server that is gone is replaced (as uvicorn does); one a
    live server listens on, or a file that is not a socket, is refused."""
    import stat

    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ValueError(f"--uds {path!r}: the path exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:  # nobody listens: a stale file
                os.unlink(path)
            else:
                raise ValueError(f"--uds {path!r}: another server listens there")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)  # as uvicorn makes it
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"--uds {path!r}: cannot listen there ({e})") from None
    return sock


def serve(args: argparse.Namespace) -> int:
    import math

    if args.model_pos is not None and args.model is not None and args.model_pos != args.model:
        raise ValueError(f"model: given twice, as {args.model_pos!r} and --model {args.model!r}")
    args.model = args.model_pos if args.model_pos is not None else args.model
    if args.served_model_name is not None and not all(n and n.isprintable() for n in args.served_model_name):
        raise ValueError(f"--served-model-name: each name must be a non-empty printable string, "
                         f"got {args.served_model_name!r}")
    for flag, values in (("--served-model-name", args.served_model_name), ("--api-key", args.api_key)):
        if values is not None and len(values) > 1 and args.model is None:
            # nargs="+" takes a model written after it as one more value: the default model would
            # be served silently, the model's name taken as a name or a key.
            raise ValueError(f"{flag} took {len(values)} values and no model was given: write the model first "
                             f"(ferrokv serve MODEL {flag} ...)")
    template_kwargs(args.default_chat_template_kwargs, "--default-chat-template-kwargs", overriding=False)
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if not args.response_role or not args.response_role.isprintable():
        raise ValueError(f"--response-role must be a non-empty printable string, got {args.response_role!r}")
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    for flag, value, lo in (("--port", args.port, 0), ("--max-body-bytes", args.max_body_bytes, 1),
                            ("--max-waiting-requests", args.max_waiting_requests, 0)):
        if value is not None and value < lo or (flag == "--port" and value > 65535):
            raise ValueError(f"{flag} must be {'in [0, 65535]' if flag == '--port' else f'>= {lo}'}, got {value}")
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise ValueError(f"--drain-timeout must be a finite number >= 0, got {args.drain_timeout}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of: {', '.join(TOOL_CALL_PARSERS)})")
    chat_template = _chat_template(args.chat_template)
    if args.api_server_count != 1:
        raise ValueError(f"--api-server-count={args.api_server_count} is not supported: ferrokv serves from one "
                         "process (1)")
    api_keys = _api_keys(args.api_key)
    _check_files(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                 log_config_file=args.log_config_file)
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    if args.h11_max_incomplete_event_size is not None and args.h11_max_incomplete_event_size < 1:
        raise ValueError(f"--h11-max-incomplete-event-size must be >= 1, got {args.h11_max_incomplete_event_size}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    _check_tls(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs)
    _check_template_syntax(chat_template)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.validate()  # a bad flag fails before torch is imported
    from ferrokv.async_llm import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import run_server

    config = _server_config(args, api_keys, chat_template)
    listener = _listener(args.host, args.port, args.uds)  # the last check: held from here on
    try:
        _sigterm_interrupts_startup()
        return run_server(AsyncLLM.from_engine_args(engine_args), config, exits_after=True, listener=listener)
    finally:
        listener.close()
        if args.uds is not None and os.path.exists(args.uds):
            os.unlink(args.uds)  # our socket file: no stale one is left behind


def _server_config(args: argparse.Namespace, api_keys: tuple[str, ...], chat_template: str | None) -> Any:
    """The checked flags as the server's ``ServerConfig``."""
    from ferrokv.entrypoints.openai.server_config import DEFAULT_MODEL_NAME, ServerConfig

    name, *aliases = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    return ServerConfig(served_model_name=name, served_model_aliases=tuple(aliases), host=args.host, port=args.port,
                        api_key=api_keys or None, uvicorn_log_level=args.uvicorn_log_level,
                        uvicorn_access_log=args.uvicorn_access_log, root_path=args.root_path,
                        max_log_len=args.max_log_len, response_role=args.response_role,
                        default_chat_template_kwargs=args.default_chat_template_kwargs,
                        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                        ssl_cert_reqs=args.ssl_cert_reqs, log_config_file=args.log_config_file,
                        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                        max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
                        drain_timeout=args.drain_timeout, log_prompts=args.log_prompts,
                        log_outputs=args.enable_log_outputs,
                        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                        enable_request_id_headers=args.enable_request_id_headers,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        enable_force_include_usage=args.enable_force_include_usage,
                        enable_server_load_tracking=args.enable_server_load_tracking, uds=args.uds,
                        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                        trust_request_chat_template=args.trust_request_chat_template,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                        chat_template=chat_template, chat_template_content_format=args.chat_template_content_format)


class Terminated(KeyboardInterrupt):
    """SIGTERM while the server starts: the start is abandoned as after a Ctrl-C (vLLM's), with
    the status of a process that SIGTERM ended."""

    exit_status = 128 + int(signal.SIGTERM)


def _sigterm_interrupts_startup() -> None:
    """Until uvicorn takes the signals over (its drain then handles them), SIGTERM interrupts the
    model load as Ctrl-C does, instead of killing the process without a word."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return

    def terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, terminated)
