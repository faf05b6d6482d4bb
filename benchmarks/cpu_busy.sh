#!/usr/bin/env bash
# The CPU path on a quiet machine and beside a process that keeps one core busy, in one
# sitting: one stream of the embedded model (128 greedy tokens, 3 runs after a warm-up, each
# in a fresh process), then `octavo bench serve` at 2 requests/s (32 requests of 64 words, 64
# tokens each) against `octavo serve`. JSON lands in $OUT (default docs/results/cpu/busy/).
#   [OUT=dir] bash benchmarks/cpu_busy.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-docs/results/cpu/busy}
mkdir -p "$out"
single() {  # label
  python - "$1" <<'PY'
import json, sys, time
from octavo import LLM, SamplingParams
llm = LLM()
llm.generate("warm up", SamplingParams(max_tokens=8), use_tqdm=False)
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
rates = []
for _ in range(3):
    start = time.perf_counter()
    out = llm.generate("Once upon a time", params, use_tqdm=False)
    rates.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - start))
print(json.dumps({"machine": sys.argv[1], "tok_s": [round(r, 1) for r in rates]}))
PY
}
spin() { taskset -c 0 python -c "while True: pass" > /dev/null 2>&1 & echo $!; }

single quiet | tail -1 > "$out/single_quiet.json"
pid=$(spin); sleep 1; single busy | tail -1 > "$out/single_busy.json"; kill "$pid"

octavo serve --port 8011 > /tmp/octavo_busy_serve.log 2>&1 &
server=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
common=(--base-url http://127.0.0.1:8011 --request-rate 2 --num-prompts 32 --input-len 64 --max-tokens 64 --seed 0)
octavo bench serve "${common[@]}" --json "$out/serve_quiet.json" | grep -E "^(Output token|Mean TPOT|Mean TTFT)"
pid=$(spin); sleep 1
octavo bench serve "${common[@]}" --json "$out/serve_busy.json" | grep -E "^(Output token|Mean TPOT|Mean TTFT)"
kill "$pid" "$server"; wait "$server" 2>/dev/null
cat "$out"/single_*.json
