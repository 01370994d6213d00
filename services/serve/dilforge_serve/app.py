"""The ASGI app: `transformers serve`'s own OpenAI server (`compat.serve.serve_command_app`), pinned to one
model, behind `RequestGuard`: an ASGI middleware that answers what the stock server leaves to a stack trace or an
endless generation with a 4xx naming the field, and maps SageMaker's /ping and /invocations onto the server."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

from dilforge_shared.compat.serve import serve_command_app
from dilforge_shared.families import GENERATION_CONFIG_FILE
from dilforge_shared.specials import special_token_pattern, special_tokens

from .fields import CHAT, COMPLETIONS, BadRequest, ServedTemplate, normalise

log = logging.getLogger("dilforge.serve")

# every route a client may use; transformers serve's others (/load_model, /reset, /v1/responses, audio, ...) 404
ROUTES = {("POST", CHAT), ("POST", COMPLETIONS), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/ping")}
ROUTES |= {("POST", "/invocations")}
MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more text than any context here holds; read before anything is parsed
DRAIN_BYTES = 8 << 20  # a refused body up to this size is read to its end before the 413 (read_body)
TEST_SIZED_PARAMS = 10_000_000  # below this a served model is a test fixture, not an assistant
DEFAULT_MAX_TOKENS = 256  # a request that names no max_tokens (transformers serve would take 1024)


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


class RequestGuard:
    """ASGI middleware: validate OpenAI requests before transformers serve sees them; SageMaker routes."""

    def __init__(self, app, model_id: str, tokenizer, context: int, model_sampling=False, test_sized=False):
        self.app, self.model_id, self.tokenizer, self.context = app, model_id, tokenizer, context
        self.template = ServedTemplate.of(tokenizer.chat_template)
        self.model_sampling, self.test_sized = model_sampling, test_sized
        self.specials = special_token_pattern(special_tokens(tokenizer))

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
        if method != "POST":
            return await self.app(scope, receive, send)
        try:
            refuse_encoded_body(scope)
            # the HTTP server has checked that a Content-Length is a number
            declared = next((int(v) for k, v in scope["headers"] if k.lower() == b"content-length"), None)
            raw = await read_body(receive, declared, MAX_BODY_BYTES)
            # parsing and tokenising take CPU time: off the event loop, so /ping and streams keep answering
            body = await asyncio.to_thread(self.check, path, raw)
        except BadRequest as exc:
            log.info("rejected %s: %s %s", path, exc.status, exc.message)
            return await respond(send, exc.status, exc.body())
        data = json.dumps(body).encode()
        # the body is JSON now, whatever the client called it (SageMaker clients may send another content type)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-length", str(len(data)).encode()), (b"content-type", b"application/json")]
        outgoing = openai_answers(send, self.test_sized)
        return await self.app({**scope, "headers": headers}, replay(data, receive), outgoing)

    # ---- the checks ----------------------------------------------------------------------------
    def check(self, path: str, raw: bytes) -> dict[str, Any]:
        """The request as transformers serve should get it (every field checked, the model id and max_tokens
        filled in), or BadRequest."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"request body is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}") from None
        try:
            body = json.loads(text)
        except RecursionError:
            raise BadRequest("request body is nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError names the line and column; or an integer of thousands of digits
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
        request = normalise(path, body, len(self.tokenizer), self.template, self.model_sampling, self.specials)
        body = request.body
        prompt_tokens = self.prompt_tokens(path, request)
        if prompt_tokens >= self.context:
            raise BadRequest(
                f"the prompt is {prompt_tokens} tokens; this model's context is {self.context} tokens "
                "(shorten the messages)",
                param="messages" if path == CHAT else "prompt",
                code="context_length_exceeded",
            )
        room = self.context - prompt_tokens
        for key, value in request.token_limits.items():
            if value > room:
                raise BadRequest(
                    f"{key} is {value}, but the prompt ({prompt_tokens} tokens) leaves room for at most "
                    f"{room} new tokens in this model's {self.context}-token context",
                    param=key.split(".")[0],
                    code="context_length_exceeded",
                )
        asked = request.max_new_tokens
        if asked is None:
            asked = body["max_tokens"] = min(DEFAULT_MAX_TOKENS, room)
        elif "max_completion_tokens" not in body:
            body["max_tokens"] = asked  # one place says it, whichever the request used
        if request.min_new_tokens > asked:
            raise BadRequest(
                f"generation_config.min_new_tokens is {request.min_new_tokens}, more than the {asked} new tokens "
                "this request may generate",
                param="generation_config",
            )
        return body

    def prompt_tokens(self, path: str, request) -> int:
        """Tokens of the prompt as transformers serve builds it: for chat, the conversation rendered by the
        served template with the same tools and template variables (the default system message included)."""
        if path != CHAT:
            return len(self.tokenizer(request.body["prompt"])["input_ids"])
        from jinja2 import TemplateError

        try:
            ids = self.tokenizer.apply_chat_template(
                request.conversation,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **request.render_kwargs,
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # the template's own refusal (raise_exception), or a value it cannot render
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise BadRequest(f"messages: this model's chat template cannot render them: {reason}", "messages") from None
        return len(ids["input_ids"])


def refuse_encoded_body(scope) -> None:
    """A compressed body (Content-Encoding gzip, br, ...) is refused by its header: the server reads JSON as sent,
    and would otherwise report compressed bytes as "not UTF-8" or, mislabelled, read them as they are."""
    for key, value in scope["headers"]:
        if key.lower() == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            encoding = value.decode("latin-1")[:40]
            raise BadRequest(
                f"Content-Encoding {encoding!r} is not supported: send the request body uncompressed",
                status=415,
                code="unsupported_media_type",
            )


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


def empty_answer_note(tokens: Any, test_sized: bool) -> str:
    """Why an answer holds no visible text, for the response's `warning` field."""
    note = (
        f"the answer has no visible text: the model's {tokens} generated token(s) decode to nothing but special "
        "tokens or whitespace"
    )
    if test_sized:
        note += (
            "; this is a test-sized model (like the az-tiny preset's random 2-layer one), which answers so: serve a "
            "trained model (configs/az-small.yaml) for real answers"
        )
    return note


def answer_text(choice: Any) -> str | None:
    """The text of a response's (or stream chunk's) choice, or None when it has none or calls tools."""
    part = choice.get("message") or choice.get("delta")
    if isinstance(part, dict):
        return None if part.get("tool_calls") else part.get("content") or ""
    return choice.get("text") if isinstance(choice.get("text"), str) else None


def openai_answers(send, test_sized: bool):
    """`send`, with the inner app's answers as OpenAI clients read them. An error response keeps its status (a 422
    becomes a 400) with its detail as an OpenAI error: transformers serve answers some bad requests the FastAPI way
    (`{"detail": "Unexpected fields in the request: {'foo'}"}`). A 200 answer whose text is empty or blank gets a
    `warning` field saying why (in a stream: the chunk that carries the finish reason), logged too; its finish
    reason stays as it is (`stop`), so a client that reads only the content gets the same answer."""
    state: dict[str, Any] = {"start": None, "sse": False, "text": "", "tools": False}

    def checked(raw: bytes, stream: bool) -> bytes:
        """A JSON answer or stream chunk, with the warning added when the answer's text is empty or blank."""
        try:
            doc = json.loads(raw)
        except ValueError:
            return raw
        choices = doc.get("choices") if isinstance(doc, dict) else None
        if not (isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)):
            return raw
        text = answer_text(choices[0])
        if stream:  # the stream's text so far, noted on the chunk that finishes it
            state["tools"] |= text is None
            state["text"] += text or ""
            text = None if state["tools"] or not choices[0].get("finish_reason") else state["text"]
        if text is None or text.strip():
            return raw
        doc["warning"] = empty_answer_note((doc.get("usage") or {}).get("completion_tokens", "?"), test_sized)
        log.warning("empty answer: %s", doc["warning"])
        return json.dumps(doc, ensure_ascii=False).encode()

    def error(raw: bytes, status: int) -> tuple[int, bytes]:
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return status, raw
        detail = doc.get("detail", doc) if isinstance(doc, dict) else raw.decode("utf-8", "replace")
        text = detail if isinstance(detail, str) else json.dumps(detail, ensure_ascii=False)
        status = 400 if status == 422 else status
        return status, BadRequest(text[:1000] or f"request failed with status {status}", status=status).body()

    async def _send(message):
        if message["type"] == "http.response.start":
            status = message["status"]
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            state["sse"] = status == 200 and content_type.startswith(b"text/event-stream")
            if status >= 400 or (status == 200 and content_type.startswith(b"application/json")):
                state.update(start=message, chunks=[])
                return None
            return await send(message)
        if message["type"] != "http.response.body":
            return await send(message)
        if state["sse"]:
            events = message.get("body", b"").split(b"\n\n")
            body = b"\n\n".join(b"data: " + checked(e[6:], True) if e.startswith(b"data: ") else e for e in events)
            return await send({**message, "body": body})
        if state["start"] is None:
            return await send(message)
        state["chunks"].append(message.get("body", b""))
        if message.get("more_body"):
            return None
        raw, start = b"".join(state["chunks"]), state["start"]
        state["start"] = None
        if start["status"] >= 400:
            return await respond(send, *error(raw, start["status"]))
        raw = checked(raw, False)
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": headers + [(b"content-length", str(len(raw)).encode())]})
        return await send({"type": "http.response.body", "body": raw})

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


def build_app(model_id: str, **options: Any):
    """The guarded app for a served folder named `model_id` in the working directory; `options` go to
    transformers serve (device, dtype, continuous_batching)."""
    from transformers import AutoTokenizer

    app = serve_command_app(model_id, **options)
    tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=False)
    num_params, context = served_shape(model_id)
    test_sized = num_params < TEST_SIZED_PARAMS
    if test_sized:
        log.warning(
            "%s has %s parameters: a test-sized model (az-tiny); expect empty or meaningless answers, each empty "
            "one with a `warning` field saying why (configs/az-small.yaml serves real ones)",
            model_id,
            f"{num_params:,}",
        )
    gen = json.loads((Path(model_id) / GENERATION_CONFIG_FILE).read_text(encoding="utf-8"))  # prepare wrote it
    sampling = bool(gen.get("do_sample"))
    return RequestGuard(app, model_id, tokenizer, context, model_sampling=sampling, test_sized=test_sized)
