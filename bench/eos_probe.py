"""Issue 24: does a CPT model end the text where a zero-shot prompt wants an answer?

For each run's CPT model (and SmolLM2 itself, the first run's model artifact) the probability of the
end-of-text token right after the translation task's prompt (`Azerbaijani: {source}\\nEnglish:` and the other
direction, as eval's downstream translation task builds it), averaged over the first N X-WMT test sentences,
and the greedy answer to the first prompt of each direction. A model trained on one sentence per document
learns to end the text after any sentence, and then answers these prompts with nothing.

    python bench/eos_probe.py --data ../shared/data --store /tmp/exp24/s1 --run leak-cpt-default --run leak-cpt-p30
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe

XWMT = "az/dev/xwmt_test.az-en.{}.txt"


def model_dir(store, run: str, stage: str) -> Path:
    from dilforge_shared.models import find_dir

    entry = json.loads(store.read_run_record(run))["stages"][stage]
    uri = store.resolve(entry.get("artifact") or entry["artifact_uri"])
    root = Path(uri.removeprefix("file://"))
    return find_dir(root, "model", uri) if stage == "model" else next(root.glob("data-*"))


def probe(path: Path, prompts: dict[str, list[str]], max_new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False).eval()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")  # the ChatML family's document end (SmolLM2)
    if eos is None or eos == tok.unk_token_id:
        sys.exit(f"{path}: no <|endoftext|> token (this probe is for ChatML-family models such as SmolLM2)")
    out = {}
    with torch.no_grad():
        for direction, texts in prompts.items():
            probs = []
            for text in texts:
                ids = tok(text, return_tensors="pt").input_ids
                probs.append(float(model(ids).logits[0, -1].softmax(-1)[eos]))
            ids = tok(texts[0], return_tensors="pt").input_ids
            answer = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1] :]
            out[direction] = {"p_eos": sum(probs) / len(probs), "first_answer": tok.decode(answer)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", action="append", required=True, help="run id whose CPT artifact is probed")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from dilforge_coordinator.records import ArtifactStore
    from dilforge_shared.corpus import iter_texts

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(describe("transformers"), flush=True)
    data = Path(args.data)
    az = list(islice(iter_texts(str(data / XWMT.format("az"))), args.num_prompts))
    en = list(islice(iter_texts(str(data / XWMT.format("en"))), args.num_prompts))
    prompts = {
        "az-en": [f"Azerbaijani: {s}\nEnglish:" for s in az],
        "en-az": [f"English: {s}\nAzerbaijani:" for s in en],
    }
    store = ArtifactStore(args.store)
    models = {"base (SmolLM2)": model_dir(store, args.run[0], "model")}
    models.update({run: model_dir(store, run, "cpt") for run in args.run})
    result = {}
    print("| model | P(end of text) after 'English:' | after 'Azerbaijani:' | first greedy answer into English |")
    print("|---|---:|---:|---|")
    for name, path in models.items():
        result[name] = probe(path, prompts, args.max_new_tokens)
        r = result[name]
        answer = r["az-en"]["first_answer"].replace("\n", "\\n").replace("|", "\\|")
        print(f"| {name} | {r['az-en']['p_eos']:.3f} | {r['en-az']['p_eos']:.3f} | {answer} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
