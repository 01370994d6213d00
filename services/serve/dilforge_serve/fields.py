"""Every field a generation request may carry, checked and normalised before transformers serve reads it.

`normalise` is the one place a field is read: a field this server does not take, or a value the backend
cannot run, is a `BadRequest` naming it; it returns a body of checked fields only, and the rendered
conversation the guard counts prompt tokens on."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from dilforge_shared.families import control_token_in

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's own limit on `stop`
MIN_TEMPERATURE = 1e-3  # below this a temperature is served as 0 (greedy): dividing logits by 1e-300 overflows
MAX_TOOLS, MAX_TOOL_CALLS = 32, 16
MAX_OPTION_CHARS = 256  # a chat-template option's string value
MAX_NAME_CHARS = 256  # `user`, tool names, ids
ROLES = ("system", "user", "assistant", "tool", "developer")
# finite numbers in these ranges (OpenAI's, narrowed to what the backend runs: transformers applies
# frequency_penalty as repetition_penalty = 1 + frequency_penalty, which must be positive)
RANGES = {
    "temperature": (0.0, 2.0, "between 0.0 and 2.0"),
    "top_p": (0.0, 1.0, "between 0.0 and 1.0"),
    "frequency_penalty": (-1.0, 2.0, "greater than -1.0 and at most 2.0 (it is applied as repetition_penalty ="
                                     " 1 + frequency_penalty, which must be positive)"),
    "presence_penalty": (-2.0, 2.0, "between -2.0 and 2.0"),
}  # fmt: skip
OPEN_BELOW = {"frequency_penalty"}  # the low end itself is refused

# generation_config keys a request may set: {key: (type, low, high, low_open)}; anything else is refused
GENERATION_KEYS: dict[str, tuple[type, float, float, bool]] = {
    "do_sample": (bool, 0, 0, False),
    "temperature": (float, 0.0, 2.0, False),
    "top_k": (int, 0, 1_000_000, False),
    "top_p": (float, 0.0, 1.0, False),
    "min_p": (float, 0.0, 1.0, False),
    "typical_p": (float, 0.0, 1.0, True),
    "repetition_penalty": (float, 0.0, 10.0, True),
    "no_repeat_ngram_size": (int, 0, 64, False),
    "max_new_tokens": (int, 1, 1 << 40, False),
    "min_new_tokens": (int, 0, 1 << 40, False),
    "num_return_sequences": (int, 1, 1, False),
    "stop_strings": (list, 0, 0, False),
}

# chat-template variables a request can never set: the conversation itself, the tokenizer's special tokens,
# and apply_chat_template's own arguments (set twice, they are a TypeError in transformers serve)
TEMPLATE_RESERVED = {
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "chat_template", "conversation", "raise_exception", "strftime_now", "range", "loop", "namespace", "dict",
    "cycler", "joiner", "lipsum", "load_audio_from_video", "num_frames",
}  # fmt: skip

# fields transformers serve accepts and ignores: taken only at OpenAI's default (or a harmless value), then dropped
IGNORED_CHAT = {"n", "presence_penalty", "logprobs", "top_logprobs", "stream_options", "user", "tool_choice",
                "parallel_tool_calls", "response_format", "metadata", "store", "service_tier"}  # fmt: skip
IGNORED_COMPLETION = {"n", "presence_penalty", "logprobs", "stream_options", "user", "echo", "best_of"}
PASSED_COMMON = {"model", "max_tokens", "temperature", "top_p", "frequency_penalty", "seed", "stop", "stream",
                 "generation_config"}  # fmt: skip
PASSED_CHAT = PASSED_COMMON | {"messages", "max_completion_tokens", "logit_bias", "chat_template_kwargs", "tools"}
PASSED_COMPLETION = PASSED_COMMON | {"prompt", "suffix"}
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


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


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: Any, param: str) -> float:
    if not is_number(value):
        raise BadRequest(f"{param} must be a finite number, got {short(value)}", param=param)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise BadRequest(f"{param} must be a finite number, got {short(value)}", param=param)
    return number


def integer(value: Any, param: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"{param} must be an integer in [{low}, {high}], got {short(value)}", param=param)
    return value


def text(value: Any, param: str, max_chars: int | None = None, allow_empty: bool = True) -> str:
    """A string with no lone surrogate and no control token (user text must not forge a turn)."""
    if not isinstance(value, str) or (not allow_empty and not value):
        raise BadRequest(f"{param} must be a {'' if allow_empty else 'non-empty '}string, got {short(value)}", param)
    if max_chars is not None and len(value) > max_chars:
        raise BadRequest(f"{param} is {len(value)} characters; at most {max_chars} are allowed", param=param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{param} holds a lone surrogate at character {exc.start}", param=param) from None
    token = control_token_in(value)
    if token is not None:
        raise BadRequest(
            f"{param} contains the control token {token!r}, which would change the conversation's structure",
            param=param,
        )
    return value


def short(value: Any) -> str:
    """`value` for an error message: its repr, cut to 60 characters (a request may hold megabytes)."""
    try:
        shown = repr(value)
    except (ValueError, RecursionError):  # an integer of thousands of digits
        shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= 60 else shown[:57] + "..."


def all_strings(value: Any, param: str, depth: int = 0) -> None:
    """Every string anywhere in a JSON value (keys too) is text (no control token, no lone surrogate)."""
    if depth > 32:
        raise BadRequest(f"{param} is nested too deeply", param=param)
    if isinstance(value, str):
        text(value, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            text(key, param)
            all_strings(item, param, depth + 1)
    elif isinstance(value, list):
        for item in value:
            all_strings(item, param, depth + 1)
    elif is_number(value):
        finite(value, param)


def no_constant(name: str):
    """json.loads' hook for NaN and Infinity, which are not JSON."""
    raise ValueError(f"{name} is not a number")


