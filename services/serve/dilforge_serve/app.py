"""The ASGI app: `transformers serve`'s own FastAPI server, pinned to one model, behind a request guard.

transformers serve (the `serving` extra of the pinned transformers 5.24) does the OpenAI API: chat and text
completions, streaming, /v1/models. `compat.serve_command_app` builds it through the command itself, the CLI's
`transformers.cli.serve.Serve` (which preloads and pins the model named by `force_model`), in a subclass whose
`start_server` does nothing: the stock command would start uvicorn on the bare app, and dilforge runs it behind
the guard instead. tests/integration/test_serve.py pins the routes it must have.

`RequestGuard` is a pure ASGI middleware in front of it that adds what a customer-facing endpoint needs and
the stock server leaves to a stack trace or an endless generation: a body that is not UTF-8 or not JSON,
no messages, an unknown model id, a prompt longer than the context, `max_tokens` past it — each gets a 4xx
with an OpenAI-style error (`{"error": {"message", "type", "param", "code"}}`) naming the field. It also
maps SageMaker's inference contract onto the same server: GET /ping → /health, POST /invocations → the
chat completions route (an OpenAI chat request in, an OpenAI response or SSE stream out).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilforge_shared import compat
from dilforge_shared.families import control_token_in

log = logging.getLogger("dilforge.serve")

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GUARDED = (CHAT, COMPLETIONS)
# every route a client may use; transformers serve's others (/load_model, /reset, /v1/responses, audio, ...) 404
ROUTES = {("POST", CHAT), ("POST", COMPLETIONS), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/ping")}
ROUTES |= {("POST", "/invocations")}
MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more text than any context here holds; read before anything is parsed
DRAIN_BYTES = 8 << 20  # a refused body up to this size is read to its end before the 413 (read_body)
MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's own limit on `stop`
SAMPLING_RANGES = {  # finite numbers in these closed ranges (OpenAI's)
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 10.0),
}
ROLES = ("system", "user", "assistant", "tool", "developer")
TEST_SIZED_PARAMS = 10_000_000  # below this a served model is a test fixture, not an assistant
DEFAULT_MAX_TOKENS = 256  # a request that names no max_tokens (transformers serve would take 1024)


@dataclass
class ServerOptions:
    device: str = "auto"
    dtype: str = "auto"
    continuous_batching: bool = False
    attn_implementation: str | None = None


def served_shape(model_id: str) -> tuple[int, int]:
    """(parameters, context length) of the served folder, read from its config and safetensors headers."""
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_id, trust_remote_code=False)
    num_params = 0
    for path in sorted(Path(model_id).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            num_params += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    context = int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048)
    return num_params, context


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> bytes:
        err_type = {404: "not_found_error", 413: "request_too_large"}.get(self.status, "invalid_request_error")
        return json.dumps(
            {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}},
            ensure_ascii=False,
        ).encode()


class RequestGuard:
    """ASGI middleware: validate OpenAI requests before transformers serve sees them; SageMaker routes."""

    def __init__(self, app, model_id: str, tokenizer, context: int):
        self.app, self.model_id, self.tokenizer, self.context = app, model_id, tokenizer, context

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if (method, path) not in ROUTES:
            error = BadRequest(f"{method} {path} is not a route of this server", status=404, code="not_found")
            return await respond(send, 404, error.body())
        if path == "/ping":
            scope = {**scope, "path": "/health", "raw_path": b"/health"}
            return await self.app(scope, receive, send)
        if path == "/invocations":
            scope = {**scope, "path": CHAT, "raw_path": CHAT.encode()}
            path = CHAT
        if method != "POST" or path not in GUARDED:
            return await self.app(scope, receive, send)
        try:
            raw = await read_body(receive, declared_length(scope), MAX_BODY_BYTES)
            # parsing and tokenising take CPU time: off the event loop, so /ping and streams keep answering
            body = await asyncio.to_thread(self.check, path, raw)
        except BadRequest as exc:
            log.info("rejected %s: %s %s", path, exc.status, exc.message)
            return await respond(send, exc.status, exc.body())
        data = json.dumps(body).encode()
        # the body is JSON now, whatever the client called it (SageMaker clients may send another content type)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-length", str(len(data)).encode()), (b"content-type", b"application/json")]
        return await self.app({**scope, "headers": headers}, replay(data, receive), openai_errors(send))

    # ---- the checks ----------------------------------------------------------------------------
    def check(self, path: str, raw: bytes) -> dict[str, Any]:
        """The request as transformers serve should get it (model id and max_tokens filled in), or BadRequest."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"request body is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BadRequest(
                f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
        except ValueError as exc:  # e.g. an integer of thousands of digits
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise BadRequest(
                f"model {model!r} does not exist on this server; it serves {self.model_id!r} (GET /v1/models)",
                param="model",
                status=404,
                code="model_not_found",
            )
        body["model"] = self.model_id
        self.check_parameters(body)
        prompt_tokens = self.chat_prompt_tokens(body) if path == CHAT else self.completion_prompt_tokens(body)
        if prompt_tokens >= self.context:
            raise BadRequest(
                f"the prompt is {prompt_tokens} tokens; this model's context is {self.context} tokens "
                "(shorten the messages)",
                param="messages" if path == CHAT else "prompt",
                code="context_length_exceeded",
            )
        room = self.context - prompt_tokens
        for key in ("max_completion_tokens", "max_tokens"):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadRequest(f"{key} must be a positive integer, got {value!r}", param=key)
            if value > room:
                raise BadRequest(
                    f"{key} is {value}, but the prompt ({prompt_tokens} tokens) leaves room for at most "
                    f"{room} new tokens in this model's {self.context}-token context",
                    param=key,
                    code="context_length_exceeded",
                )
        if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
            body["max_tokens"] = min(DEFAULT_MAX_TOKENS, room)
        return body

    def check_parameters(self, body: dict) -> None:
        """Types and ranges of the generation parameters the stock server would pass on unchecked."""
        for key, (low, high) in SAMPLING_RANGES.items():
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise BadRequest(f"{key} must be a finite number, got {value!r}", param=key)
            if not low <= value <= high:
                raise BadRequest(f"{key} must be between {low} and {high}, got {value!r}", param=key)
        n = body.get("n")
        if n is not None and (isinstance(n, bool) or n != 1):
            raise BadRequest(f"n must be 1 (this server returns one choice per request), got {n!r}", param="n")
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise BadRequest("stop must be a string or a list of non-empty strings", param="stop")
            if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
                raise BadRequest(
                    f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters", param="stop"
                )
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise BadRequest(f"seed must be an integer in [0, 2^63), got {seed!r}", param="seed")
        bias = body.get("logit_bias")
        if bias == {}:
            del body["logit_bias"]  # no bias, as OpenAI reads it (transformers serve fails on an empty one)
        elif bias is not None:
            if not isinstance(bias, dict):
                raise BadRequest("logit_bias must be an object of token id -> bias", param="logit_bias")
            vocab = len(self.tokenizer)
            for key, value in bias.items():
                if not (isinstance(key, str) and key.isdigit() and int(key) < vocab):
                    raise BadRequest(
                        f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})", param="logit_bias"
                    )
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                    raise BadRequest(f"logit_bias[{key}] must be a number in [-100, 100]", param="logit_bias")

    def refuse_control_tokens(self, text: str, param: str) -> None:
        """User text may not contain the chat template's control tokens: rendered, `<|eot_id|><|start_header_id|>
        system...` would be a forged turn. Refused (400 naming the token), never silently rewritten. Text that is
        not encodable (a lone surrogate from a `\\ud800` escape) is refused too."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequest(f"{param} holds a lone surrogate at character {exc.start}", param=param) from None
        token = control_token_in(text)
        if token is not None:
            raise BadRequest(
                f"{param} contains the control token {token!r}, which would change the conversation's structure",
                param=param,
            )

    def chat_prompt_tokens(self, body: dict) -> int:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages is required: a non-empty list of {role, content} objects", param="messages")
        conversation = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise BadRequest(f"messages[{i}] must be an object with role and content", param=f"messages[{i}]")
            role = message.get("role")
            if role not in ROLES:
                raise BadRequest(
                    f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}", param=f"messages[{i}].role"
                )
            content = message.get("content")
            if isinstance(content, list):
                parts = [p.get("text") for p in content if isinstance(p, dict)]
                if len(parts) != len(content) or not all(isinstance(t, str) for t in parts):
                    raise BadRequest(
                        f"messages[{i}].content: this text model takes strings or text parts ({{type: text, text}})",
                        param=f"messages[{i}].content",
                    )
                content = " ".join(parts)
            if content is None and message.get("tool_calls"):
                content = ""
            if not isinstance(content, str):
                raise BadRequest(
                    f"messages[{i}].content must be a string, got {type(content).__name__}",
                    param=f"messages[{i}].content",
                )
            self.refuse_control_tokens(content, f"messages[{i}].content")
            conversation.append({"role": role, "content": content})
        ids = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def completion_prompt_tokens(self, body: dict) -> int:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt is required: a non-empty string", param="prompt")
        self.refuse_control_tokens(prompt, "prompt")
        return len(self.tokenizer(prompt)["input_ids"])


def declared_length(scope) -> int | None:
    for key, value in scope["headers"]:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise BadRequest("Content-Length is not a number") from None
    return None


async def read_body(receive, declared: int | None, limit: int, drain: int = DRAIN_BYTES) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit`: by its Content-Length, or, chunked, when
    the bytes received pass the limit. A refused body of at most `drain` bytes is read to its end (and dropped)
    first: a client still sending it would otherwise get a broken pipe instead of the 413."""
    too_large = BadRequest(f"request body exceeds {limit} bytes", status=413, code="request_too_large")
    if declared is not None and declared > limit:
        if declared <= drain:
            await discard(receive, drain)
        raise too_large
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            if message.get("more_body"):
                await discard(receive, drain - size)
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def discard(receive, budget: int) -> None:
    """Read and drop the rest of a request body, at most `budget` bytes more."""
    while budget > 0:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body"):
            return


