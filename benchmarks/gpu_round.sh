#!/usr/bin/env bash
# GPU checks and timings in one call, for a machine that keeps nothing between calls:
# each stage writes its log and JSON to $OUT, and the last lines printed are a short summary.
#   OUT=dir [PACK=0] bash benchmarks/gpu_round.sh [stage ...]
# Stages (default: tests kernels tp06 tp8b latency):
#   tests, ktests  the GPU suite (tests/gpu) in two calls: the modules that drive the engine,
#                  then the kernels' own tests
#   e2e            tests/gpu/test_e2e_gpu.py alone
#   tp06, tp8b     `octavo bench throughput`, the nano-vllm workload, Qwen3-0.6B with the HF
#                  peer / Qwen3-8B without it (tp06-nopeer, tp8b-peer: the other way round)
#   latency        one Qwen3-8B request (latency.py; latency06: Qwen3-0.6B)
#   moe            Qwen3-30B-A3B: one request against the routed experts' floor, then the
#                  nano-vllm workload; moefp8 the same with quantization="fp8"; moethru the
#                  workload alone, bf16 then fp8
#   moekernels     one MoE layer at 1-4,096 rows against its floor (moe_kernels.py), bf16 and fp8
#   moetests       the MoE GPU tests (fused kernels, then models against HF)
#   moeprefill     the layer at 16,384 rows (a prefill step's) with its tiles' neighbours
#   moegrid        the same layer at 256 rows over a grid of tiles, bf16 and fp8
#   serve          `octavo serve` end to end on the dummy Qwen3-0.6B: its start-up, then 64
#                  requests at once through `octavo bench serve` (a failed one is counted)
#   serve06, serve8b  `octavo bench serve` against `octavo serve` at two Poisson rates
#   timeline06, timeline8b, timelineg3  the workload step by step against each step's floor (step_timeline.py)
#   runprof06, runprof8b, runprofg3, runprofmoe, runprofmoefp8, runprofdet (8B deterministic)
#                  the workload's kernels by step, and its bounds (run_profile.py)
#   hostprof06, hostprofg3  the workload's host time by Python function (host_profile.py)
#   kernels, kernels-sweep, prefill-sweep  the attention kernels against the copy ceiling
#                  (gpu_kernels.py)
#   tptests        tensor parallelism's GPU tests (tests/gpu/test_tp_gpu.py)
#   tpthru, tplat, tpfloor  TPMODEL (qwen3-8b) at each of TPSIZES (1 2): the nano-vllm
#                  workload, then one request and a decode batch of 256 (latency.py), then
#                  the TPSIZE-GPU floor and the all-reduce's share of a step (tp_bench.py)
#   quantlat       one Qwen3-8B request at each of QUANTS (none fp8 int4 int8) (latency.py)
#   quantthru      the nano-vllm workload on Qwen3-8B: bf16, fp8 weights, fp8 KV cache, both
#   det            deterministic mode: its tests, fixed_gemm against cuBLAS (fixed_gemm.py),
#                  then one Qwen3-8B request and the nano-vllm workload, default,
#                  and deterministic in turn (det_e2e: those alone)
#   families       the model-family GPU tests, then Gemma 3 1B, Mistral 7B and Qwen3-0.6B (or
#                  FAMILIES) on the nano-vllm workload, and Gemma 3's long-context KV memory
#                  (sliding_kv.py)
#   detspan        the nano-vllm workload on Qwen3-8B, default, then deterministic with each of
#                  SPANS (256 512 1024) as the attention's shortest span (runner/deterministic.py),
#                  and the one-GPU determinism tests at each span past 256
#   detcfg         the nano-vllm workload on Qwen3-8B, default (0), then deterministic with each of
#                  VARIANTS span:block_m:block_n:warps:stages, the prefill kernel's tile for
#                  every step (decode included) and the attention's shortest span; dettest:
#                  the one-GPU determinism tests with VARIANT
#   ltinv          cuBLASLt algorithms against fixed_gemm's bits and times (lt_invariance.py);
#                  ltsmall: at decode-sized row counts, with cuBLASLt's picks for each
#   host           short-context decode steps, plain and streamed; STRUCTURED=integer|string
#                  adds a JSON schema to every request (step_timeline.py --host; HOST_ARGS are passed on)
set -u
# NVLink multicast stays off (NCCL's NVLS and torch's symmetric memory).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# The CLI, with every thread's stack dumped each 90 s (to see where a slow run spends it).
OCTAVO=(python3 -c "import faulthandler, sys; faulthandler.dump_traceback_later(90, repeat=True)
sys.argv = ['octavo', *sys.argv[1:]]
from octavo.entrypoints.cli import main; sys.exit(main())")
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
stages=${*:-tests kernels tp06 tp8b latency}

# `octavo bench serve` against `octavo serve` (dummy weights, 2,048 tokens a step): Poisson
# arrivals at each rate, prompts of 64-512 random token ids, 128 tokens each, streamed.
serve_bench() {  # model, requests, rate...
  local model=$1 requests=$2 port=8051; shift 2
  "${OCTAVO[@]}" serve --model "$model" --load-format dummy --max-model-len 4096 \
    --max-num-batched-tokens 2048 --port $port --log-level warning > "$OUT/serve_$model.log" 2>&1 &
  local pid=$! up=$(date +%s)
  for _ in $(seq 300); do  # until it answers, or its process is gone
    curl -sf http://127.0.0.1:$port/health > /dev/null && { echo "/health after $(( $(date +%s) - up )) s"; break; }
    kill -0 $pid 2>/dev/null || { echo "octavo serve exited: see $OUT/serve_$model.log"; return 1; }
    sleep 1
  done
  for rate in "$@"; do
    "${OCTAVO[@]}" bench serve --base-url http://127.0.0.1:$port --token-ids 10000 \
      --input-len 288 --random-range-ratio 0.7778 --max-tokens 128 --seed 2 \
      --request-rate "$rate" --num-prompts "$requests" --json "$OUT/serve_${model}_$rate.json"
  done
  kill $pid; wait $pid 2>/dev/null
}

# The GPU suite no longer fits one call's limit: `tests` runs the modules that drive the engine,
# `ktests` the kernels' own tests (each against its torch reference, and the sm90 compiles).
E2E_TESTS=$(ls tests/gpu/test_{cublaslt,deterministic,e2e,families,fp8_blocks,int4_checkpoints,moe,pdl,structured,tp}_gpu.py)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests) timeout 560 python3 -m pytest $E2E_TESTS -q -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    ktests) timeout 560 python3 -m pytest tests/gpu $(printf -- '--ignore=%s ' $E2E_TESTS) -q -p no:cacheprovider --durations=10 \
            2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -15 ;;
    e2e) timeout 300 python3 -m pytest tests/gpu/test_e2e_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_e2e.log" | tail -15 ;;
    kernels) timeout 300 python3 benchmarks/gpu_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -20 ;;
    kernels-sweep) timeout 300 python3 benchmarks/gpu_kernels.py --sweep --json "$OUT/kernels_sweep.json" 2>&1 | tee "$OUT/kernels_sweep.log" | tail -60 ;;
    prefill-sweep) timeout 300 python3 benchmarks/gpu_kernels.py --sweep --only prefill --json "$OUT/prefill_sweep.json" 2>&1 | tee "$OUT/prefill_sweep.log" | tail -70 ;;
    tp06) timeout 560 "${OCTAVO[@]}" bench throughput --model qwen3-0.6b --max-model-len 4096 \
            --load-format dummy --workload nanovllm --peer hf --peer-timeout 150 --progress \
            --json "$OUT/throughput_qwen3_0.6b.json" 2>&1 | tee "$OUT/tp06.log" | tail -40 ;;
    tp06-nopeer) timeout 300 "${OCTAVO[@]}" bench throughput --model qwen3-0.6b --max-model-len 4096 \
            --load-format dummy --workload nanovllm --progress \
            --json "$OUT/throughput_qwen3_0.6b${TAG:-}.json" 2>&1 | tee "$OUT/tp06${TAG:-}.log" | tail -4 ;;
    tp8b) timeout 560 "${OCTAVO[@]}" bench throughput --model qwen3-8b --max-model-len 4096 \
            --load-format dummy --workload nanovllm --progress \
            --json "$OUT/throughput_qwen3_8b.json" 2>&1 | tee "$OUT/tp8b.log" | tail -40 ;;
    tp8b-peer) timeout 560 "${OCTAVO[@]}" bench throughput --model qwen3-8b --max-model-len 4096 \
            --load-format dummy --workload nanovllm --peer hf --peer-timeout 120 --progress \
            --json "$OUT/throughput_qwen3_8b.json" 2>&1 | tee "$OUT/tp8b.log" | tail -40 ;;
    latency) timeout 300 python3 benchmarks/latency.py --model qwen3-8b \
            --json "$OUT/latency_qwen3_8b.json" 2>&1 | tee "$OUT/latency.log" | tail -4 ;;
    latency06) timeout 300 python3 benchmarks/latency.py --model qwen3-0.6b \
            --json "$OUT/latency_qwen3_0.6b.json" 2>&1 | tee "$OUT/latency06.log" | tail -4 ;;
    moe) timeout 300 python3 benchmarks/latency.py --model qwen3-30b-a3b \
            --json "$OUT/latency_qwen3_30b_a3b.json" 2>&1 | tee "$OUT/moe_latency.log" | tail -4
         timeout 400 "${OCTAVO[@]}" bench throughput --model qwen3-30b-a3b --max-model-len 4096 \
            --load-format dummy --workload nanovllm --progress \
            --json "$OUT/throughput_qwen3_30b_a3b.json" 2>&1 | tee "$OUT/moe_thru.log" | tail -4 ;;
    moethru) for q in none fp8; do  # the nano-vllm workload, bf16 then fp8 experts
           timeout 250 "${OCTAVO[@]}" bench throughput --model qwen3-30b-a3b --max-model-len 4096 \
             --load-format dummy --workload nanovllm --quantization $q \
             --json "$OUT/throughput_qwen3_30b_a3b_$q.json" 2>&1 | tee "$OUT/moe_thru_$q.log" | tail -3
         done ;;
    moefp8) timeout 300 python3 benchmarks/latency.py --model qwen3-30b-a3b --quantization fp8 \
            --json "$OUT/latency_qwen3_30b_a3b_fp8.json" 2>&1 | tee "$OUT/moe_latency_fp8.log" | tail -4
         timeout 400 "${OCTAVO[@]}" bench throughput --model qwen3-30b-a3b --max-model-len 4096 \
            --load-format dummy --workload nanovllm --quantization fp8 --progress \
            --json "$OUT/throughput_qwen3_30b_a3b_fp8.json" 2>&1 | tee "$OUT/moe_thru_fp8.log" | tail -4 ;;
    moekernels) timeout 150 python3 benchmarks/moe_kernels.py --json "$OUT/moe_kernels.json" 2>&1 | tail -8
         timeout 150 python3 benchmarks/moe_kernels.py --fp8 --json "$OUT/moe_kernels_fp8.json" 2>&1 | tail -8 ;;
    moetests) timeout 400 python3 -m pytest tests/gpu/test_fused_moe.py tests/gpu/test_moe_gpu.py -q \
            -p no:cacheprovider 2>&1 | tee "$OUT/moe_tests.log" | tail -4 ;;
    moeprefill) timeout 150 python3 benchmarks/moe_kernels.py --rows 16384 --sweep --kernels \
            --json "$OUT/moe_prefill_sweep.json" 2>&1 | grep -v "^  TileConfig" | tail -12 ;;
    moegrid) for q in "" --fp8; do  # one MoE layer at 256 rows, bf16 then fp8, over a grid of tiles
           timeout 250 python3 benchmarks/moe_kernels.py --rows 256 --grid --kernels $q \
             --json "$OUT/moe_grid${q/--/_}.json" 2>&1 | grep -v "^  TileConfig" | tail -16
         done ;;
    serve) serve_bench qwen3-0.6b 64 inf 2>&1 | tee "$OUT/serve.log" | grep -E "^(/health|Successful|Failed)" ;;
    serve06) serve_bench qwen3-0.6b 256 16 64 2>&1 | tee "$OUT/serve06.log" | grep -E "^(Request rate|Output token|Mean|P99)" ;;
    serve8b) serve_bench qwen3-8b 128 4 16 2>&1 | tee "$OUT/serve8b.log" | grep -E "^(Request rate|Output token|Mean|P99)" ;;
    timeline06) timeout 300 python3 benchmarks/step_timeline.py --model qwen3-0.6b \
            --json "$OUT/timeline_0.6b${TAG:-}.json" 2>&1 | tee "$OUT/timeline_0.6b${TAG:-}.log" | tail -30 ;;
    timelineg3) timeout 300 python3 benchmarks/step_timeline.py --model gemma-3-1b \
            --json "$OUT/timeline_g3${TAG:-}.json" 2>&1 | tee "$OUT/timeline_g3${TAG:-}.log" | tail -30 ;;
    hostprof06|hostprofg3) m=qwen3-0.6b; [ "$stage" = hostprofg3 ] && m=gemma-3-1b
            timeout 300 python3 benchmarks/host_profile.py --model $m --out "$OUT/host_$m.prof" \
            2>&1 | tee "$OUT/host_profile_$m.txt" | head -30 ;;
    timeline8b) timeout 300 python3 benchmarks/step_timeline.py --model qwen3-8b \
            --json "$OUT/timeline_8b${TAG:-}.json" 2>&1 | tee "$OUT/timeline_8b${TAG:-}.log" | tail -30 ;;
    runprof06|runprof8b|runprofg3|runprofdet|runprofmoe|runprofmoefp8) m=qwen3-0.6b
            [ "$stage" = runprofg3 ] && m=gemma-3-1b
            [ "${stage#runprofmoe}" != "$stage" ] && m=qwen3-30b-a3b
            flag=; [ "$stage" = runprofdet ] && flag=--deterministic
            [ "$stage" = runprofmoefp8 ] && flag="--quantization fp8"
            [ "$stage" = runprof8b ] || [ "$stage" = runprofdet ] && m=qwen3-8b
            timeout 400 python3 benchmarks/run_profile.py --model $m $flag \
            --json "$OUT/run_profile_$m${flag// /_}.json" 2>&1 | tee "$OUT/run_profile_$m${flag// /_}.log" | tail -29 ;;
    host) kind=${STRUCTURED:-plain}
            timeout 400 python3 benchmarks/step_timeline.py --host ${STRUCTURED:+--structured $STRUCTURED} \
            ${HOST_ARGS:-} --json "$OUT/decode_host_$kind.json" 2>&1 | grep -v '^{' \
            | tee "$OUT/decode_host_$kind.log" | tail -12 ;;
    tptests) timeout 560 python3 -m pytest tests/gpu/test_tp_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/tp_tests.log" | tail -15 ;;
    tpthru) m=${TPMODEL:-qwen3-8b}  # the nano-vllm workload at each TPSIZES size
            for n in ${TPSIZES:-1 2}; do
              timeout 400 "${OCTAVO[@]}" bench throughput --model $m --max-model-len 4096 \
                --load-format dummy --workload nanovllm --tensor-parallel-size $n \
                --json "$OUT/throughput_${m}_tp$n.json" 2>&1 | tee "$OUT/tpthru_${m}_$n.log" | tail -3
            done ;;
    tplat) m=${TPMODEL:-qwen3-8b}  # one request, and a decode batch of 256, at each size
            for n in ${TPSIZES:-1 2}; do for b in 1 256; do
              timeout 300 python3 benchmarks/latency.py --model $m --tensor-parallel-size $n \
                --batch $b --json "$OUT/latency_${m}_tp${n}_b$b.json" 2>&1 | tail -1
            done; done ;;
    tpfloor) m=${TPMODEL:-qwen3-8b}; n=${TPSIZE:-2}  # the N-GPU floor, all-reduce costs
            timeout 300 python3 benchmarks/tp_bench.py --model $m --tp $n \
              --bench $(ls "$OUT"/throughput_${m}_tp$n.json 2>/dev/null) \
              --latency $(ls "$OUT"/latency_${m}_tp${n}_b*.json 2>/dev/null) \
              --json "$OUT/tp_floor_${m}_tp$n.json" 2>&1 | tee "$OUT/tpfloor_$m.log" | tail -6 ;;
    quantlat) for q in ${QUANTS:-none fp8 int4 int8}; do
              timeout 300 python3 benchmarks/latency.py --model qwen3-8b --quantization $q \
                --json "$OUT/latency_qwen3_8b_$q.json" 2>&1 | tee "$OUT/quantlat_$q.log" | tail -1
            done ;;
    quantthru) for qk in none:auto fp8:auto none:fp8 fp8:fp8; do
              q=${qk%:*} kv=${qk#*:}
              timeout 400 "${OCTAVO[@]}" bench throughput --model qwen3-8b --max-model-len 4096 \
                --load-format dummy --workload nanovllm --quantization $q --kv-cache-dtype $kv \
                --json "$OUT/throughput_qwen3_8b_${q}_kv$kv.json" 2>&1 \
                | tee "$OUT/quantthru_${q}_$kv.log" | tail -2
            done ;;
    det|det_e2e) if [ $stage = det ]; then
           timeout 300 python3 -m pytest tests/gpu/test_fixed_order.py tests/gpu/test_deterministic_gpu.py \
             -q -p no:cacheprovider 2>&1 | tee "$OUT/det_tests.log" | tail -4
           timeout 120 python3 benchmarks/fixed_gemm.py \
             --json "$OUT/fixed_gemm.json" 2>&1 | tail -12
         fi
         for mode in default deterministic; do flag=; [ $mode = default ] || flag=--deterministic
           timeout 300 python3 benchmarks/latency.py --model qwen3-8b $flag \
             --json "$OUT/latency_qwen3_8b_$mode.json" 2>&1 | tail -1
           timeout 400 "${OCTAVO[@]}" bench throughput --model qwen3-8b --max-model-len 4096 \
             --load-format dummy --workload nanovllm $flag \
             --json "$OUT/throughput_qwen3_8b_$mode.json" 2>&1 | tail -2
         done ;;
    families) timeout 200 python3 -m pytest tests/gpu/test_families_gpu.py -q -p no:cacheprovider 2>&1 \
              | tee "$OUT/families_tests.log" | tail -4
            for m in ${FAMILIES:-gemma-3-1b mistral-7b qwen3-0.6b}; do
              timeout 200 "${OCTAVO[@]}" bench throughput --model $m --max-model-len 4096 \
                --load-format dummy --workload nanovllm --json "$OUT/throughput_$m.json" 2>&1 \
                | tee "$OUT/thru_$m.log" | tail -3
            done
            timeout 200 python3 benchmarks/sliding_kv.py --json "$OUT/sliding_kv.json" 2>&1 | tail -1 ;;
    detspan) for span in 0 ${SPANS:-256 512 1024}; do  # 0: the default mode
           timeout 120 python3 -c "import sys; import octavo.runner.deterministic as d
