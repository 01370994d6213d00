"""Helpers of the GPU suite: synthetic text and the environment for stage subprocesses."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

WORDS = [
    "Bakı",
    "Azərbaycan",
    "paytaxt",
    "şəhər",
    "dil",
    "xalq",
    "tarix",
    "mədəniyyət",
    "dəniz",
    "Xəzər",
    "neft",
    "musiqi",
    "kitab",
    "məktəb",
    "universitet",
    "elm",
    "dağ",
    "çay",
    "meşə",
    "yol",
    "ev",
    "ailə",
    "uşaq",
    "dost",
    "iş",
    "gün",
    "il",
    "yeni",
    "böyük",
    "kiçik",
    "gözəl",
    "qədim",
    "və",
    "ilə",
    "üçün",
    "da",
    "də",
    "bu",
    "o",
    "bir",
    "çox",
    "ən",
    "daha",
    "var",
    "idi",
    "olur",
    "edir",
]


def synthetic_lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 24))).capitalize() + "." for _ in range(n)]


def stage_env() -> dict[str, str]:
    """Environment for stage subprocesses: the packages from the checkout (PYTHONPATH) when not installed."""
    root = Path(__file__).resolve().parents[2]
    paths = [
        root / "shared",
        *[root / "services" / s for s in ("tokenizer", "cpt", "sft", "eval")],
        root / "coordinator",
    ]
    extra = os.pathsep.join(str(p) for p in paths)
    return {
        **os.environ,
        "PYTHONPATH": extra + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHON": sys.executable,
    }
