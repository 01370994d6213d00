"""Issue 24: does the leakage come back during CPT, and what keeps English — CPT arms of the README main
job's CPT stage compared on held-out text.

Each arm is `configs/az-small.yaml` (same data, steps, batch, seed) with a few `cpt:` fields changed
(`--arm NAME:FIELD=VALUE;FIELD=VALUE`, values as YAML) and its own run id on one store: `coordinator
run model`, `run tokenizer` (reused after the first arm) and `run cpt`. Every CPT model is then scored on
text neither CPT's training nor its validation saw — the first N sentences of the X-WMT test set per
language and FLORES dev sentences 17..16+N (the CPT validation is sentences 1..16) — against SmolLM2 with
its own tokenizer in the same process, 256-token windows stepping 128 (as eval). The CPT manifest's
leakage (flores-en, base tokenisation / base model − 1) is printed at step 0 and after training.

    python bench/leakage_cpt.py --data ../shared/data --store /tmp/leak-cpt/store \\
        --arm default: --arm replay40:'corpora[3].weight=0.4' [--recalibrate]

--recalibrate also scores each trained model after the loop's counter-measure applied once at the end
(`init_experiments.recalibrate`, what the former `leakage_tolerance` did at the final validation), without
training again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe

ROOT = Path(__file__).resolve().parents[1]
FLORES = "az/dev/flores200.dev.partial_from_sib200.tsv"
XWMT = "az/dev/xwmt_test.az-en.{}.txt"


def stage_uri(store, record: dict, stage: str) -> str:
    """A run record's artifact of `stage` as a URI (relative addresses resolve inside the store)."""
    entry = record["stages"][stage]
    return store.resolve(entry.get("artifact") or entry["artifact_uri"])


def held_out(data: Path, n: int) -> dict[str, list[str]]:
    from dilforge_shared.corpus import iter_texts

    return {
        "xwmt-az": list(islice(iter_texts(str(data / XWMT.format("az"))), n)),
        "xwmt-en": list(islice(iter_texts(str(data / XWMT.format("en"))), n)),
        "flores17-az": list(islice(iter_texts(str(data / FLORES), text_field="azj_Latn"), 16, 16 + n)),
        "flores17-en": list(islice(iter_texts(str(data / FLORES), text_field="eng_Latn"), 16, 16 + n)),
    }


def bpb_of(model_dir: Path, sets: dict[str, list[str]], loaded=None) -> dict[str, float]:
    import torch
    from dilforge_cpt.data import load_tokenizer, special_ids
    from dilforge_eval.measures import sliding_window_bpb
    from dilforge_shared.bpb import build_stream
    from transformers import AutoModelForCausalLM

    if loaded is None:
        tok = load_tokenizer(model_dir)
        ids = special_ids(tok, str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, trust_remote_code=False)
    else:
        model, tok, ids = loaded
    model.eval()
    out = {}
    for name, docs in sets.items():
        enc = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
        out[name] = sliding_window_bpb(model, build_stream(docs, enc, ids.bos, ids.doc_end), 256, 128, 8).bpb
    return out


def set_field(cfg: dict, path: str, value) -> None:
    """cpt.<path> = value; path like `transplant` or `corpora[3].weight`."""
    node, parts = cfg["cpt"], re.findall(r"[^.\[\]]+", path)
    for p in parts[:-1]:
        node = node[int(p)] if p.isdigit() else node[p]
    last = parts[-1]
    if last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value


def run_arm(name: str, edits: str, args) -> dict:
    import yaml
    from dilforge_coordinator.records import ArtifactStore
    from dilforge_shared.store import read_manifest

    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg["run_id"] = f"leak-cpt-{name}"
    for edit in filter(None, edits.split(";")):
        key, value = edit.split("=", 1)
        set_field(cfg, key.strip(), yaml.safe_load(value))
    path = Path(tempfile.mkdtemp(prefix="leak-cpt-")) / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "DILFORGE_STORE": args.store}
    t0 = time.perf_counter()
    for stage in ("model", "tokenizer", "cpt"):
        cmd = [sys.executable, "-m", "dilforge_coordinator.cli", "run", stage, "-c", str(path), "--data", args.data]
        proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, check=False)
        if proc.returncode:
            sys.exit(f"arm {name}: coordinator run {stage} failed (exit {proc.returncode})")
    seconds = time.perf_counter() - t0
    record = json.loads(ArtifactStore(args.store).read_run_record(cfg["run_id"]))
    uri = stage_uri(ArtifactStore(args.store), record, "cpt")
    manifest, _ = read_manifest(uri)
    leak = [
        {"step": e["step"], **{s: round(r["leakage"], 4) for s, r in e["sets"].items()}}
        for e in manifest.metrics.get("leakage") or []
    ]
    model_dir = next(Path(uri.removeprefix("file://")).glob("data-*"))
    return {"edits": edits, "seconds": seconds, "leakage": leak, "model": str(model_dir), "config": str(path)}


