"""The one device/precision/kernels policy (dilforge_shared.runtime_policy): its decisions for given
machine facts (no GPU needed), and that cpt, sft, eval and `coordinator chat` ask it instead of
probing torch themselves."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from dilforge_shared import runtime_policy
from dilforge_shared.errors import ConfigError
from dilforge_shared.runtime_policy import DeviceFacts, decide

CPU = DeviceFacts(cuda=False)
OLD_GPU = DeviceFacts(cuda=True, bf16_supported=False)  # e.g. V100: CUDA, no native bf16
GPU = DeviceFacts(cuda=True, bf16_supported=True)
GPU_FLASH = DeviceFacts(cuda=True, bf16_supported=True, flash_attn=True)
BF16_CPU = DeviceFacts(cuda=False, cpu_bf16=True)  # e.g. AMD EPYC (Zen 4) or Xeon with AMX


# ---- decisions ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "facts,expected", [(CPU, ("cpu", "fp32", False)), (OLD_GPU, ("cuda", "fp32", True)), (GPU, ("cuda", "bf16", True))]
)
def test_auto_is_bf16_and_liger_on_a_bf16_gpu_fp32_without_liger_on_cpu(facts, expected):
    policy = decide("cpt", liger="auto", model_type="llama", facts=facts)
    assert (policy.device, policy.precision, policy.liger) == expected


def test_auto_is_bf16_on_a_bf16_cpu_only_for_the_stage_that_asks_for_it():
    """CPT's training asks (autocast, about twice as fast there); measuring stages keep fp32 on any CPU, and a
    CPU without bf16 instructions (torch would emulate it, slower than fp32) stays fp32 for CPT too."""
    assert decide("cpt", auto_cpu_bf16=True, facts=BF16_CPU).precision == "bf16"
    assert decide("cpt", auto_cpu_bf16=True, facts=CPU).precision == "fp32"
    assert decide("cpt", auto_cpu_bf16=True, cpu_bf16=False, facts=BF16_CPU).precision == "fp32"
    assert decide("eval", facts=BF16_CPU).precision == "fp32"
    assert decide("cpt", precision="fp32", auto_cpu_bf16=True, facts=BF16_CPU).precision == "fp32"


@pytest.mark.parametrize(
    "flags,expected",
    [
        ("fpu vme avx512f avx512_bf16 avx512_vnni", True),
        ("fpu vme avx512f amx_bf16 amx_tile", True),
        ("fpu vme avx2 avx512f avx512_vnni", False),
    ],
)
def test_bf16_cpus_are_told_by_their_instruction_flags(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert runtime_policy.cpu_computes_bf16(cpuinfo) is expected
    assert runtime_policy.cpu_computes_bf16(tmp_path / "missing") is False


def test_explicit_settings_win_where_the_machine_allows_them():
    assert decide("eval", device="cpu", facts=GPU).device == "cpu"
    assert decide("eval", device="cpu", facts=GPU).precision == "fp32"
    assert decide("eval", precision="fp32", facts=GPU).precision == "fp32"
    assert decide("eval", precision="bf16", facts=CPU).precision == "bf16"  # CPU bf16 inference is allowed
    assert decide("sft", liger="off", model_type="llama", facts=GPU).liger is False


@pytest.mark.parametrize(
    "kwargs,facts,field",
    [
        ({"device": "cuda"}, CPU, "eval.device"),
        ({"precision": "bf16"}, OLD_GPU, "eval.precision"),
        ({"precision": "bf16", "cpu_bf16": False}, CPU, "eval.precision"),
        ({"liger": "on"}, CPU, "eval.liger"),
        ({"liger": "on", "model_type": "mistral"}, GPU, "eval.liger"),
    ],
)
def test_impossible_requests_are_config_errors_naming_the_field(kwargs, facts, field):
    with pytest.raises(ConfigError, match=field):
        decide("eval", facts=facts, **kwargs)


def test_liger_only_for_llama_and_auto_stays_off_quietly():
    assert runtime_policy.choose_liger("auto", "cuda", "llama") is True
    assert runtime_policy.choose_liger("auto", "cuda", "mistral") is False
    assert runtime_policy.choose_liger("auto", "cuda", None) is True  # model type not known yet
    assert runtime_policy.choose_liger("auto", "cpu", "llama") is False
    assert runtime_policy.choose_liger("off", "cuda", "llama") is False


@pytest.mark.parametrize(
    "packing,facts,expected",
    [
        (False, GPU_FLASH, "sdpa"),
        (True, CPU, "sdpa"),
        (True, GPU, "flex_attention"),
        (True, GPU_FLASH, "flash_attention_2"),
    ],
)
def test_attention_follows_packing_and_the_installed_kernels(packing, facts, expected):
    from dilforge_sft.config import SftConfig
    from dilforge_sft.training import decide_runtime

    config = SftConfig.model_validate({"train": [{"uri": "x.jsonl"}], "packing": packing})
    assert decide_runtime(config, facts=facts).attention == expected
    assert decide_runtime(config.model_copy(update={"attention": "eager"}), facts=facts).attention == "eager"


def test_the_policy_module_does_not_import_torch():
    code = "import sys, dilforge_shared.runtime_policy; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- every stage asks the policy ---------------------------------------------------------------------


def test_sft_device_plan_is_the_policy():
    from dilforge_sft.config import SftConfig
    from dilforge_sft.training import decide_runtime

    config = SftConfig.model_validate({"train": [{"uri": "x.jsonl"}]})
    plan = decide_runtime(config, "llama", facts=GPU)
    assert (plan.device, plan.bf16, plan.liger) == ("cuda", True, True)
    assert decide_runtime(config, "mistral", facts=GPU).liger is False
    with pytest.raises(ConfigError, match="sft.precision"):  # SFT does not train in bf16 on CPU
        decide_runtime(config.model_copy(update={"precision": "bf16"}), facts=CPU)
    packed = config.model_copy(update={"packing": True})
    assert decide_runtime(packed, facts=GPU).attention == "flex_attention"


def test_cpt_runtime_and_liger_follow_the_policy(monkeypatch):
    """The runtime's dtype and the Liger decision are the policy's for the facts it probes (an explicit bf16
    request is honoured on CPU, auto is fp32 there, `on` where the kernels cannot apply is an error naming
    cpt.liger), not a torch check of the stage's own."""
    import torch
    from dilforge_cpt import sharding
    from dilforge_cpt.config import CptConfig
    from dilforge_cpt.runtime import Runtime, init_runtime, shutdown

    monkeypatch.setattr(runtime_policy, "probe_device", lambda: CPU)
    base = {"scratch_model": {}, "corpora": [{"uri": "a"}], "validation": [{"uri": "v"}], "phase2": {"num_steps": 1}}
    for precision, dtype in (("bf16", torch.bfloat16), ("auto", torch.float32)):
        rt = init_runtime(CptConfig(**base, precision=precision))
        shutdown(rt)
        assert rt.dtype == dtype and rt.device.type == "cpu"
    # a CPU with bf16 instructions: auto autocasts in one process; not under FSDP (several processes, or fsdp: on)
    monkeypatch.setattr(runtime_policy, "probe_device", lambda: BF16_CPU)
    rt = init_runtime(CptConfig(**base))
    shutdown(rt)
    assert rt.dtype == torch.bfloat16 and not rt.fsdp
    rt = init_runtime(CptConfig(**base, fsdp="on"))
    shutdown(rt)
    assert rt.dtype == torch.float32 and rt.fsdp
    monkeypatch.setattr(runtime_policy, "probe_device", lambda: CPU)
    with pytest.raises(ConfigError, match="cpt.liger: the Liger kernels need CUDA"):
        init_runtime(CptConfig(**base, liger="on"))
    llama = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
    mistral = SimpleNamespace(config=SimpleNamespace(model_type="mistral"))
    cuda = Runtime(device=torch.device("cuda", 0))
    assert sharding.apply_liger(llama, CptConfig(**base), Runtime()) == []  # CPU: auto stays off
    assert sharding.apply_liger(mistral, CptConfig(**base), cuda) == []  # no kernels for mistral
    with pytest.raises(ConfigError, match="cpt.liger: no Liger kernels for model_type 'mistral'"):
        sharding.apply_liger(mistral, CptConfig(**base, liger="on"), cuda)