if $span: d.MIN_SPLIT = $span
sys.argv = ['octavo', 'bench', 'throughput', '--model', 'qwen3-8b', '--max-model-len', '4096',
    '--load-format', 'dummy', '--workload', 'nanovllm', '--json', '$OUT/thru_span$span.json']
sys.argv += ['--deterministic'] if $span else []
from octavo.entrypoints.cli import main; sys.exit(main())" > "$OUT/thru_span$span.log" 2>&1
           echo "span $span: $(grep -E '^octavo' "$OUT/thru_span$span.log")"
           [ "$span" -gt 256 ] && timeout 120 python3 -c "import sys, pytest
import octavo.runner.deterministic as d; d.MIN_SPLIT = $span
sys.exit(pytest.main(['tests/gpu/test_deterministic_gpu.py', '-q', '-p', 'no:cacheprovider',
    '-k', 'not two_ranks']))" 2>&1 | tail -1
         done ;;
    detcfg) for v in ${VARIANTS:-0 256:64:64:4:3 256:16:64:4:3 256:16:64:4:4 256:32:64:4:4 512:16:64:4:3}; do
           IFS=: read -r span bm bn warps stages _ <<< "$v:64:64:4:3:"  # 0: the default mode
           timeout 150 python3 -c "import sys; import octavo.runner.deterministic as d
