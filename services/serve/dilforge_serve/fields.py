"""The OpenAI request bodies this server takes, as pydantic models: a field it does not take, or a value the
backend cannot run, is a `BadRequest` naming it, never a 500 inside transformers serve. `normalise` returns
the checked body and the conversation the guard counts prompt tokens on."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from dilforge_shared.specials import control_token_in
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MIN_TEMPERATURE = 1e-3  # below this a temperature is served as 0 (greedy): dividing logits by 1e-300 overflows
# chat-template variables a request can never set: the conversation itself, the tokenizer's special tokens,
# and apply_chat_template's own arguments (set twice, they are a TypeError in transformers serve)
TEMPLATE_RESERVED = {
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "chat_template", "conversation", "raise_exception", "strftime_now", "range", "loop", "namespace", "dict",
    "cycler", "joiner", "lipsum", "load_audio_from_video", "num_frames",
}  # fmt: skip
# fields transformers serve accepts and ignores: taken only at OpenAI's default (or a harmless value), then dropped
IGNORED = {"n", "presence_penalty", "logprobs", "top_logprobs", "stream_options", "user", "tool_choice",
           "parallel_tool_calls", "response_format", "metadata", "store", "service_tier", "echo", "best_of"}  # fmt: skip


class BadRequest(Exception):
    """A request the server refuses: HTTP `status`, an OpenAI-style error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> bytes:
        err_type = {404: "not_found_error", 413: "request_too_large"}.get(self.status, "invalid_request_error")
        return json.dumps(
            {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}},
            ensure_ascii=False,
        ).encode()


@dataclass
class ServedTemplate:
    """What a request may ask of the served chat template: the variables it may set and whether it renders tools."""

    options: frozenset[str] = frozenset()
    renders_tools: bool = False

    @classmethod
    def of(cls, template: str | dict | None) -> ServedTemplate:
        """The template's own variables (other than the reserved ones and special tokens) become its options. A
        tokenizer with named templates renders its `default` one; one that does not parse offers none."""
        if isinstance(template, dict):
            template = template.get("default")
        if not isinstance(template, str) or not template:
            return cls()
        import jinja2
        from jinja2 import meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        try:
            names = meta.find_undeclared_variables(env.parse(template))
        except jinja2.TemplateError:
            return cls()
        options = {n for n in names if n not in TEMPLATE_RESERVED and not n.endswith("_token")}
        return cls(options=frozenset(options), renders_tools="tools" in names)


@dataclass
class Normalised:
    """A checked request: the body to send on, and (chat) the conversation and template arguments to render."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]] = field(default_factory=list)
    render_kwargs: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int | None = None  # what generation will use, wherever the request says it (None: the default)
    min_new_tokens: int = 0
    token_limits: dict[str, int] = field(default_factory=dict)  # every field naming a number of new tokens


def short(value: Any) -> str:
    """`value` for an error message: its repr, cut to 60 characters (a request may hold megabytes)."""
    try:
        shown = repr(value)
    except (ValueError, RecursionError):  # an integer of thousands of digits
        shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= 60 else shown[:57] + "..."


# ---- text: no lone surrogate, no control token, no special token of the served tokenizer ---------------------
def plain(value: str, info: ValidationInfo) -> str:
    """User text must not forge a turn: encoded, a special token would be that control id, not the text typed."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone surrogate at character {exc.start}") from None
    if token := control_token_in(value):
        raise ValueError(f"contains the control token {token!r}, which would change the conversation's structure")
    specials = (info.context or {}).get("specials")
    if specials is not None and (match := specials.search(value)):
        raise ValueError(
            f"contains the special token {match.group(0)!r} of this model's tokenizer, which would be read as a "
            "control token, not as text"
        )
    return value


def refused_at(at: tuple, error: str) -> PydanticCustomError:
    """A refusal of the value at key/index path `at` inside the field being validated (the refusal names both)."""
    return PydanticCustomError("value_error", "{error}", {"error": error, "at": at})


