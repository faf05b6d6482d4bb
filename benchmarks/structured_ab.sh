#!/usr/bin/env bash
# Structured outputs' host cost, this tree against the one in ab/base (a copy of another
# commit's octavo/), on the device: the kernel's and the structured GPU tests, then
# decode_host_probe.py --structured --breakdown on each tree in turn.
#   OUT=dir [SKIP_TESTS=1] bash benchmarks/structured_ab.sh [rounds]
set -u
OUT=${OUT:-/tmp/structured_ab}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python -m pytest -q tests/gpu/test_token_bitmask_kernel.py tests/gpu/test_structured_gpu.py \
    tests/gpu/test_e2e_gpu.py 2>&1 | tail -5 > "$OUT/gpu_tests.log"
  cat "$OUT/gpu_tests.log"
fi
for round in $(seq 1 "${1:-1}"); do
  for kind in integer string; do
    for tree in new base; do
      path=.; [ "$tree" = base ] && path=ab/base
      PYTHONPATH=$path:$SITE timeout 200 python benchmarks/decode_host_probe.py --tokenizer .tok \
        --batches 16 64 256 --repeats 2 --structured "$kind" --breakdown \
        --json "$OUT/${kind}_${tree}_$round.json" 2>&1 | grep -v '^{' | tail -40 > "$OUT/${kind}_${tree}_$round.log"
      echo "== $kind $tree round $round"; sed -n '/^batch/,/^host/p' "$OUT/${kind}_${tree}_$round.log"
    done
  done
done
