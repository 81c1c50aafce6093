#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the engine's tests with the GPU as the default
# device (every `--device auto` test then runs its cache on CUDA), then bf16 against 4-bit experts on
# the GPU (quantized slots dequantized there) at budgets all and 25 % on a small model, where a bf16
# and a Q4_K decode token's host time goes (bench.profile_decode --device cuda), then the GPU
# benchmark (bench.run --device cuda, BENCH_BUDGETS, default 25,100), all inside one 10-minute device call.
# Usage: bash bench/cuda_run.sh OUT_DIR [TEST_SECONDS] [SECONDS_PER_FORMAT_RUN] [BENCH_SECONDS] [PROFILE_SECONDS]
# Tests run on pytest-xdist workers where it is installed (WORKERS, default 8). At most 8 files land in
# OUT_DIR (what one device call brings back).
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
python=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; "$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"; lscpu | grep 'Model name'; } \
  2>&1 | tee "$out/machine.txt"
workers=()  # xdist workers get 2 torch threads each, or they oversubscribe the cores
"$python" -c "import xdist" 2>/dev/null && workers=(-n "${WORKERS:-8}") && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
timeout "${2:-230}" "$python" -m pytest -p no:cacheprovider -q -rfEs "${workers[@]}" \
  tests/test_exactness.py tests/test_quantized_experts.py tests/test_quantized_checkpoints.py tests/test_gguf.py \
  tests/test_policies.py tests/test_live_budget.py tests/test_memory.py tests/test_decode_families.py \
  tests/test_formats.py tests/test_kv_cache.py 2>&1 | tee "$out/tests.log" | tail -60
model=$("$python" -c "from bench.synthetic import build_checkpoint; print(build_checkpoint('qwen3moe-mini'))")
for budget in all 25%; do  # one JSON line each, bf16 then Q4_K
  for format in bf16 q4_k; do
    echo "== qwen3moe-mini $format $budget" | tee -a "$out/formats.log"
    limit=${3:-60}  # the first Q4_K load also converts the store (untimed, but inside the limit): twice as long
    [ "$format/$budget" = q4_k/all ] && limit=$((2 * limit))
    line=$(timeout "$limit" "$python" -m bench.measure ours --model "$model" --format $format --device cuda --store ram \
      --budget "$budget" --routing trace --prompt-len 128 --decode 64 --threads 8 2>/tmp/formats.err | tail -1)
    if [ -n "$line" ]; then echo "$line"; else echo "failed: $(tail -2 /tmp/formats.err)"; fi | tee -a "$out/formats.log"
  done
done
for format in bf16 q4_k; do  # the store converted above is reused
  timeout "${5:-60}" "$python" -m bench.profile_decode --device cuda --geometry qwen3moe-mini --format $format \
    --decode 16 --ops 20 --out /tmp/profile 2>&1 | grep -v '^USDT' | tee -a "$out/profile.log"
done
timeout "${4:-240}" "$python" -m bench.run --device cuda --models qwen3moe-64e --budgets "${BENCH_BUDGETS:-25,100}" --prompts 128 \
  --routings trace --decode 32 --accelerate-decode 8 --threads 8 --label cuda --out "$out" 2>&1 | tee "$out/bench.log"
