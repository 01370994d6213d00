"""CPT steps between log steps on CUDA: no synchronizing call from the stage's own code (CUDA's sync
debug mode), and a non-finite step skipped by fused AdamW on the device (parameters, moments and step
count untouched)."""

from __future__ import annotations

import warnings

from cpt_steps import check_skip_on_device, tiny


def test_a_non_finite_step_is_skipped_by_fused_adamw_on_the_device():
    import torch

    check_skip_on_device(torch.device("cuda"))


def test_steps_between_log_steps_make_no_synchronizing_call_in_the_stage_code():
    import torch
    from dilforge_cpt import optim
    from dilforge_cpt.runtime import Runtime

    rt = Runtime(device=torch.device("cuda"), dtype=torch.bfloat16)
    model, optimizer, tokens = tiny(rt.device)
    optim.run_step(model, optimizer, [tokens], rt, 1.0)  # optimizer state and CUDA context exist
    torch.cuda.synchronize()
    skip = torch.zeros((), dtype=torch.bool, device=rt.device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                result = optim.run_step(model, optimizer, [tokens], rt, 1.0, skip=skip)
                skip = skip | ~result.ok
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "dilforge_cpt" in str(w.filename)]
    assert not ours, ours
    assert bool(result.ok)
