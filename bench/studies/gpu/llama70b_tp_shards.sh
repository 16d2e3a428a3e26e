#!/usr/bin/env bash
# The prepared GPU check: one Llama-3.1-70B decoder layer's kernels at the TP 2/4/8 shard
# shapes, timed with PyTorch alone on one H100 or H200 (no vLLM, no ampd dependencies).
# Each TP degree writes OUT/llama-3.1-70b_tp<N>.json, which
#   ampd profile kernels --model llama-3.1-70b --gpu H200 --measured OUT/llama-3.1-70b_tp<N>.json
# compares with the roofline at that degree (all-reduces and step overhead left out).
# Four layers are allocated, each with its own weights and KV cache (no layer reads what
# another left in L2), and scaled to the model's 80.
set -euo pipefail
out=${1:?usage: llama70b_tp_shards.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv > "$out/gpu.csv" || true
for tp in 2 4 8; do
  python3 planner/profiler/kernels.py --model-json perfmodel/profiles/llama-3.1-70b_h20_tp8.json --tp "$tp" \
    --layers 4 --prefill 512,1024,2048,4096,8192 --batches 1,8,32,64,128,256 --contexts 1024,4096,16384 \
    --out "$out/llama-3.1-70b_tp$tp.json"
done
