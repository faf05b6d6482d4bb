#!/usr/bin/env bash
# Serving on the CPU against the peers: `octavo bench serve` at two Poisson request rates (32
# requests of 64 words, 64 output tokens each; `inf`: all at once, the batch) against `octavo
# serve` with the embedded model, then against `transformers serve` on the same weights (HF's
# OpenAI-compatible server, with continuous batching), and llama.cpp's `llama-server -np 8` on
# the same GGUF file (LLAMA_CPP_BIN: the folder holding llama-server, built from the source in
# the llama-cpp-python sdist), in one run. JSON lands in $OUT (default docs/results/cpu/serve/).
#   [SERVERS="octavo hf llamacpp"] [OUT=dir] bash benchmarks/cpu_serve.sh [rate ...]
set -u
cd "$(dirname "$0")/.."
rates=${*:-0.5 2}
out=${OUT:-docs/results/cpu/serve}
mkdir -p "$out"
gguf=$(python -c "from octavo.checkpoint.embedded import embedded_model_path; print(embedded_model_path())")
common=(--num-prompts 32 --input-len 64 --max-tokens 64 --seed 0)

wait_up() {  # url, seconds
  for _ in $(seq "$2"); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "server at $1 did not come up" >&2; return 1
}

servers=${SERVERS:-octavo hf}

if [[ $servers == *llamacpp* ]]; then
# 8 slots of 1,024 tokens each (64 words + 64 tokens fit), 2 threads as the machine's cores.
"${LLAMA_CPP_BIN:?the folder of llama-server}/llama-server" -m "$gguf" --port 8013 -t 2 \
  -np 8 -c 8192 -cb > /tmp/llamacpp_serve.log 2>&1 &
pid=$!
if wait_up http://127.0.0.1:8013/health 120; then
  for rate in $rates; do
    octavo bench serve --base-url http://127.0.0.1:8013 --request-rate "$rate" "${common[@]}" \
      --model smollm2 --json "$out/llamacpp_rate_$rate.json"
  done
fi
kill $pid; wait $pid 2>/dev/null
fi

if [[ $servers == *octavo* ]]; then
octavo serve --port 8011 > /tmp/octavo_serve.log 2>&1 &
pid=$!
if wait_up http://127.0.0.1:8011/health 180; then
  for rate in $rates; do
    octavo bench serve --base-url http://127.0.0.1:8011 --request-rate "$rate" "${common[@]}" \
      --json "$out/octavo_rate_$rate.json"
  done
fi
kill $pid; wait $pid 2>/dev/null
fi

if [[ $servers == *hf* ]]; then
# transformers serve cannot take this GGUF itself (its GGUF config has no `architectures`), so
# the same weights go through transformers' own GGUF loader into an HF directory first. It
# knows no ignore_eos: a generation_config that turns EOS off does that instead.
hf_dir=/tmp/smollm2-hf
python - "$gguf" "$hf_dir" <<'PY'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1:]
kw = dict(gguf_file=os.path.basename(gguf))
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), dtype=torch.float32, **kw)
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config  # the weights are dequantized float32 already
plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
plain.load_state_dict(model.state_dict())
plain.generation_config = model.generation_config
plain.save_pretrained(out)
AutoTokenizer.from_pretrained(os.path.dirname(gguf), **kw).save_pretrained(out)
PY
transformers serve "$hf_dir" --port 8012 --device cpu --dtype float32 \
  --continuous-batching > /tmp/hf_serve.log 2>&1 &
pid=$!
if wait_up http://localhost:8012/health 300; then
  for rate in $rates; do
    octavo bench serve --base-url http://localhost:8012 --request-rate "$rate" "${common[@]}" \
      --model "$hf_dir" \
      --no-ignore-eos --extra-body '{"generation_config": "{\"eos_token_id\": -1}"}' \
      --json "$out/hf_rate_$rate.json"
  done
fi
kill $pid; wait $pid 2>/dev/null
fi
