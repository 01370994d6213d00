"""Cost of the eval stage's downstream tasks (lm-evaluation-harness) per model, as the stage runs them: the
`eval.tasks` section of a preset on models given as HF folders, wall time and process CPU time per model.

On a shared machine wall time says little; run with OMP_NUM_THREADS=1 for a single-thread CPU time that
contention hardly inflates (with 2 threads, OpenMP's spin-waiting counts as CPU time). Projection to 2 idle
cores: single-thread CPU / 1.6 (best case) up to / 1.0 (small generation batches barely use a second core).

    OMP_NUM_THREADS=1 python bench/eval_tasks.py --data ../shared/data --model base=MODEL_DIR --model cpt=CPT_DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.environ.get("DILFORGE_DATA", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "az-small.yaml")
    ap.add_argument("--model", action="append", required=True, help="label=HF folder (repeat)")
    args = ap.parse_args()
    import torch
    import yaml
    from dilforge_eval import downstream
    from dilforge_eval.config import DownstreamTasks
    from dilforge_eval.resolve import eval_model, load_model

    raw = args.config.read_text().replace("${DILFORGE_DATA}", args.data)
    tasks = DownstreamTasks.model_validate(yaml.safe_load(raw)["eval"]["tasks"])
    print(describe("transformers", "lm-eval"), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / downstream.TASK_DIR
        specs = downstream.prepare(tasks, out, None)
        print(f"{len(specs)} tasks: " + ", ".join(f"{s.key} (n={s.num_examples})" for s in specs))
        for item in args.model:
            label, folder = item.split("=", 1)
            model, tok = load_model(eval_model(label, folder, folder, None), "cpu", torch.float32)
            t0, c0 = time.perf_counter(), time.process_time()
            downstream.run_model(
                model,
                tok,
                specs,
                out,
                tasks,
                Path(tmp) / "cache",
                0,
            )
            print(
                f"{label}: tasks {time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU "
                f"({torch.get_num_threads()} threads)",
                flush=True,
            )


if __name__ == "__main__":
    main()
