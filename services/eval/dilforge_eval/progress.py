"""Progress with an ETA for the passes that take minutes on CPU (BPB per model and set, generation), by the
shared helper (dilforge_shared.progress: a tqdm bar on a TTY, periodic log lines otherwise).

The BPB pass is counted by a forward hook on the model's decoder (one call per batch of windows), so it
does not depend on how the BPB code loops.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager

from dilforge_shared.progress import Progress

log = logging.getLogger("dilforge.eval")


def num_bpb_batches(num_tokens: int, window: int, stride: int, batch_size: int) -> int:
    """Forward passes of a sliding-window BPB pass over num_tokens (+ BOS): an estimate for the ETA only."""
    stride = max(1, min(stride, window - 1))
    windows = 1 + max(0, math.ceil((num_tokens + 1 - window) / stride))
    return math.ceil(windows / batch_size)


@contextmanager
def forward_progress(model, total: int | None, desc: str, **kwargs) -> Iterator[Progress]:
    """Ticks a bar once per forward of the model's decoder (or of the model when it has none)."""
    module = model.get_decoder() if hasattr(model, "get_decoder") else model
    progress = Progress(desc, total, unit="batch", log=log, **kwargs)
    handle = module.register_forward_hook(lambda *_: progress.update(1))
    try:
        yield progress
    finally:
        handle.remove()
        progress.close()
