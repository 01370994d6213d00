"""Issue 24: what the extension's number tokens do to English (`tokenizer.digit_tokens`).

Runs the az-small tokenizer stage twice on one store (`coordinator run model` + `run tokenizer`, own run ids):
`digit_tokens: learn` and `as_base`. For each published tokenizer it prints how many new tokens hold a digit,
how often new tokens are produced on FLORES dev English (and how many of those uses are digit tokens), and
tokens per word on FLORES dev Azerbaijani and English next to the base's.

    python bench/digit_tokens.py --data ../shared/data --store /tmp/digits/store
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hardware import describe

ROOT = Path(__file__).resolve().parents[1]
FLORES = "az/dev/flores200.dev.partial_from_sib200.tsv"


def published(store: str, run: str, stage: str) -> Path:
    from dilforge_coordinator.records import ArtifactStore
    from dilforge_shared.models import find_dir

    st = ArtifactStore(store)
    entry = json.loads(st.read_run_record(run))["stages"][stage]
    uri = st.resolve(entry.get("artifact") or entry["artifact_uri"])
    root = Path(uri.removeprefix("file://"))
    return find_dir(root, "model", uri) if stage == "model" else next(root.glob("data-*"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--config", default=str(ROOT / "configs/az-small.yaml"))
    args = ap.parse_args()
    import yaml
    from dilforge_shared.corpus import iter_texts
    from tokenizers import Tokenizer

    print(describe("tokenizers"), flush=True)
    flores = {
        lang: list(iter_texts(str(Path(args.data) / FLORES), text_field=f))
        for lang, f in (("az", "azj_Latn"), ("en", "eng_Latn"))
    }
    env = {**os.environ, "DILFORGE_STORE": args.store}
    rows, base = [], None
    for mode in ("learn", "as_base"):
        cfg = yaml.safe_load(Path(args.config).read_text())
        cfg["run_id"] = f"digits-{mode}"
        cfg["tokenizer"]["digit_tokens"] = mode
        path = Path(tempfile.mkdtemp(prefix="digits-")) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        for stage in ("model", "tokenizer"):
            cmd = [sys.executable, "-m", "dilforge_coordinator.cli", "run", stage, "-c", str(path), "--data", args.data]
            if subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, check=False).returncode:
                sys.exit(f"{mode}: coordinator run {stage} failed")
        base = Tokenizer.from_file(str(published(args.store, cfg["run_id"], "model") / "tokenizer.json"))
        ext = Tokenizer.from_file(str(published(args.store, cfg["run_id"], "tokenizer") / "tokenizer.json"))
        first = base.get_vocab_size(with_added_tokens=True)
        digit = {
            i for t, i in ext.get_vocab(with_added_tokens=True).items() if i >= first and any(c.isdigit() for c in t)
        }
        uses = [i for e in ext.encode_batch(flores["en"], add_special_tokens=False) for i in e.ids if i >= first]

        def tpw(tok, docs):
            return sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False)) / sum(
                len(d.split()) for d in docs
            )

        rows.append(
            (mode, len(digit), len(uses), sum(i in digit for i in uses), tpw(ext, flores["az"]), tpw(ext, flores["en"]))
        )
    print(
        "| digit_tokens | new tokens holding a digit | new-token uses on FLORES dev en | of them digit tokens "
        "| az tokens/word | en tokens/word |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for mode, nd, nu, ndu, az, en in rows:
        print(f"| {mode} | {nd} | {nu} | {ndu} | {az:.3f} | {en:.3f} |")
    print(f"| base | – | – | – | {tpw(base, flores['az']):.3f} | {tpw(base, flores['en']):.3f} |")


if __name__ == "__main__":
    main()
