#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go: the engine's tests with the GPU as the default
# device (every `--device auto` test then runs its cache on CUDA), and the GPU benchmark
# (bench.run --device cuda). Usage: bash bench/cuda_run.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS]
set -uo pipefail
out=${1:?output folder}
mkdir -p "$out"
python=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; "$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"; lscpu | grep 'Model name'; } \
  2>&1 | tee "$out/machine.txt"
timeout "${3:-330}" "$python" -m bench.run --device cuda --models qwen3moe-64e --budgets 25,50,100 --prompts 128 \
  --routings trace --decode 64 --accelerate-decode 16 --threads 8 --label cuda --out "$out" 2>&1 | tee "$out/bench.log"
timeout "${2:-240}" "$python" -m pytest -p no:cacheprovider -q -rfEs --junitxml "$out/tests.xml" \
  tests/test_exactness.py tests/test_quantized_experts.py tests/test_policies.py tests/test_live_budget.py \
  tests/test_memory.py tests/test_decode_families.py 2>&1 | tee "$out/tests.log" | tail -40