def replay(data: bytes, receive):
    sent = False

    async def _receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await receive()  # then the client's disconnect, for streaming responses

    return _receive


def openai_errors(send):
    """`send`, with the inner app's error responses in OpenAI's shape: transformers serve answers some bad requests
    the FastAPI way (422, `{"detail": "Unexpected fields in the request: {'foo'}"}`), which OpenAI clients do not
    parse. Such a response becomes a 400 (a 422) or keeps its status, with the detail as the error's message."""
    held: dict[str, Any] = {}

    async def _send(message):
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held.update(start=message, chunks=[])
            return None
        if "start" not in held or message["type"] != "http.response.body":
            return await send(message)
        held["chunks"].append(message.get("body", b""))
        if message.get("more_body"):
            return None
        raw, status = b"".join(held.pop("chunks")), held.pop("start")["status"]
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not (isinstance(doc, dict) and isinstance(doc.get("error"), dict)):
            detail = doc.get("detail", doc) if isinstance(doc, dict) else raw.decode("utf-8", "replace")
            text = detail if isinstance(detail, str) else json.dumps(detail, ensure_ascii=False)
            status = 400 if status == 422 else status
            raw = BadRequest(text[:1000] or f"request failed with status {status}", status=status).body()
        return await respond(send, status, raw)

    return _send


async def respond(send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def build_app(model_id: str, options: ServerOptions):
    """The guarded app for a served folder named `model_id` in the working directory."""
    from transformers import AutoTokenizer

    app = compat.serve_command_app(
        model_id,
        device=options.device,
        dtype=options.dtype,
        attn_implementation=options.attn_implementation,
        continuous_batching=options.continuous_batching,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=False)
    num_params, context = served_shape(model_id)
    if num_params < TEST_SIZED_PARAMS:
        log.warning(
            "%s has %s parameters: a test-sized model (az-tiny); expect empty or meaningless answers "
            "(configs/az-small.yaml serves real ones)",
            model_id,
            f"{num_params:,}",
        )
    return RequestGuard(app, model_id, tokenizer, context)
