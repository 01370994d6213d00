"""`coordinator chat`: talk to any model or adapter artifact (or HF folder) from the terminal. torch,
transformers and peft are imported inside the command (the `chat` extra), so the coordinator stays light."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .common import EndpointOpt, fail


def _policy(device: str):
    """Device and dtype from the shared policy (imported here: it probes torch, the CLI stays torch-free)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise typer.BadParameter(
            "chat needs torch, transformers and peft: pip install dilforge-coordinator[chat]"
        ) from None
    from dilforge_shared import runtime_policy

    return runtime_policy.decide("chat", device=device, precision="auto")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _load(model_uri: str, base: str | None, endpoint: str | None, merged: bool, policy):
    """Tokenizer, model and adapter; whatever the libraries raise on bad weights (a shape that is not the config's,
    a header declaring a huge tensor, an adapter trained on another base) is one DilforgeError naming the folder."""
    from dilforge_shared.errors import DilforgeError
    from dilforge_shared.serving import resolve_chat_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = resolve_chat_model(model_uri, base=base, endpoint_url=endpoint, prefer_merged=merged)
    step, where = "tokenizer", spec.tokenizer_dir
    try:
        tok = AutoTokenizer.from_pretrained(str(spec.tokenizer_dir), trust_remote_code=False)
        step, where = "model", spec.base_dir
        model = AutoModelForCausalLM.from_pretrained(
            str(spec.base_dir), dtype=policy.torch_dtype(), trust_remote_code=False
        )
        if spec.adapter_dir is not None:
            from peft import PeftModel

            step, where = f"adapter (on base {spec.base_dir})", spec.adapter_dir
            model = PeftModel.from_pretrained(model, str(spec.adapter_dir))
    except Exception as exc:  # noqa: BLE001 - transformers/peft/safetensors raise many types; the user needs one line
        hint = "; pass the --base it was trained on" if step.startswith("adapter") else ""
        raise DilforgeError(f"{where}: cannot load the {step}: {_first_line(exc)}{hint}") from None
    return spec, tok, model.to(policy.device).eval()


def _user_text(text: str, where: str) -> str:
    """Text from argv or stdin that was not UTF-8 arrives with surrogate escapes, and text holding a control token
    would render as a forged turn: both are refused with a line naming where, as serve refuses them."""
    from dilforge_shared.errors import DilforgeError
    from dilforge_shared.specials import control_token_in

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DilforgeError(f"{where} is not UTF-8 text (at position {exc.start}); send UTF-8") from None
    token = control_token_in(text)
    if token is not None:
        raise DilforgeError(f"{where} contains the control token {token!r}, which would forge a turn; remove it")
    return text


def reply(tok, model, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    """One greedy assistant turn for the conversation so far, stopping at the family's end of turn."""
    import torch
    from dilforge_shared.serving import stop_token_ids

    if not tok.chat_template:
        raise typer.BadParameter("the tokenizer has no chat template; this model cannot hold a dialogue")
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    enc = {k: v.to(model.device) for k, v in enc.items()}
    stop = stop_token_ids(tok)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            eos_token_id=stop,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop[0],
        )
    return tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def chat_cmd(
    model: Annotated[
        str, typer.Argument(help="Model or adapter artifact URI (store folder or manifest), or HF folder.")
    ],
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Ask once and exit; else interactive.")] = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    base: Annotated[
        str | None, typer.Option("--base", help="Base model for an adapter (default: its lineage).")
    ] = None,
    merged: Annotated[
        bool, typer.Option("--merged", help="Use the artifact's merged/ weights when it has them.")
    ] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 256,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    endpoint: EndpointOpt = None,
) -> None:
    """Chat with a model or adapter artifact. Empty line or Ctrl-D ends an interactive session."""
    from dilforge_shared.errors import DilforgeError

    system = _user_text(system, "--system") if system else system
    prompt = _user_text(prompt, "--prompt") if prompt is not None else None
    policy = _policy(device)
    spec, tok, lm = _load(model, base, endpoint, merged, policy)
    messages = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        messages.append({"role": "user", "content": prompt})
        typer.echo(reply(tok, lm, messages, max_new_tokens))
        return
    typer.echo(f"{spec.description} on {policy.device}. Empty line or Ctrl-D to quit.", err=True)
    while True:
        try:
            line = input("siz> ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
            line.encode("utf-8")  # where stdin reads with surrogateescape, bytes that were not UTF-8 fail here
        except EOFError:
            break
        except UnicodeError as exc:  # decoding stdin, or encoding its surrogate escapes
            fail(f"stdin is not UTF-8 text (at position {exc.start}); send UTF-8")
        if not line.strip():
            break
        try:
            _user_text(line, "this message")
        except DilforgeError as exc:  # one refused line; the conversation goes on without it
            typer.echo(f"error: {exc}", err=True)
            continue
        messages.append({"role": "user", "content": line})
        answer = reply(tok, lm, messages, max_new_tokens)
        messages.append({"role": "assistant", "content": answer})
        typer.echo(f"model> {answer}")