def refuse_special_tokens(value: Any, pattern: re.Pattern[str] | None, param: str) -> None:
    """No string anywhere in a checked body holds one of the served tokenizer's special tokens: encoded, it would
    be that control id, not the text the user typed."""
    if pattern is None:
        return
    if isinstance(value, str):
        match = pattern.search(value)
        if match:
            raise BadRequest(
                f"{param} contains the special token {match.group(0)!r} of this model's tokenizer, which would be "
                "read as a control token, not as text",
                param=param,
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            refuse_special_tokens(item, pattern, f"{param}.{key}" if param else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            refuse_special_tokens(item, pattern, f"{param}[{i}]")


def stop_list(value: Any, param: str) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"{param} must be a string or a list of non-empty strings", param=param)
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"{param} takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters", param)
    for s in stops:
        text(s, param)
    return stops


# ---- the request ------------------------------------------------------------------------------------------
def normalise(
    path: str, body: dict[str, Any], vocab_size: int, template: ServedTemplate, model_sampling: bool
) -> Normalised:
    """The request as transformers serve should read it, or BadRequest naming the first bad field.

    `model_sampling`: whether the served model's own generation config samples (`do_sample`), which a request's
    temperature applies to."""
    chat = path == CHAT
    passed, ignored = (PASSED_CHAT, IGNORED_CHAT) if chat else (PASSED_COMPLETION, IGNORED_COMPLETION)
    for key in body:
        if key not in passed and key not in ignored:
            raise BadRequest(
                f"{short(key)} is not a field this server takes on {path} (it takes: {', '.join(sorted(passed))})",
                param=str(key),
            )
    for key in ignored & body.keys():
        check_ignored(key, body[key])
    out: dict[str, Any] = {k: body[k] for k in passed & body.keys() if body[k] is not None}
    check_sampling(out, model_sampling)
    seed = out.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise BadRequest(f"seed must be an integer in [0, 2^63), got {short(seed)}", param="seed")
    if "stream" in out and not isinstance(out["stream"], bool):
        raise BadRequest(f"stream must be true or false, got {short(out['stream'])}", param="stream")
    if "stop" in out:
        out["stop"] = stop_list(out["stop"], "stop")
        if not out["stop"]:
            del out["stop"]  # no stop string, as OpenAI reads `[]` (transformers fails on an empty list)
    for key in ("max_completion_tokens", "max_tokens"):
        if key in out:
            out[key] = integer(out[key], key, 1, 1 << 40)
    limits = {k: out[k] for k in ("max_completion_tokens", "max_tokens") if k in out}
    min_new_tokens = 0
    if "generation_config" in out:
        gen = generation_config(out, model_sampling)
        out["generation_config"] = json.dumps(gen)
        if "max_new_tokens" in gen:
            limits["generation_config.max_new_tokens"] = gen["max_new_tokens"]
        min_new_tokens = gen.get("min_new_tokens", 0)
    requested = next(iter(limits.values()), None)  # transformers serve's order: the first one set wins
    if chat:
        if "logit_bias" in out:
            check_logit_bias(out, vocab_size)
        conversation = messages(out.get("messages"))
        out["messages"] = [{k: v for k, v in m.items() if k != "rendered_tool_calls"} for m in conversation]
        kwargs = template_kwargs(out, template)
        if "tools" in out:
            kwargs["tools"] = tools(out["tools"], template)
        rendered = [
            {**{k: v for k, v in m.items() if k != "rendered_tool_calls"}, **m.get("rendered_tool_calls", {})}
            for m in conversation
        ]
        return Normalised(out, rendered, kwargs, requested, min_new_tokens, limits)
    out["prompt"] = text(out.get("prompt"), "prompt", allow_empty=False)
    if "suffix" in out:
        out["suffix"] = text(out["suffix"], "suffix", max_chars=4096)
    return Normalised(out, max_new_tokens=requested, min_new_tokens=min_new_tokens, token_limits=limits)


