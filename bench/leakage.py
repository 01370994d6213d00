"""Issue 24: the step-0 leakage table of every transplant initialisation (bench/init_experiments.py; the
CPT stage trains mean_of_pieces only and scores just that one at step 0).

Step 0 (no training): the model and tokenizer artifacts of a pipeline run (`coordinator run model` and
`run tokenizer` with the same config and store; nothing else is needed) are loaded exactly as the CPT
stage loads them (`model_init.load_model`), the training corpora's first windows are tokenised for the
calibrated initialisations, and `init_experiments.compare_initialisations` scores every initialisation on
the config's CPT validation sets plus any --extra set: BPB with the extended tokenizer, BPB of the base
tokenisation under the full softmax (the leakage term) and the base model's BPB on the same text.

    python bench/leakage.py --data ../shared/data --store /tmp/leak/store [--untied] [--extra-heldout 100]

The az-small settings of the published table: --calibration-num-windows 64 --calibration-retain-weight 2
--retain-corpora en-replay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe

ROOT = Path(__file__).resolve().parents[1]
XWMT = "az/dev/xwmt_test.az-en.{}.txt"


def step0(args) -> dict:
    import init_experiments
    import torch
    from dilforge_coordinator.config import load_pipeline
    from dilforge_coordinator.records import ArtifactStore
    from dilforge_cpt import model_init
    from dilforge_cpt.data import PackedData, build_validation, cache_key, load_tokenizer, special_ids, tokenize_to_file
    from dilforge_cpt.leakage import build_probe, format_table
    from dilforge_cpt.runtime import Runtime
    from dilforge_shared.configs import DataSource
    from dilforge_shared.models import find_dir

    torch.manual_seed(0)
    pipe = load_pipeline(
        Path(args.config), {"store.uri": args.store}, {"DILFORGE_DATA": str(Path(args.data).resolve())}
    )
    record = json.loads(ArtifactStore(args.store).read_run_record(pipe.run_id))
    paths = {}
    for stage in ("model", "tokenizer"):
        entry = record["stages"][stage]
        uri = ArtifactStore(args.store).resolve(entry.get("artifact") or entry["artifact_uri"])
        paths[stage] = (
            find_dir(Path(uri.removeprefix("file://")), "model", uri)
            if stage == "model"
            else next(Path(uri.removeprefix("file://")).glob("data-*"))
        )
    validation = list(pipe.cpt.validation)
    if args.extra_heldout:
        validation.append(DataSource(uri=str(Path(args.data) / XWMT.format("en")), name="xwmt-en"))
    cfg = pipe.cpt.model_copy(update={"validation": validation})
    settings = init_experiments.Settings(
        retain_corpora=args.retain_corpora.split(",") if args.retain_corpora else [],
        calibration_num_windows=args.calibration_num_windows,
        calibration_retain_weight=args.calibration_retain_weight,
        fit_ridge=args.fit_ridge,
        untie_embeddings=args.untied,
    )
    tok = load_tokenizer(paths["tokenizer"])
    ids = special_ids(tok, str(paths["tokenizer"]))
    rt = Runtime()
    t0 = time.perf_counter()
    val = build_validation(cfg.validation[: len(pipe.cpt.validation)], tok, ids, cfg.num_validation_docs, None)
    if args.extra_heldout:
        val += build_validation(cfg.validation[len(pipe.cpt.validation) :], tok, ids, args.extra_heldout, None)
    cache = Path(tempfile.mkdtemp(prefix="leak-bench-"))
    files = [
        tokenize_to_file(
            src,
            tok,
            ids,
            cache,
            cache_key(src, paths["tokenizer"] / "tokenizer.json", args.max_docs or src.max_docs, None),
            args.max_docs or src.max_docs,
            1000,
            None,
        )
        for src in cfg.corpora
    ]
    data = PackedData(files, [c.weight for c in cfg.corpora], cfg.seq_len, cfg.seed)
    base = model_init.BaseModel(paths["model"], str(paths["model"]))
    model, pending, report = model_init.load_model(cfg, base, tok, ids, rt)
    probe, why = build_probe(cfg, pending.base_tok, pending.mapping, tok, ids, None)
    if probe is None:
        sys.exit(f"no leakage probe: {why}")
    if args.extra_heldout:  # the extra sets read args.extra_heldout documents, not num_validation_docs
        extra = build_probe(
            cfg.model_copy(
                update={
                    "validation": cfg.validation[len(pipe.cpt.validation) :],
                    "num_validation_docs": args.extra_heldout,
                }
            ),
            pending.base_tok,
            pending.mapping,
            tok,
            ids,
            None,
        )[0]
        head = build_probe(
            cfg.model_copy(update={"validation": cfg.validation[: len(pipe.cpt.validation)]}),
            pending.base_tok,
            pending.mapping,
            tok,
            ids,
            None,
        )[0]
        probe = type(probe)(head.sets + extra.sets, probe.kept, probe.mapping)
    methods = args.methods.split(",") if args.methods else None
    table, _ = init_experiments.compare_initialisations(
        model, pending, val, cfg, settings, rt, data, probe, methods, trained=args.trained
    )
    return {
        "table": table,
        "markdown": format_table(table),
        "calibration": pending.report.get("calibration"),
        "fit": pending.report.get("fit"),
        "tied": report.get("tied"),
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--store", required=True, help="store holding the config's model and tokenizer artifacts")
    ap.add_argument("--config", default=str(ROOT / "configs/az-small.yaml"))
    ap.add_argument("--untied", action="store_true", help="untie_embeddings: true (a tied base gets its own LM head)")
    ap.add_argument("--trained", default="mean_of_pieces", help="initialisation measured last (the run's own)")
    ap.add_argument(
        "--extra-heldout",
        type=int,
        default=0,
        help="also score the first N English sentences of the xwmt test set (news, never trained on)",
    )
    ap.add_argument("--methods", default=None, help="comma-separated initialisations (default: the stage's five)")
    ap.add_argument("--fit-ridge", type=float, default=0.1, help="fit_ridge of the fitted initialisation")
    ap.add_argument("--calibration-num-windows", type=int, default=64, help="windows sampled for the fits")
    ap.add_argument("--calibration-retain-weight", type=float, default=2.0, help="retain positions' weight")
    ap.add_argument("--retain-corpora", default="en-replay", help="comma list: corpora in the base model's language")
    ap.add_argument(
        "--max-docs",
        type=int,
        default=None,
        help="documents tokenised per corpus for the calibration (default: each corpus's max_docs, as the stage)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(describe("transformers"), flush=True)
    result = {"step0": step0(args)}
    print(
        f"\nstep-0 leakage table ({'untied' if args.untied else 'as the base model ties'}; "
        f"{result['step0']['seconds']:.0f} s):"
    )
    print(result["step0"]["markdown"])
    print("calibration:", result["step0"]["calibration"])
    print("fit:", result["step0"]["fit"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
