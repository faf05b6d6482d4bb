#!/usr/bin/env bash
# One round of GPU checks and timings through the device tool (the machine keeps nothing):
#   stages: tests | e2e (tests/gpu/test_e2e_gpu.py alone) | kernels | tp06 | tp06-nopeer | tp8b
#           | tp8b-peer | kernels-sweep | gemm | splitk | profile06 | profile8b | timeline06
#           | timeline8b | runprof06 | runprof8b (the whole run's kernels by step: run_profile.py)
#           | latency | overlap | pdl | norms | prefill-sweep | splits | fused | layerk
#           | mixed06 | mixed8b (CUDA graphs for mixed steps: TTFT and serving, on and off)
#           | capture (what each mixed-step graph costs at start-up)
#           | serve (`octavo serve` end to end on the dummy Qwen3-0.6B: benchmarks/serve_smoke.py)
#           | http06 | http8b (serving over HTTP against the engine in process: http_serve_probe.py)
#           | compile (torch.compile of a layer's work besides attention: compile_probe.py)
#           | cublaslt (every cuBLASLt algorithm on the decode projections: cublaslt_probe.py)
#           | l2prefetch (the decode GEMMs with their weights read into L2 first: l2_prefetch_probe.py)
#           | priority (half batches, attention on a low-priority stream: priority_probe.py)
#           | structured (plain against JSON-schema decoding: structured_probe.py; needs llguidance)
#           | detok (the detokenizer's Python loop against DecodeStream: detokenize_probe.py;
#             DETOK_ARGS="--tokenizer DIR")
#   (default: tests kernels tp06 tp8b latency, in that order)
# Logs and JSON land in $OUT; the last lines printed are a short summary.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# The CLI, with every thread's stack dumped each 90 s (to see where a slow run spends it).
OCTAVO=(python3 -c "import faulthandler, sys; faulthandler.dump_traceback_later(90, repeat=True)
sys.argv = ['octavo', *sys.argv[1:]]
from octavo.entrypoints.cli import main; sys.exit(main())")
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
stages=${*:-tests kernels tp06 tp8b latency}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
for stage in $stages; do
  start=$(date +%s)
  case $stage in
    tests) timeout 560 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    e2e) timeout 300 python3 -m pytest tests/gpu/test_e2e_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_e2e.log" | tail -15 ;;
    kernels) timeout 300 python3 benchmarks/gpu_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -20 ;;
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
    kernels-sweep) timeout 300 python3 benchmarks/gpu_kernels.py --sweep --json "$OUT/kernels_sweep.json" 2>&1 | tee "$OUT/kernels_sweep.log" | tail -60 ;;
    splitk) timeout 500 python3 benchmarks/gemm_splitk.py ${SPLITK_ARGS:-} --json "$OUT/gemm_splitk.json" 2>&1 | tee "$OUT/gemm_splitk.log" | tail -30 ;;
    prefill-sweep) timeout 300 python3 benchmarks/gpu_kernels.py --sweep --only prefill --json "$OUT/prefill_sweep.json" 2>&1 | tee "$OUT/prefill_sweep.log" | tail -70 ;;
    gemm) timeout 400 python3 benchmarks/gemm_small.py --json "$OUT/gemm_small.json" 2>&1 | tee "$OUT/gemm_small.log" | tail -60 ;;
    profile06) timeout 300 python3 benchmarks/step_profile.py --model qwen3-0.6b --prefill-tokens 16384 \
            --json "$OUT/step_profile_0.6b.json" 2>&1 | tee "$OUT/step_profile_0.6b.log" | tail -120 ;;
    timeline06) timeout 300 python3 benchmarks/step_timeline.py --model qwen3-0.6b --profile-prefill \
            --json "$OUT/timeline_0.6b${TAG:-}.json" 2>&1 | tee "$OUT/timeline_0.6b${TAG:-}.log" | tail -70 ;;
    timeline8b) timeout 300 python3 benchmarks/step_timeline.py --model qwen3-8b \
            --json "$OUT/timeline_8b${TAG:-}.json" 2>&1 | tee "$OUT/timeline_8b${TAG:-}.log" | tail -30 ;;
    runprof06|runprof8b) m=qwen3-0.6b; [ "$stage" = runprof8b ] && m=qwen3-8b
            timeout 400 python3 benchmarks/run_profile.py --model $m \
            --json "$OUT/run_profile_$m.json" 2>&1 | tee "$OUT/run_profile_$m.log" | tail -14 ;;
    profile8b) timeout 300 python3 benchmarks/step_profile.py --model qwen3-8b \
            --json "$OUT/step_profile_8b.json" 2>&1 | tee "$OUT/step_profile_8b.log" | tail -120 ;;
    overlap) timeout 400 python3 benchmarks/overlap_probe.py --json "$OUT/overlap_probe.json" 2>&1 | tee "$OUT/overlap_probe.log" | tail -20 ;;
    pdl|norms) timeout 300 python3 benchmarks/switch_probe.py --switch "$stage" --json "$OUT/${stage}_probe.json" 2>&1 | tee "$OUT/${stage}_probe.log" | tail -9 ;;
    fused) timeout 400 python3 benchmarks/fused_linear_probe.py ${FUSED_ARGS:-} --json "$OUT/fused_probe.json" 2>&1 | tee "$OUT/fused_probe.log" | tail -72
           timeout 120 python3 benchmarks/norm_prologue_probe.py --json "$OUT/norm_prologue.json" 2>&1 | tee "$OUT/norm_prologue.log" | tail -5 ;;
    layerk) timeout 120 python3 benchmarks/layer_kernel_probe.py --smoke 2>&1 | tee "$OUT/layer_kernel_smoke.log" | tail -3 &&
            timeout 540 python3 benchmarks/layer_kernel_probe.py ${LAYERK_ARGS:-} --json "$OUT/layer_kernel.json" 2>&1 | tee "$OUT/layer_kernel.log" | tail -14 ;;
    compile) timeout 560 python3 benchmarks/compile_probe.py ${COMPILE_ARGS:-} --json "$OUT/compile_probe.json" 2>&1 | tee "$OUT/compile_probe.log" | grep -v "^{" | tail -8 ;;
    cublaslt) timeout 540 python3 benchmarks/cublaslt_probe.py ${CUBLASLT_ARGS:-} --json "$OUT/cublaslt_probe.json" 2>&1 | tee "$OUT/cublaslt_probe.log" | tail -16 ;;
    l2prefetch) timeout 500 python3 benchmarks/l2_prefetch_probe.py --json "$OUT/l2_prefetch.json" 2>&1 | tee "$OUT/l2_prefetch.log" | grep -v '^{' ;;
    priority) timeout 500 python3 benchmarks/priority_probe.py --json "$OUT/priority_probe.json" 2>&1 | tee "$OUT/priority_probe.log" | grep -v '^{' ;;
    splits) timeout 300 python3 benchmarks/split_probe.py --json "$OUT/split_probe${TAG:-}.json" 2>&1 | tee "$OUT/split_probe${TAG:-}.log" | tail -12 ;;
    latency) timeout 300 python3 benchmarks/latency.py --model qwen3-8b \
            --json "$OUT/latency_qwen3_8b.json" 2>&1 | tee "$OUT/latency.log" | tail -4 ;;
    mixed06) timeout 400 python3 benchmarks/mixed_graph_probe.py --model qwen3-0.6b --rates 16 64 \
            --num-requests 256 --json "$OUT/mixed_qwen3_0.6b.json" 2>&1 | tee "$OUT/mixed_0.6b.log" | tail -14 ;;
    mixed8b) timeout 500 python3 benchmarks/mixed_graph_probe.py --model qwen3-8b --rates 4 16 \
            --num-requests 128 --json "$OUT/mixed_qwen3_8b.json" 2>&1 | tee "$OUT/mixed_8b.log" | tail -14 ;;
    capture) timeout 200 python3 benchmarks/capture_probe.py --model qwen3-8b \
            --json "$OUT/capture_8b.json" 2>&1 | tee "$OUT/capture_8b.log" | tail -3 ;;
    serve) timeout 300 python3 benchmarks/serve_smoke.py --requests 64 2>&1 | grep -v "INFO:" | tee "$OUT/serve_smoke.log" | tail -4 ;;
    http06) timeout 500 python3 benchmarks/http_serve_probe.py --model qwen3-0.6b ${HTTP_ARGS:-} \
            --json "$OUT/http_qwen3_0.6b.json" 2>&1 | grep -v "INFO:" | tee "$OUT/http_0.6b.log" | tail -12 ;;
    http8b) timeout 500 python3 benchmarks/http_serve_probe.py --model qwen3-8b --rates 4 16 \
            --num-requests 128 --settings default scan ${HTTP_ARGS:-} \
            --json "$OUT/http_qwen3_8b.json" 2>&1 | grep -v "INFO:" | tee "$OUT/http_8b.log" | tail -8 ;;
    structured) timeout 400 python3 benchmarks/structured_probe.py ${STRUCTURED_ARGS:-} \
            --json "$OUT/structured_probe.json" 2>&1 | grep -v "Writing model" | tee "$OUT/structured_probe.log" | tail -8 ;;
    detok) timeout 400 python3 benchmarks/detokenize_probe.py --engine ${DETOK_ARGS:-} \
            --json "$OUT/detokenize_probe.json" 2>&1 | grep -v "Writing model" | tee "$OUT/detokenize_probe.log" | tail -8 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "== $stage: $(( $(date +%s) - start )) s"
done
# The device tool brings back at most 8 files: pack them into one (PACK=0: not yet, another
# invocation follows; TAG=_x suffixes tp06-nopeer's files, for A/B runs in one call).
[ "${PACK:-1}" = 0 ] || (cd "$OUT" && tar czf /tmp/round.tgz ./* && rm -f ./* && mv /tmp/round.tgz .)
