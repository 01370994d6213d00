#!/usr/bin/env bash
# CI, after the main job: the README's serve command on its result and the README's curl; the answer must come
# back and end at the end of the assistant's turn (finish_reason "stop", no invented next turn). About a minute.
#
#   bash scripts/ci_serve.sh            # needs .dilforge/store from `coordinator run-all -c configs/az-small.yaml`
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
log=$(mktemp)
# --force: the main job's SFT model is still below the assistant gate's thresholds (answers in Azerbaijani, ending
# the turn; docs/eval.md); this checks serving, not the model. Remove it once the SFT recipe passes the gate.
.venv/bin/coordinator serve --run az-small --port "$PORT" --force >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "ci_serve: the server exited"; exit 1; }
  sleep 1
done
# the README's curl, verbatim
answer=$(curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "az-small-sft", "messages": [{"role": "user", "content": "Azərbaycanın paytaxtı haradır?"}], "max_tokens": 64}')
echo "$answer"
.venv/bin/python - "$answer" <<'PY'
import json, sys
res = json.loads(sys.argv[1])
choice = res["choices"][0]
text = choice["message"]["content"]
assert text.strip(), "empty answer"
assert choice["finish_reason"] == "stop", f"the answer did not end at the end of the turn: {choice}"
assert not any(marker in text for marker in ("<|im_start|>", "<|im_end|>", "\nuser\n", "\nassistant\n")), text
print(f"ci_serve: ok ({res['usage']['completion_tokens']} tokens, finish_reason stop)")
PY