def check_ignored(key: str, value: Any) -> None:
    """A field transformers serve ignores: taken at its default (so a client that sends the default works), else
    refused (it would be silently ignored)."""
    if value is None:
        return
    fine = {
        "n": lambda v: v == 1 and not isinstance(v, bool),
        "presence_penalty": lambda v: is_number(v) and v == 0,
        "logprobs": lambda v: v is False or (v == 0 and not isinstance(v, bool)),
        "top_logprobs": lambda v: v == 0 and not isinstance(v, bool),
        "echo": lambda v: v is False,
        "best_of": lambda v: v == 1 and not isinstance(v, bool),
        "stream_options": lambda v: (
            isinstance(v, dict)
            and set(v) <= {"include_usage", "include_obfuscation"}
            and all(isinstance(x, bool) for x in v.values())
        ),
        "user": lambda v: isinstance(v, str) and len(v) <= MAX_NAME_CHARS,
        "tool_choice": lambda v: v in ("none", "auto"),
        "parallel_tool_calls": lambda v: isinstance(v, bool),
        "response_format": lambda v: v == {"type": "text"},
        "metadata": lambda v: (
            isinstance(v, dict)
            and len(v) <= 16
            and all(isinstance(k, str) and isinstance(x, str) and len(k) <= 64 and len(x) <= 512 for k, x in v.items())
        ),
        "store": lambda v: v is False,
        "service_tier": lambda v: v in ("auto", "default"),
    }[key]
    if key == "presence_penalty":
        low, high, words = RANGES[key]
        number = finite(value, key)
        if not low <= number <= high:
            raise BadRequest(f"{key} must be {words}, got {short(value)}", param=key)
    if key == "n" and is_number(value) and value != 1:
        raise BadRequest(f"n must be 1 (this server returns one choice per request), got {short(value)}", param="n")
    if not fine(value):
        raise BadRequest(
            f"{key} {short(value)} is not supported by this server (transformers serve ignores {key}; send it "
            "at its default or leave it out)",
            param=key,
        )


def check_sampling(out: dict[str, Any], model_sampling: bool) -> None:
    for key in ("temperature", "top_p", "frequency_penalty"):
        if key not in out:
            continue
        low, high, words = RANGES[key]
        number = finite(out[key], key)
        if not (low < number if key in OPEN_BELOW else low <= number) or number > high:
            raise BadRequest(f"{key} must be {words}, got {short(out[key])}", param=key)
        out[key] = number
    if out.get("temperature", 1.0) < MIN_TEMPERATURE:
        out["temperature"] = 0.0  # greedy, what a temperature this small converges to


