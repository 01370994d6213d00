"""Where transformers' Trainer writes and finds its checkpoint folders."""

from __future__ import annotations

from pathlib import Path

from . import first_use


def trainer_checkpoint_prefix() -> str:
    """The name Trainer gives its checkpoint folders (`<prefix>-<step>`)."""
    first_use()
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return PREFIX_CHECKPOINT_DIR


def last_trainer_checkpoint(folder: Path) -> str | None:
    """The newest `checkpoint-<step>` folder Trainer would resume from, or None."""
    first_use()
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(folder))
