"""SFT's Trainer checkpoints, sealed with a digest marker after each save; resuming takes the newest that
verifies and sets a damaged one aside (outside Trainer's rotation)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from dilforge_shared.checkpoint_digests import seal, set_aside, verify

log = logging.getLogger("dilforge.sft")


def latest_checkpoint(folder: Path) -> Path | None:
    """Newest Trainer checkpoint whose files match their digests. A cut-off one (trainer_state.json, written
    last, missing or unparsable) is removed; a damaged or unsealed one is set aside with a warning; then the
    previous one is tried."""
    from transformers.trainer_utils import get_last_checkpoint

    while folder.is_dir() and (found := get_last_checkpoint(folder)):
        path = Path(found)
        try:
            json.loads((path / "trainer_state.json").read_text())
        except (ValueError, OSError):
            log.warning("removing incomplete checkpoint %s (no complete trainer_state.json)", path)
            shutil.rmtree(path)
            continue
        if (problem := verify(path)) is None:
            return path
        aside = set_aside(path, "damaged-" + path.name)
        log.warning(
            "checkpoint %s is damaged (%s); set aside as %s, trying the previous one",
            path,
            problem,
            aside.name if aside else "(already)",
        )
    return None


def seal_checkpoints_callback():
    """Digests of every file of a checkpoint, written right after Trainer saved it (rotation included)."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class SealCheckpoints(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if args.should_save and folder.is_dir():
                seal(folder, state.global_step)
            return control

    return SealCheckpoints()