def check_logit_bias(out: dict[str, Any], vocab_size: int) -> None:
    bias = out["logit_bias"]
    if bias == {}:
        del out["logit_bias"]  # no bias, as OpenAI reads it (transformers serve fails on an empty one)
        return
    if not isinstance(bias, dict) or len(bias) > 300:
        raise BadRequest("logit_bias must be an object of at most 300 token id -> bias", param="logit_bias")
    for key, value in bias.items():
        # the length first: int() of a key of thousands of digits is a ValueError, not a number
        id_digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= len(str(vocab_size))
        if not (id_digits and int(key) < vocab_size):
            raise BadRequest(
                f"logit_bias: {short(key)} is not a token id of this model (0..{vocab_size - 1})", param="logit_bias"
            )
        if not is_number(value) or not -100 <= value <= 100:
            raise BadRequest(f"logit_bias[{key}] must be a number in [-100, 100]", param="logit_bias")
    out["logit_bias"] = {key: float(value) for key, value in bias.items()}


def generation_config(out: dict[str, Any], model_sampling: bool) -> dict[str, Any]:
    """`generation_config`, as transformers serve declares it (a string holding a JSON object), checked key by key
    and re-encoded. The top-level fields override it (transformers serve applies them after it), so each check is
    on the value that generation will use: `stop` replaces `stop_strings`, and so on."""
    raw, param = out["generation_config"], "generation_config"
    if not isinstance(raw, str):
        raise BadRequest(
            f"generation_config must be a string holding a JSON object (e.g. '{{\"top_k\": 20}}'), got "
            f"{type(raw).__name__}",
            param=param,
        )
    try:
        gen = json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise BadRequest("generation_config is nested too deeply", param=param) from None
    except ValueError as exc:
        raise BadRequest(f"generation_config is not a JSON object: {exc}", param=param) from None
    if not isinstance(gen, dict):
        raise BadRequest(f"generation_config must hold a JSON object, got {type(gen).__name__}", param=param)
    checked: dict[str, Any] = {}
    for key, value in gen.items():
        name = f"generation_config.{key}"
        if key not in GENERATION_KEYS:
            raise BadRequest(
                f"{name} is not a generation setting a request may change (it may set: "
                f"{', '.join(sorted(GENERATION_KEYS))})",
                param=param,
            )
        if value is None:
            continue
        kind, low, high, low_open = GENERATION_KEYS[key]
        if kind is bool:
            if not isinstance(value, bool):
                raise BadRequest(f"{name} must be true or false, got {short(value)}", param=param)
            checked[key] = value
        elif kind is list:
            checked[key] = stop_list(value, name)
        elif kind is int:
            checked[key] = integer(value, name, int(low), int(high))
        else:
            number = finite(value, name)
            if not (low < number if low_open else low <= number) or number > high:
                raise BadRequest(
                    f"{name} must be {'greater than' if low_open else 'at least'} {low} and at most {high}, got "
                    f"{short(value)}",
                    param=param,
                )
            checked[key] = number  # a float: transformers' processors refuse an int temperature or penalty
    if "stop" in out or not checked.get("stop_strings", True):
        checked.pop("stop_strings", None)  # `stop` replaces it; an empty list is none
    sampling = checked.get("do_sample", model_sampling)
    temperature = out.get("temperature", checked.get("temperature"))
    if sampling and temperature is not None and temperature < MIN_TEMPERATURE:
        checked["do_sample"] = False  # greedy, what a temperature this small converges to
        checked.pop("temperature", None)
    return checked


def template_kwargs(out: dict[str, Any], template: ServedTemplate) -> dict[str, Any]:
    """`chat_template_kwargs`: only the served template's own options, each a scalar without control tokens."""
    kwargs = out.get("chat_template_kwargs", {})
    param = "chat_template_kwargs"
    if not isinstance(kwargs, dict):
        raise BadRequest(f"{param} must be an object, got {type(kwargs).__name__}", param=param)
    allowed = ", ".join(sorted(template.options)) or "none"
    for key, value in kwargs.items():
        if key not in template.options:
            raise BadRequest(
                f"{param}: {short(key)} is not a variable of this model's chat template that a request may set "
                f"(it may set: {allowed})",
                param=param,
            )
        if isinstance(value, str):
            text(value, f"{param}.{key}", max_chars=MAX_OPTION_CHARS)
        elif not (isinstance(value, bool) or value is None or (is_number(value) and math.isfinite(value))):
            raise BadRequest(f"{param}.{key} must be a string, number, true, false or null", param=param)
    return dict(kwargs)


