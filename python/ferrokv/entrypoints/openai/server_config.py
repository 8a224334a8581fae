"""``ServerConfig``: the server's own settings and their defaults, in one place.

``ferrokv serve``'s flags take their defaults from here; the engine's settings are
``EngineArgs``. Importing this module imports neither fastapi nor torch, so ``ferrokv --help``
stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BODY_BYTES_PER_TOKEN", "DEFAULT_MODEL_NAME", "ServerConfig", "body_limit"]

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded default model is served as
# The default request-body limit per token of max_model_len: room for a prompt that fills the
# context however it is written (token ids, or escaped non-ASCII text: about 9 bytes a token),
# several of them in a batch, and the rest of the request. vLLM has no limit; one that scales
# with the context keeps a long-context model's prompts and still stops a runaway body.
BODY_BYTES_PER_TOKEN = 64
_MIN_BODY_BYTES = 1 << 20


def body_limit(max_body_bytes: int | None, max_model_len: int) -> int:
    """The request-body limit: ``--max-body-bytes``, else 64 bytes per token of
    ``max_model_len``, at least 1 MiB."""
    if max_body_bytes is not None:
        return max_body_bytes
    return max(_MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


@dataclass(slots=True)
class ServerConfig:
    """``served_model_name``: the name clients send and see (``served_model_aliases``: other names
    they may send, listed by ``/v1/models`` too; a response shows the first name, as vLLM's do). ``max_waiting_requests``: engine
    sequences (prompts x n) accepted beyond the ``max_num_seqs`` running ones. ``drain_timeout``: seconds
    requests in flight may run on after SIGTERM/SIGINT. ``allowed_*`` and ``allow_credentials``:
    the CORS policy browsers are told (vLLM's flags and defaults: any origin, method and header).
    ``trust_request_chat_template``: whether a request's own ``chat_template`` is rendered (vLLM's
    flag; off, such a request is a 400: a Jinja template is code, one could loop or fill memory).
    ``enable_auto_tool_choice`` and ``tool_call_parser``: ``tool_choice: "auto"`` is served, the
    model's calls read in that format (vLLM's flags; one needs the other). ``chat_template``: the
    Jinja template chats use instead of the tokenizer's (vLLM's ``--chat-template``, its text);
    ``chat_template_content_format``: how it reads a message's content (``ferrokv.chat_content_format``).
    ``uvicorn_*`` and ``ssl_*``: uvicorn's settings; ``root_path``: the app's (a request is served with
    or without the prefix, as vLLM's ``--root-path``)."""

    served_model_name: str = DEFAULT_MODEL_NAME
    served_model_aliases: tuple[str, ...] = ()  # more names clients may send (vLLM's later --served-model-name values)
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None  # a Unix domain socket to listen on instead of host:port (vLLM's --uds)
    api_key: str | tuple[str, ...] | None = None  # one key, or several (vLLM's list): any of them is accepted
    max_body_bytes: int | None = None  # None: body_limit's, scaled to the model's max_model_len
    max_waiting_requests: int = 1024
    drain_timeout: float = 30.0
    log_prompts: bool = False
    log_outputs: bool = False  # vLLM's --enable-log-outputs: each choice's text when it finishes
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: dict[str, Any] | None = None  # under each chat's own chat_template_kwargs
    response_role: str = "assistant"  # the role of chat answers (a chat with add_generation_prompt false: its last)
    max_log_len: int | None = None  # characters of a prompt --log-prompts logs (None: all)
    uvicorn_log_level: str = "info"
    uvicorn_access_log: bool = False
    root_path: str = ""  # the path prefix a proxy serves the app under (vLLM's --root-path)
    enable_request_id_headers: bool = False  # each response says X-Request-Id: the client's, else a new one (vLLM's)
    # vLLM's: logprobs name tokens "token_id:N" unless a request says otherwise; every stream ends with
    # its usage; GET /load counts the generation requests being served (else it says 0).
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    enable_server_load_tracking: bool = False
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's: a chat's tools reach its template unless this
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE / OPTIONAL / REQUIRED (0/1/2): whether clients show a certificate
    h11_max_incomplete_event_size: int | None = None  # the largest request head, in bytes (None: h11's 16 KiB)
    log_config_file: str | None = None  # a logging config (JSON, YAML or INI) for uvicorn and the server

    def api_keys(self) -> tuple[str, ...]:
        """The keys a request may send (none: no key is needed)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)
