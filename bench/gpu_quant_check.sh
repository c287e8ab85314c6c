#!/usr/bin/env bash
# A lease's quantization checks: the quantized engines' -m gpu tests, then 8B decode per format on the roofline.
#
# Run from the repository root on a CUDA machine whose python3 holds torch, triton and transformers:
#   bash bench/gpu_quant_check.sh OUTDIR
# Needs what bench/gpu_check.sh needs (.bench-shared/workload.py; llguidance's wheel in .whl/ where missing).
set -u
out=${1:?usage: bash bench/gpu_quant_check.sh OUTDIR}
. bench/gpu_common.sh
gpu_setup "$out"
model=${KVFLEET_GPU_MODEL:-/tmp/llama3-8b}
make_8b "$model" "$out"  # while the tests run
timeout "${TIER_S:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 120 -rA \
    tests/agent/test_quant_gpu.py tests/kernels/test_kv_quant.py 2>&1 | tee "$out/tier.log" | tail -15
wait $maker; echo "make rc=$?"
# bf16 first: the baseline every quantized row is read against, on the same machine in the same run.
for q in none int8 int4 fp8; do
    flag=""; [ "$q" != none ] && flag="--quantization $q"
    timeout "${DECODE_S:-80}" python3 -m kvfleet_agent.bench.decode --model "$model" --batch 1 16 --context 1024 \
        --dtype bfloat16 --steps 32 --warmup 4 $flag --json "$out/decode-$q.json" 2>&1 | tail -4 | tee "$out/decode-$q.log"
done
# The int8 / fp8 KV cache against bf16's at a context where K/V reads weigh (batch 16 x 4096 tokens: 8.6 GB of bf16 K/V).
for kv in auto int8 fp8; do
    timeout "${DECODE_S:-80}" python3 -m kvfleet_agent.bench.decode --model "$model" --batch 1 16 --context 4096 \
        --dtype bfloat16 --steps 32 --warmup 4 --kv-cache-dtype $kv --json "$out/decode-kv-$kv.json" 2>&1 | tail -4 \
        | tee "$out/decode-kv-$kv.log"
done
