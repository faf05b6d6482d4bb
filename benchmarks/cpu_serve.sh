#!/usr/bin/env bash
# Issue "server" measurement on the CPU: `octavo bench serve` at two Poisson request rates
# against `octavo serve` (the embedded model), then against `transformers serve` on the same
# GGUF file (HF's OpenAI-compatible server), where it runs. JSON lands in docs/results/serve/.
#   bash benchmarks/cpu_serve.sh [rate1 rate2]
set -u
cd "$(dirname "$0")/.."
rates=${*:-0.5 2}
out=docs/results/serve
mkdir -p "$out"
gguf=$(python -c "from octavo.model.embedded import embedded_model_path; print(embedded_model_path())")
common=(--num-prompts 32 --input-len 64 --max-tokens 64 --seed 0)

wait_up() {  # url, seconds
  for _ in $(seq "$2"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "server at $1 did not come up" >&2; return 1
}

octavo serve --port 8011 > /tmp/octavo_serve.log 2>&1 &
pid=$!
if wait_up http://127.0.0.1:8011/health 180; then
  for rate in $rates; do
    octavo bench serve --base-url http://127.0.0.1:8011 --request-rate "$rate" "${common[@]}" \
      --json "$out/octavo_rate_$rate.json"
  done
fi
kill $pid; wait $pid 2>/dev/null

# transformers serve: the GGUF as `<dir>:<file>`; it knows no ignore_eos, so it gets a
# generation_config that turns EOS off instead.
transformers serve "$(dirname "$gguf"):$(basename "$gguf")" --port 8012 --device cpu \
  --continuous-batching > /tmp/hf_serve.log 2>&1 &
pid=$!
if wait_up http://localhost:8012/health 300; then
  for rate in $rates; do
    octavo bench serve --base-url http://localhost:8012 --request-rate "$rate" "${common[@]}" \
      --no-ignore-eos --extra-body '{"generation_config": "{\"eos_token_id\": -1}"}' \
      --json "$out/hf_rate_$rate.json"
  done
fi
kill $pid; wait $pid 2>/dev/null
