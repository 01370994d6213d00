"""SFT's Trainer checkpoints, sealed with a digest marker after each save; resuming takes the newest that
verifies and sets a damaged one aside (outside Trainer's rotation)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from dilforge_shared.checkpoint_digests import seal, set_aside, verify

log = logging.getLogger("dilforge.sft")

PREFIX = "checkpoint"  # Trainer's checkpoint folders are `checkpoint-<step>` (transformers' PREFIX_CHECKPOINT_DIR)
DAMAGED_PREFIX = "damaged-"


def latest_checkpoint(folder: Path) -> Path | None:
    """Newest Trainer checkpoint whose files match their digests. Cut-off ones (trainer_state.json, written last,
    missing or unparsable) are removed first; a damaged or unsealed one is set aside with a warning and the
    previous one is tried."""
    if not folder.is_dir():
        return None
    complete = []
    for path in folder.glob(f"{PREFIX}-*"):
        try:
            json.loads((path / "trainer_state.json").read_text())
        except (ValueError, OSError):
            log.warning("removing incomplete checkpoint %s (no complete trainer_state.json)", path)
            shutil.rmtree(path, ignore_errors=True)
            continue
        if re.fullmatch(rf"{PREFIX}-\d+", path.name):
            complete.append(path)
    for path in sorted(complete, key=lambda p: int(p.name.rpartition("-")[2]), reverse=True):
        problem = verify(path)
        if problem is None:
            return path
        aside = set_aside(path, DAMAGED_PREFIX + path.name)
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

    class SealCheckpoints(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"{PREFIX}-{state.global_step}"
            if args.should_save and folder.is_dir():
                seal(folder, state.global_step)
            return control

    return SealCheckpoints()