import octavo.kernels.prefill_attention as pa
if $span:
    d.MIN_SPLIT = $span
    pa.default_prefill_config = lambda head_dim, group_pad, split=0: {'block_m': max($bm, group_pad),
        'block_n': $bn, 'num_warps': $warps, 'num_stages': $stages}
sys.argv = ['octavo', 'bench', 'throughput', '--model', 'qwen3-8b', '--max-model-len', '4096',
    '--load-format', 'dummy', '--workload', 'nanovllm', '--json', '$OUT/thru_det_${v//:/_}.json']
sys.argv += ['--deterministic'] if $span else []
from octavo.entrypoints.cli import main; sys.exit(main())" > "$OUT/thru_det_${v//:/_}.log" 2>&1
           echo "variant $v: $(grep -E '^octavo' "$OUT/thru_det_${v//:/_}.log" | tail -1)"
         done ;;
    dettest) IFS=: read -r span bm bn warps stages <<< "${VARIANT:-256:64:64:4:3}"
         timeout 200 python3 -c "import sys, pytest
import octavo.runner.deterministic as d, octavo.kernels.prefill_attention as pa
d.MIN_SPLIT = $span
pa.default_prefill_config = lambda head_dim, group_pad, split=0: {'block_m': max($bm, group_pad),
    'block_n': $bn, 'num_warps': $warps, 'num_stages': $stages}
sys.exit(pytest.main(['tests/gpu/test_deterministic_gpu.py', '-q', '-p', 'no:cacheprovider',
    '-k', 'not two_ranks']))" 2>&1 | tail -3 ;;
    ltinv) timeout 300 python3 benchmarks/lt_invariance.py --json "$OUT/lt_invariance.json" 2>&1 \
              | tee "$OUT/lt_invariance.log" | tail -34 ;;
    ltsmall) timeout 300 python3 benchmarks/lt_invariance.py --small --json "$OUT/lt_small.json" \
              2>&1 | tee "$OUT/lt_small.log" | tail -33 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "== $stage: $(( $(date +%s) - start )) s"
done
# Everything in $OUT goes into one archive, round.tgz, for transports that bring back few
# files (PACK=0: leave the files as they are, e.g. when another call adds to $OUT).
[ "${PACK:-1}" = 0 ] || (cd "$OUT" && tar czf /tmp/round.tgz ./* && rm -f ./* && mv /tmp/round.tgz .)
