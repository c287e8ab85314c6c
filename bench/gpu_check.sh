#!/usr/bin/env bash
# One lease's GPU checks, in order of value: the `-m gpu` test tier, kernel bandwidth, decode against the roofline.
#
# Run from the repository root on a machine with one CUDA GPU whose python3 holds torch, triton and transformers:
#   bash bench/gpu_check.sh OUTDIR
# Needs .bench-shared/workload.py (a copy of ../shared/bench/workload.py) and, where llguidance is missing,
# its wheel in .whl/. Each phase has its own time cap so that one hang cannot eat the lease; logs land in OUTDIR.
set -u
out=${1:?usage: bash bench/gpu_check.sh OUTDIR}
. bench/gpu_common.sh
gpu_setup "$out"
model=${KVFLEET_GPU_MODEL:-/tmp/llama3-8b}
make_8b "$model" "$out"  # while the test tier runs

# Only the files that hold gpu tests: the image lacks pydantic and jsonschema, which other test files import.
mapfile -t tier < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
timeout "${TIER_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 90 -rA "${tier[@]}" \
    2>&1 | tee "$out/tier.log" | tail -40
wait $maker; echo "make rc=$?"; tail -3 "$out/make.log"

timeout "${KBENCH_S:-60}" python3 -m kvfleet_kernels.bench --dtype bfloat16 2>&1 | tee "$out/kernels.log"

for mode in graphs eager; do
    flag=""; [ "$mode" = eager ] && flag=--enforce-eager
    timeout "${DECODE_S:-90}" python3 -m kvfleet_agent.bench.decode --model "$model" --batch 1 8 32 128 \
        --context 1024 --dtype bfloat16 $flag --json "$out/decode-$mode.json" 2>&1 | tee "$out/decode-$mode.log"
done
