"""One CPT step checked on any device (shared by tests/unit and tests/gpu): a tiny Llama with the
stage's fused AdamW, the device-side skip of a non-finite step, and `train_step` (the stage's `run_step`
read back at once, for tests that want every step's numbers)."""

from __future__ import annotations


def train_step(model, optimizer, batches, rt, max_grad_norm, row_masks=()) -> tuple[float, float]:
    """`optim.run_step` read back at once: (mean loss over the global batch, grad norm). A non-finite loss or
    norm leaves the model and optimizer as they were."""
    import torch
    from dilforge_cpt import optim

    result = optim.run_step(model, optimizer, batches, rt, max_grad_norm, row_masks)
    loss, norm = torch.stack([result.loss, result.norm]).tolist()
    return loss, norm


def tiny(device):
    import torch
    from dilforge_cpt import optim
    from dilforge_cpt.config import CptConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).to(device)
    model.config.use_cache = False
    config = CptConfig(
        scratch_model={},
        corpora=[{"uri": "a"}],
        validation=[{"uri": "v"}],
        seq_len=32,
        global_batch_size=2,
        micro_batch_size=2,
        phase1={"num_steps": 0},
        phase2={"num_steps": 4, "learning_rate": 0.01},
    )
    optimizer = optim.make_optimizer(optim.set_trainable(model, 2), config, config.phase2, fused=True)
    tokens = torch.randint(0, 256, (2, 32))
    return model, optimizer, tokens.pin_memory() if device.type == "cuda" else tokens


def check_skip_on_device(device):
    import torch
    from dilforge_cpt import optim
    from dilforge_cpt.runtime import Runtime

    rt = Runtime(device=device)
    model, optimizer, tokens = tiny(device)
    assert optim.skips_on_device(optimizer)  # fused: no host read decides the skip
    optim.run_step(model, optimizer, [tokens], rt, 1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    weight = model.model.layers[0].mlp.down_proj.weight
    hook = weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    result = optim.run_step(model, optimizer, [tokens], rt, 1.0)
    hook.remove()
    assert not bool(result.ok)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for p, s in optimizer.state.items():
        assert all(torch.equal(v, moments[id(p)][k]) for k, v in s.items())
    latched = optim.run_step(model, optimizer, [tokens], rt, 1.0, skip=~result.ok)  # a good step after a bad one
    assert bool(latched.ok) and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
