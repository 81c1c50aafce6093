#!/usr/bin/env bash
# The full benchmark set on this machine, as committed under bench/results/ (about 40 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
$PY -m bench.profile_decode --geometry qwen3moe-64e --ops 25 --label after
$PY -m bench.profile_decode --geometry qwen3moe-64e --ops 25 --label after --fast-decode
$PY -m bench.decode_limit --reps 3 --threads 2 --decode 64
$PY -m bench.telemetry_overhead --model qwen3moe-64e --budget 50% --reps 5 --decode 64
$PY -m bench.run --models qwen3moe-64e,mixtral-8e-12l,demo --budgets 10,25,50,100 --prompts 128,512 \
    --decode 64 --accelerate-decode 8 --accelerate-prompts 128
$PY -m bench.run --models qwen3moe-64e --budgets 25,50,100 --prompts 128 --decode 64 --routings olmoe \
    --policies lru,markov,crosslayer --skip-accelerate --label olmoe-routing
$PY -m bench.policy_cost --repeats 7
$PY -m bench.lossy_cost --budgets 25,50 --n 20
$PY -m bench.lossy_cost --formats q8_0,q6_k,q5_0,q4_k,q4_0,q3_k,q2_k --dense-formats original,q8_0,q4_k --n 100
$PY bench/heatmap_bench.py
# Slow: its first run builds llama.cpp and writes ~9 GB of GGUF files (docs/performance.md).
$PY -m bench.llamacpp --reps 5