def all_strings(value: Any, info: ValidationInfo, at: tuple = (), depth: int = 0) -> None:
    """Every string anywhere in a free-form JSON value (keys too) is plain text; every number is finite. A bad
    one is refused at its own key or index (`at`, inside the field), which the refusal names."""
    if depth > 32:
        raise ValueError("is nested too deeply")
    try:
        if isinstance(value, str):
            plain(value, info)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"holds {value}, not a finite number")
    except ValueError as exc:
        raise refused_at(at, str(exc)) from None
    if isinstance(value, dict):
        for key, item in value.items():
            try:
                plain(key, info)
            except ValueError as exc:
                raise refused_at(at, f"has a key {short(key)} that {exc}") from None
            all_strings(item, info, (*at, key), depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            all_strings(item, info, (*at, i), depth + 1)


def no_constant(name: str):
    """json.loads' hook for NaN and Infinity, which are not JSON."""
    raise ValueError(f"{name} is not a number")


def text(min_length: int = 0, max_length: int | None = None) -> Any:
    """A string type: no lone surrogate, no control token, no special token of the served tokenizer."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length), AfterValidator(plain)]


Name = text(max_length=256)  # `user`, tool names, ids
# OpenAI's own limit on `stop`; a single string is a list of one
Stops = Annotated[list[text(1, 256)], Field(max_length=4), BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]
Tokens = Annotated[int, Field(ge=1, le=1 << 40)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class GenerationConfig(Strict):
    """The generation_config keys a request may set (the top-level fields override them, as in transformers
    serve). Floats stay floats: transformers' processors refuse an int temperature or penalty."""

    do_sample: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    typical_p: Annotated[float, Field(gt=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    no_repeat_ngram_size: Annotated[int, Field(ge=0, le=64)] | None = None
    max_new_tokens: Tokens | None = None
    min_new_tokens: Annotated[int, Field(ge=0, le=1 << 40)] | None = None
    num_return_sequences: Annotated[int, Field(ge=1, le=1)] | None = None
    stop_strings: Stops | None = None


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = False


class ResponseFormat(Strict):
    type: Literal["text"]


class Request(Strict):
    """The fields both routes take; those in IGNORED only at their default."""

    model: str | None = None
    max_tokens: Tokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    frequency_penalty: Annotated[float, Field(gt=-1, le=2)] | None = Field(
        None, description="it is applied as repetition_penalty = 1 + frequency_penalty, which must be positive"
    )
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] | None = None
    stop: Stops | None = None
    stream: bool | None = None
    generation_config: GenerationConfig | None = None
    n: Annotated[float, Field(ge=1, le=1)] | None = None  # 1 or 1.0; a Literal[1] would take true
    presence_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    logprobs: Literal[False, 0] | None = None
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None

    @field_validator("generation_config", mode="before")
    @classmethod
    def json_object(cls, raw: Any) -> Any:
        """transformers serve declares it a string holding a JSON object."""
        if raw is None:
            return raw
        if not isinstance(raw, str):
            raise ValueError(f"must be a string holding a JSON object (e.g. '{{\"top_k\": 20}}'), got {short(raw)}")
        try:
            gen = json.loads(raw, parse_constant=no_constant)
        except RecursionError:
            raise ValueError("is nested too deeply") from None
        except ValueError as exc:
            raise ValueError(f"is not a JSON object: {exc}") from None
        if not isinstance(gen, dict):
            raise ValueError(f"must hold a JSON object, got {type(gen).__name__}")
        return gen


class CompletionRequest(Request):
    prompt: text(1)
    suffix: text(max_length=4096) | None = None
    echo: Literal[False] | None = None
    best_of: Annotated[float, Field(ge=1, le=1)] | None = None


class Function(BaseModel):
    model_config = ConfigDict(strict=True)
    name: text(1, 256)
    arguments: dict[str, Any] = Field(default_factory=dict)  # parsed once; sent on re-serialised as a JSON string

    @field_validator("arguments", mode="before")
    @classmethod
    def json_object(cls, value: Any, info: ValidationInfo) -> Any:
        try:
            parsed = json.loads(value, parse_constant=no_constant) if isinstance(value, str) else None
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("must be a string holding a JSON object")
        all_strings(parsed, info)
        return parsed

    @field_serializer("arguments", when_used="json")
    def as_string(self, arguments: dict[str, Any]) -> str:
        return json.dumps(arguments, ensure_ascii=False)


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)
    id: Name | None = None
    type: Literal["function"] = "function"
    function: Function


def join_parts(value: Any) -> Any:
    """Text parts ({type: text, text}) joined as transformers serve joins them; a text model takes no others."""
    if not isinstance(value, list):
        return value
    if not all(isinstance(p, dict) and p.keys() == {"type", "text"} and p["type"] == "text" for p in value):
        raise ValueError("must be a string or text parts ({type: text, text}): this is a text model")
    if not all(isinstance(p["text"], str) for p in value):
        raise ValueError("must be a string or text parts whose text is a string")
    return " ".join(p["text"] for p in value)


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[text() | None, BeforeValidator(join_parts)] = None
    name: Name | None = None  # checked; no template here renders it
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=16)] | None = None
    tool_call_id: Name | None = None

    @model_validator(mode="before")
    @classmethod
    def roles(cls, message: Any) -> Any:
        if not isinstance(message, dict):
            return message
        if message.get("tool_calls") is not None and message.get("role") != "assistant":
            raise ValueError("has tool_calls: only an assistant message calls tools")
        if message.get("tool_call_id") is not None and message.get("role") != "tool":
            raise ValueError("has a tool_call_id: only a tool message answers a tool call")
        if message.get("content") is None and message.get("tool_calls") is None:
            raise ValueError("has no content: it must be a string (null only beside tool_calls)")
        return message

    @model_validator(mode="after")
    def as_served(self) -> Message:
        """transformers serve renders no content beside tool calls; a call without an id gets one."""
        for j, call in enumerate(self.tool_calls or ()):
            self.content, call.id = "", call.id or f"call_{j}"
        return self


class ToolFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: text(1, 256)


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: ToolFunction

    @model_validator(mode="before")
    @classmethod
    def every_string(cls, value: Any, info: ValidationInfo) -> Any:
        all_strings(value, info)
        return value


class ChatRequest(Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Tokens | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=32)] | None = None
    top_logprobs: Annotated[float, Field(ge=0, le=0)] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    metadata: Annotated[
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
    ] | None = None  # fmt: skip
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None

    @field_validator("logit_bias")
    @classmethod
    def token_ids(cls, bias: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        vocab_size = info.context["vocab_size"]
        for key in bias or {}:
            # the length first: int() of a key of thousands of digits is a ValueError, not a number
            if not (key.isascii() and key.isdigit() and len(key) <= len(str(vocab_size)) and int(key) < vocab_size):
                raise ValueError(f"{short(key)} is not a token id of this model (0..{vocab_size - 1})")
        return bias or None  # {} is no bias, as OpenAI reads it (transformers serve fails on an empty one)

    @field_validator("chat_template_kwargs")
    @classmethod
    def template_options(cls, kwargs: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        """Only the served template's own options, each a short scalar without control tokens."""
        options = info.context["template"].options
        for key, value in (kwargs or {}).items():
            if key not in options:
                raise ValueError(
                    f"{short(key)} is not a variable of this model's chat template that a request may set (it may "
                    f"set: {', '.join(sorted(options)) or 'none'})"
                )
            if isinstance(value, str) and len(value) > 256:
                raise refused_at((key,), f"is {len(value)} characters; at most 256 are allowed")
            if not (value is None or isinstance(value, str | bool | int | float)):
                raise refused_at((key,), "must be a string, number, true, false or null")
            all_strings(value, info, (key,))
        return kwargs

    @field_validator("tools", mode="before")
    @classmethod
    def rendered(cls, tools: Any, info: ValidationInfo) -> Any:
        if tools is not None and not info.context["template"].renders_tools:
            raise ValueError("cannot be used: this model's chat template does not render tools")
        return tools


PASSED_CHAT = set(ChatRequest.model_fields) - IGNORED
PASSED_COMPLETION = set(CompletionRequest.model_fields) - IGNORED


def refusal(exc: ValidationError, body: dict[str, Any], path: str) -> BadRequest:
    """The first validation error as one line naming the field (`messages[0].content`), and what it may be."""
    err = exc.errors(include_url=False)[0]
    loc = err["loc"] + err.get("ctx", {}).get("at", ())
    where = "".join(
        f"[{p}]"
        if isinstance(p, int)
        else f".{p}"
        if len(p) <= 40 and (p.isidentifier() or p.isdigit())
        else f"[{short(p)}]"
        for p in loc
        if p != "[key]"  # pydantic's marker of an error in a dict's key, not a part of the path
    ).lstrip(".")  # a request's own keys (logit_bias, metadata) shown as reprs, cut to 60 characters
    model = ChatRequest if path == CHAT else CompletionRequest
    if err["type"] == "extra_forbidden" and len(loc) == 1:
        passed = PASSED_CHAT if path == CHAT else PASSED_COMPLETION
        message = f"{short(loc[0])} is not a field this server takes on {path} (it takes: {', '.join(sorted(passed))})"
    elif loc and loc[0] in IGNORED:
        message = (
            f"{loc[0]} {short(body.get(loc[0]))} is not supported by this server (transformers serve ignores "
            f"{loc[0]}; send it at its default or leave it out)"
        )
    elif err["type"] == "extra_forbidden" and loc[0] == "generation_config":
        keys = ", ".join(sorted(GenerationConfig.model_fields))
        message = f"{where} is not a generation setting a request may change (it may set: {keys})"
    elif err["type"] == "extra_forbidden":
        message = f"{where} is not a field this server takes here"
    elif err["type"] == "string_unicode":
        message = f"{where} holds a lone surrogate, which is not text"
    elif err["type"] == "value_error":
        message = f"{where} {err['ctx']['error']}"
    else:  # pydantic's "Input should be ...", "List should have ..."
        _, should, rest = err["msg"].partition(" should ")
        message = f"{where}{should}{rest}" if should else f"{where}: {err['msg']}"
        if not isinstance(err["input"], dict | list):
            message += f", got {short(err['input'])}"
        if len(loc) == 1 and (why := model.model_fields[loc[0]].description):
            message += f" ({why})"
    return BadRequest(message, param=where or None)


def normalise(
    path: str, body: dict[str, Any], vocab_size: int, template: ServedTemplate, model_sampling: bool, specials=None
) -> Normalised:
    """The request as transformers serve should read it, or BadRequest naming the first bad field.

    `model_sampling`: whether the served model's own generation config samples (`do_sample`), which a request's
    temperature applies to; `specials`: a pattern of the served tokenizer's special tokens, refused in any text."""
    chat = path == CHAT
    context = {"vocab_size": vocab_size, "template": template, "specials": specials}
    try:
        request = (ChatRequest if chat else CompletionRequest).model_validate(body, context=context)
    except ValidationError as exc:
        raise refusal(exc, body, path) from None
    dump = request.model_dump(exclude_unset=True, exclude=IGNORED | {"messages"})
    out = {k: v for k, v in dump.items() if v is not None}
    if out.get("temperature", 1.0) < MIN_TEMPERATURE:
        out["temperature"] = 0.0  # greedy, what a temperature this small converges to
    if not out.get("stop", True):
        del out["stop"]  # no stop string, as OpenAI reads `[]` (transformers fails on an empty list)
    limits = {k: out[k] for k in ("max_completion_tokens", "max_tokens") if k in out}
    min_new_tokens = 0
    if "generation_config" in out:
        gen = {k: v for k, v in out["generation_config"].items() if v is not None}
        if "stop" in out or not gen.get("stop_strings", True):
            gen.pop("stop_strings", None)  # `stop` replaces it; an empty list is none
        temperature = out.get("temperature", gen.get("temperature"))
        if gen.get("do_sample", model_sampling) and temperature is not None and temperature < MIN_TEMPERATURE:
            gen["do_sample"] = False  # greedy, what a temperature this small converges to
            gen.pop("temperature", None)
        out["generation_config"] = json.dumps(gen)
        if "max_new_tokens" in gen:
            limits["generation_config.max_new_tokens"] = gen["max_new_tokens"]
        min_new_tokens = gen.get("min_new_tokens", 0)
    requested = next(iter(limits.values()), None)  # transformers serve's order: the first one set wins
    if not chat:
        return Normalised(out, max_new_tokens=requested, min_new_tokens=min_new_tokens, token_limits=limits)
    out["messages"] = [m.model_dump(mode="json", exclude_none=True, exclude={"name"}) for m in request.messages]
    # as the template renders them: tool call arguments parsed
    conversation = [m.model_dump(exclude_none=True, exclude={"name"}) for m in request.messages]
    kwargs = dict(out.get("chat_template_kwargs", {}))
    if "tools" in out:
        kwargs["tools"] = out["tools"]
    return Normalised(out, conversation, kwargs, requested, min_new_tokens, limits)