def test_eval_run_refuses_an_impossible_device_before_any_work(monkeypatch, tmp_path):
    from dilforge_eval import stage
    from dilforge_eval.config import EvalConfig

    monkeypatch.setattr(runtime_policy, "probe_device", lambda: CPU)
    config = EvalConfig.model_validate({"models": [{"label": "m", "uri": "/nowhere"}], "device": "cuda"})
    ctx = SimpleNamespace(endpoint_url=None, opt=SimpleNamespace(root=tmp_path), cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match="eval.device: 'cuda' requested but no CUDA device"):
        stage.run(config, ctx)
    assert list(tmp_path.iterdir()) == []  # nothing read, downloaded or written first


def test_chat_asks_the_policy_and_reports_its_error(monkeypatch):
    from dilforge_coordinator.cli import app
    from typer.testing import CliRunner

    monkeypatch.setattr(runtime_policy, "probe_device", lambda: CPU)
    result = CliRunner().invoke(app, ["chat", "/nowhere", "--device", "cuda", "-p", "salam"])
    assert result.exit_code == 1
    assert "chat.device: 'cuda' requested but no CUDA device" in result.output


def test_chat_stops_at_the_tokenizer_familys_end_of_turn():
    from dilforge_shared.serving import stop_token_ids

    vocab = {"<|im_start|>": 1, "<|im_end|>": 2, "<|endoftext|>": 0, "salam": 3}
    chatml = SimpleNamespace(get_vocab=lambda: vocab, convert_tokens_to_ids=vocab.get, eos_token_id=2)
    assert stop_token_ids(chatml) == [2, 0]  # <|im_end|>, <|endoftext|>; never Llama 3's <|eot_id|>
    plain = SimpleNamespace(get_vocab=lambda: {"a": 0, "</s>": 1}, convert_tokens_to_ids=lambda t: None, eos_token_id=1)
    assert stop_token_ids(plain) == [1]