def tools(value: Any, template: ServedTemplate) -> list[dict[str, Any]]:
    if not template.renders_tools:
        raise BadRequest("tools: this model's chat template does not render tools", param="tools")
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} tool objects", param="tools")
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
            raise BadRequest(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}", param=f"tools[{i}]")
        text(fn.get("name"), f"tools[{i}].function.name", max_chars=MAX_NAME_CHARS, allow_empty=False)
        all_strings(tool, f"tools[{i}]")
    return value


def messages(value: Any) -> list[dict[str, Any]]:
    """Each message as {role, content: str} (text parts joined as transformers serve joins them), with its
    checked tool calls; `rendered_tool_calls` holds them as the template sees them (arguments parsed)."""
    if not isinstance(value, list) or not value:
        raise BadRequest("messages is required: a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object with role and content", param=where)
        for key in message:
            if key not in MESSAGE_KEYS:
                raise BadRequest(
                    f"{where}.{short(key)} is not a message field ({', '.join(sorted(MESSAGE_KEYS))})", param=where
                )
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {list(ROLES)}, got {short(role)}", param=f"{where}.role")
        item: dict[str, Any] = {"role": role}
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise BadRequest(f"{where}.tool_calls: only an assistant message calls tools", param=where)
            item["tool_calls"], parsed = tool_calls(calls, f"{where}.tool_calls")
            item["rendered_tool_calls"] = {"tool_calls": parsed}
        if "tool_call_id" in message:
            if role != "tool":
                raise BadRequest(f"{where}.tool_call_id: only a tool message answers a tool call", param=where)
            item["tool_call_id"] = text(message["tool_call_id"], f"{where}.tool_call_id", MAX_NAME_CHARS)
        if message.get("name") is not None:
            text(message["name"], f"{where}.name", MAX_NAME_CHARS)  # checked; no template here renders it
        item["content"] = content(message.get("content"), f"{where}.content", calls_tools=bool(calls))
        if calls:
            item["content"] = ""  # transformers serve renders no content beside tool calls
        out.append(item)
    return out


def content(value: Any, param: str, calls_tools: bool) -> str:
    if value is None and calls_tools:
        return ""  # an assistant message that only calls tools (transformers serve renders no content for it)
    if isinstance(value, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and set(p) <= {"type", "text"} for p in value):
            raise BadRequest(f"{param}: this text model takes a string or text parts ({{type: text, text}})", param)
        parts = [text(p.get("text"), f"{param}[{j}].text") for j, p in enumerate(value)]
        return " ".join(parts)
    if not isinstance(value, str):
        raise BadRequest(f"{param} must be a string, got {type(value).__name__}", param=param)
    return text(value, param)


def tool_calls(value: Any, param: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the calls as sent on, the calls as the template renders them: arguments parsed to an object)."""
    if not isinstance(value, list) or not value or len(value) > MAX_TOOL_CALLS:
        raise BadRequest(f"{param} must be a list of 1 to {MAX_TOOL_CALLS} tool calls", param=param)
    sent, rendered = [], []
    for j, call in enumerate(value):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("type", "function") == "function" and isinstance(fn, dict)):
            raise BadRequest(f"{where} must be {{id, type: function, function: {{name, arguments}}}}", param=param)
        name = text(fn.get("name"), f"{where}.function.name", MAX_NAME_CHARS, allow_empty=False)
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise BadRequest(f"{where}.function.arguments must be a string holding a JSON object", param=param)
        try:
            parsed = json.loads(arguments, parse_constant=no_constant)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise BadRequest(f"{where}.function.arguments must be a string holding a JSON object", param=param)
        all_strings(parsed, f"{where}.function.arguments")
        call_id = text(call.get("id", f"call_{j}"), f"{where}.id", MAX_NAME_CHARS)
        sent.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        rendered.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}})
    return sent, rendered
