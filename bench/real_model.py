"""The real-model result: SmolLM2-135M-Instruct adapted to Azerbaijani by configs/az-small.yaml, both languages.

Runs the README's main job (`coordinator run-all -c configs/az-small.yaml`; artifacts that already exist are
reused, so a second call only reads them), then prints, from the published manifests:
- bits per byte per model (base = SmolLM2 with its own tokenizer, cpt, sft) on FLORES dev Azerbaijani and English,
  never trained on, with each model's ratio to the base per language (never averaged across languages);
- the step-0 BPB of the trained transplant initialisation per validation set (bench/leakage.py compares the others);
- the issue 9 bars (Azerbaijani ≤ 0.75 × base, English ≤ 1.10 × base) as pass/fail;
- every text set's ratio to the base per model, and issue 24's bars on the held-out news sets (X-WMT, which CPT
  neither trains nor validates on): Azerbaijani ≤ 0.69 × base, English ≤ 1.03 × base;
- the downstream tasks run through lm-evaluation-harness (SIB-200, translation, khazar instructions): per task
  and metric, every model in Azerbaijani and English side by side with its 95 % interval, the chance level and
  the number of examples (the main job's CPU budget keeps these small: read the intervals);
- the eval stage's time, and its time spent in the tasks;
- the wall time of the run (meaningful only when nothing was reused: pass a fresh --store), and the longest time
  it printed nothing, with the line after which that began.

    python bench/real_model.py --data ../shared/data [--store /tmp/fresh-store] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dilforge_cpt.metrics import CptMetrics
from hardware import describe

ROOT = Path(__file__).resolve().parents[1]
AZ_BAR, EN_BAR = 0.75, 1.10
HELDOUT_PREFIX, HELDOUT_AZ_BAR, HELDOUT_EN_BAR = "xwmt", 0.69, 1.03  # issue 24, on text CPT never saw


def run_pipeline(config: Path, data: str, store: str) -> tuple[float, dict, dict]:
    """Run the main job, echoing its output as it comes; also the longest time it printed nothing (issue 29:
    never silent for more than 30 s) and the line after which that silence began. Output is unbuffered, as on
    a terminal."""
    env = {**os.environ, "DILFORGE_STORE": store, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilforge_coordinator.cli", "run-all", "-c", str(config), "--data", data],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    last, previous, silence = t0, "(start)", {"longest_silence_s": 0.0, "after_line": ""}
    for line in proc.stdout:
        now = time.perf_counter()
        if now - last > silence["longest_silence_s"]:
            silence = {"longest_silence_s": round(now - last, 1), "after_line": previous[:200]}
        last, previous = now, line.rstrip("\n")
        sys.stdout.write(line)
    proc.wait()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"run-all failed (exit {proc.returncode})")
    from dilforge_coordinator.records import ArtifactStore

    record = json.loads(ArtifactStore(store).read_run_record("az-small"))
    artifacts = {stage: ArtifactStore(store).resolve(info["artifact"]) for stage, info in record["stages"].items()}
    return seconds, artifacts, silence


def language_sets(eval_metrics: dict) -> dict[str, str]:
    """language → the first text set of that language (the set the report's headline uses)."""
    out: dict[str, str] = {}
    for name, info in eval_metrics["text_sets"].items():
        out.setdefault(info["language"], name)
    return out


def table(artifacts: dict[str, str]) -> dict:
    from dilforge_shared.store import read_manifest

    ev, _ = read_manifest(artifacts["eval"])
    cpt, _ = read_manifest(artifacts["cpt"])
    tok, _ = read_manifest(artifacts["tokenizer"])
    m = ev.metrics
    sets = language_sets(m)
    rows = []
    for model in m["bpb"]:
        row = {"model": model}
        for lang, name in sets.items():
            bpb = m["bpb"][model][name]["bpb"]
            row[lang] = {"set": name, "bpb": bpb, "ratio_to_base": bpb / m["bpb"]["base"][name]["bpb"]}
        rows.append(row)
    bars = {}
    for model in ("cpt", "sft"):
        row = next(r for r in rows if r["model"] == model)
        bars[model] = {
            "az_ratio": row["az"]["ratio_to_base"],
            "az_ok": row["az"]["ratio_to_base"] <= AZ_BAR,
            "en_ratio": row["en"]["ratio_to_base"],
            "en_ok": row["en"]["ratio_to_base"] <= EN_BAR,
        }
    languages = {name: info["language"] for name, info in m["text_sets"].items()}
    per_set = {
        model: {name: m["bpb"][model][name]["bpb"] / m["bpb"]["base"][name]["bpb"] for name in languages}
        for model in m["bpb"]
    }
    heldout_bars = {}
    for model in ("cpt", "sft"):
        ratios = {languages[n]: r for n, r in per_set[model].items() if n.startswith(HELDOUT_PREFIX)}
        if {"az", "en"} <= set(ratios):
            heldout_bars[model] = {
                "az_ratio": ratios["az"],
                "az_ok": ratios["az"] <= HELDOUT_AZ_BAR,
                "en_ratio": ratios["en"],
                "en_ok": ratios["en"] <= HELDOUT_EN_BAR,
            }
    transplant = CptMetrics.model_validate(cpt.metrics).transplant
    # one row per initialisation: its BPB per validation set, and over both sets together ("all")
    step0 = (
        {m: {**transplant.step0_val_bpb_by_set.get(m, {}), "all": v} for m, v in transplant.step0_val_bpb.items()}
        if transplant
        else {}
    )
    return {
        "rows": rows,
        "bars": bars,
        "per_set": per_set,
        "set_languages": languages,
        "heldout_bars": heldout_bars,
        "step0": step0,
        "transplant_method": transplant.method if transplant else None,
        "tasks": task_rows(m.get("downstream") or {}),
        "eval_seconds": m.get("seconds", {}).get("total"),
        "eval_task_seconds": (m.get("cost", {}).get("eval") or {}).get("seconds_tasks"),
        "tokenizer": {k: tok.metrics.get(k) for k in ("languages", "selected_vocab_size")},
        "cpt_tokens": cpt.metrics.get("total_tokens"),
        "eval_bytes_per_set": m.get("max_bytes_per_set"),
    }


def task_rows(d: dict) -> list[dict]:
    """One row per (task, metric): chance, n, and per model and language the value with its 95 % interval."""
    rows: dict[tuple[str, str], dict] = {}
    for key, t in (d.get("tasks") or {}).items():
        for metric in t["headline_metrics"]:
            row = rows.setdefault(
                (t["row"], metric), {"task": t["row"], "metric": metric, "chance": {}, "n": {}, "values": {}}
            )
            row["chance"][t["language"]] = t["chance"].get(metric)
            row["n"][t["language"]] = t["num_examples"]
            for model, res in (d.get("results") or {}).items():
                if metric in res.get(key, {}):
                    row["values"].setdefault(model, {})[t["language"]] = res[key][metric]
    return list(rows.values())


def _cell(v: dict | None) -> str:
    if not v:
        return "–"
    ci = v.get("ci95")
    digits = 1 if v["value"] > 1 or (ci and ci[1] > 1) else 3
    return f"{v['value']:.{digits}f}" + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")


def task_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    models = list(dict.fromkeys(m for r in rows for m in r["values"]))
    langs = ["az", "en"]
    head = ["task", "metric", "n (az/en)", "chance (az/en)"] + [f"{m} {lang}" for m in models for lang in langs]
    lines = ["", "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        n = "/".join(str(r["n"].get(lang, "–")) for lang in langs)
        chance = "/".join("–" if r["chance"].get(lang) is None else f"{r['chance'][lang]:.3g}" for lang in langs)
        cells = [_cell(r["values"].get(m, {}).get(lang)) for m in models for lang in langs]
        lines.append(f"| {r['task']} | {r['metric']} | {n} | {chance} | " + " | ".join(cells) + " |")
    return lines


def markdown(result: dict) -> str:
    lines = ["| model | Azerbaijani BPB | × base | English BPB | × base |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['az']['bpb']:.4f} | {r['az']['ratio_to_base']:.3f} | "
            f"{r['en']['bpb']:.4f} | {r['en']['ratio_to_base']:.3f} |"
        )
    lines += ["", f"bars (Azerbaijani ≤ {AZ_BAR} × base, English ≤ {EN_BAR} × base):"]
    for model, b in result["bars"].items():
        lines.append(
            f"- {model}: az {b['az_ratio']:.3f} ({'ok' if b['az_ok'] else 'MISSED'}), "
            f"en {b['en_ratio']:.3f} ({'ok' if b['en_ok'] else 'MISSED'})"
        )
    names = list(result.get("set_languages") or {})
    if names:
        lines += ["", "| × base per text set | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for model, ratios in result["per_set"].items():
            lines.append(f"| {model} | " + " | ".join(f"{ratios[n]:.4f}" for n in names) + " |")
    if result.get("heldout_bars"):
        lines += [
            "",
            f"held-out bars (issue 24; {HELDOUT_PREFIX} sets: Azerbaijani ≤ {HELDOUT_AZ_BAR} × base, "
            f"English ≤ {HELDOUT_EN_BAR} × base):",
        ]
        for model, b in result["heldout_bars"].items():
            lines.append(
                f"- {model}: az {b['az_ratio']:.4f} ({'ok' if b['az_ok'] else 'MISSED'}), "
                f"en {b['en_ratio']:.4f} ({'ok' if b['en_ok'] else 'MISSED'})"
            )
    if result["step0"]:
        names = sorted({s for v in result["step0"].values() for s in v} - {"all"}) + ["all"]
        lines += ["", "| step-0 BPB (CPT validation) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for method, v in result["step0"].items():
            mark = " (trained)" if method == result["transplant_method"] else ""
            lines.append(f"| {method}{mark} | " + " | ".join(f"{v.get(n, float('nan')):.4f}" for n in names) + " |")
    lines += task_markdown(result.get("tasks") or [])
    if result.get("eval_seconds") is not None:
        lines += [
            "",
            (
                f"eval stage: {result['eval_seconds']:.0f} s, of which downstream tasks "
                f"{result.get('eval_task_seconds') or 0:.0f} s"
            ),
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.environ.get("DILFORGE_DATA", str(ROOT.parent / "shared" / "data")))
    ap.add_argument("--store", default=os.environ.get("DILFORGE_STORE", str(ROOT / ".dilforge" / "store")))
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "az-small.yaml")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()
    print(describe("transformers", "tokenizers"), flush=True)
    seconds, artifacts, silence = run_pipeline(args.config, args.data, args.store)
    result = {"wall_seconds": round(seconds, 1), **silence, "hardware": describe("transformers"), **table(artifacts)}
    print(f"\nrun-all wall time: {seconds:.0f} s (artifacts reused where they existed)")
    print(f"longest silence: {silence['longest_silence_s']:.1f} s, after: {silence['after_line']}\n")
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