def recalibrated(arm: dict, base_dir: Path, args):
    """The trained CPT model with the loop's counter-measure applied once after training
    (`init_experiments.recalibrate`: the calibrated offsets fitted again on its own hidden states and added to
    its new output rows; what the former `leakage_tolerance` did at a validation above it), and its
    flores-en leakage before and after."""
    import init_experiments
    import torch
    from dilforge_coordinator.config import load_pipeline
    from dilforge_cpt import leakage, transplant
    from dilforge_cpt.data import PackedData, cache_key, load_tokenizer, special_ids, tokenize_to_file
    from dilforge_cpt.runtime import Runtime
    from transformers import AutoModelForCausalLM

    model_dir = Path(arm["model"])
    cfg = load_pipeline(Path(arm["config"]), {"store.uri": args.store}, {"DILFORGE_DATA": args.data}).cpt
    tok, base_tok = load_tokenizer(model_dir), load_tokenizer(base_dir)
    ids = special_ids(tok, str(model_dir))
    cache = Path(tempfile.mkdtemp(prefix="leak-cpt-cache-"))
    files = [
        tokenize_to_file(src, tok, ids, cache, cache_key(src, model_dir / "tokenizer.json", 500, None), 500, 1000, None)
        for src in cfg.corpora
    ]
    data = PackedData(files, [c.weight for c in cfg.corpora], cfg.seq_len, cfg.seed)
    mapping = transplant.build_mapping(base_tok, tok)
    rt = Runtime()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, trust_remote_code=False).eval()
    probe, why = leakage.build_probe(cfg, base_tok, mapping, tok, ids, None)
    if probe is None:
        sys.exit(f"no leakage probe: {why}")
    before = leakage.measure(model, probe, cfg, rt)
    settings = init_experiments.Settings(retain_corpora=["en-replay"], calibration_num_windows=64)
    cal = init_experiments.recalibrate(model, mapping, data, cfg, settings, rt)
    after = leakage.measure(model, probe, cfg, rt)
    row = {
        "calibration": cal.to_report(),
        "leakage_before": {k: v["leakage"] for k, v in before.items()},
        "leakage_after": {k: v["leakage"] for k, v in after.items()},
    }
    return model, tok, ids, row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--config", default=str(ROOT / "configs/az-small.yaml"))
    ap.add_argument("--arm", action="append", required=True, help="NAME:FIELD=VALUE;FIELD=VALUE (cpt fields)")
    ap.add_argument("--num-sentences", type=int, default=100, help="held-out sentences per set")
    ap.add_argument(
        "--recalibrate", action="store_true", help="also score each arm after one post-training re-calibration"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from dilforge_shared.models import find_dir

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(describe("transformers"), flush=True)
    arms = {}
    for spec in args.arm:
        name, _, edits = spec.partition(":")
        arms[name] = run_arm(name, edits, args)
        print(f"arm {name}: CPT done in {arms[name]['seconds']:.0f} s, leakage {arms[name]['leakage']}", flush=True)
    sets = held_out(Path(args.data), args.num_sentences)
    from dilforge_coordinator.records import ArtifactStore

    first = next(iter(arms))
    record = json.loads(ArtifactStore(args.store).read_run_record(f"leak-cpt-{first}"))
    muri = stage_uri(ArtifactStore(args.store), record, "model")
    base_dir = find_dir(Path(muri.removeprefix("file://")), "model", muri)
    base = bpb_of(base_dir, sets)
    print("\nheld-out BPB × base (SmolLM2, own tokenizer: " + ", ".join(f"{k} {v:.4f}" for k, v in base.items()) + ")")
    print("| arm | cpt edits | " + " | ".join(sets) + " | leakage flores-en step 0 → end |")
    print("|---|---|" + "---:|" * len(sets) + "---|")
    for name, arm in arms.items():
        arm["bpb"] = bpb_of(Path(arm["model"]), sets)
        arm["ratio"] = {k: arm["bpb"][k] / base[k] for k in sets}
        leak = " → ".join(f"{e.get('flores-en', float('nan')):+.4f}" for e in arm["leakage"])
        cells = " | ".join(f"{arm['ratio'][k]:.4f}" for k in sets)
        print(f"| {name} | {arm['edits'] or '—'} | {cells} | {leak} |", flush=True)
        if args.recalibrate:
            model, tok, ids, arm["recalibrated"] = recalibrated(arm, base_dir, args)
            rbpb = bpb_of(Path(arm["model"]), sets, (model, tok, ids))
            arm["recalibrated"]["ratio"] = {k: rbpb[k] / base[k] for k in sets}
            cells = " | ".join(f"{arm['recalibrated']['ratio'][k]:.4f}" for k in sets)
            lb, la = arm["recalibrated"]["leakage_before"], arm["recalibrated"]["leakage_after"]
            print(
                f"| {name} + re-calibrated after training | {arm['edits'] or '—'} | {cells} | "
                f"{lb.get('flores-en', float('nan')):+.4f} → {la.get('flores-en', float('nan')):+.4f} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"base": base, "arms": arms}, indent=1))


if __name__ == "__main__":
    main()
