#!/usr/bin/env bash
# The GPU smoke test (benchmarks/gpu_smoke.py): the walkthrough's scripts for 3 steps each at its
# real lengths on a random Qwen2.5-0.5B-shaped model, no network; one JSON line per stage in
# $OUT/gpu_smoke.jsonl (else out/gpu_smoke/), a copy of each on the console.
#   bash benchmarks/gpu_smoke.sh                 # one GPU: ~4-5 min on an H100, 7.5 at most
#   bash benchmarks/gpu_smoke.sh --tiny          # a CPU, ~10 s (tests/test_gpu_smoke.py)
#   bash benchmarks/gpu_smoke.sh --stages sampler --budget_s 200 --deadline_s 300
#                                                # the HF sampler's loops alone: 5 min at most
# Extra flags go to the driver (--stages, --steps, --rows, --sampler_rows, --sampler_tokens,
# --budget_s, --deadline_s, --work);
# $PYTHON picks the interpreter (default: python on the PATH, as a GPU image brings its torch).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-$(command -v python || command -v python3)}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null || true
exec "$PY" benchmarks/gpu_smoke.py --out "${OUT:-out/gpu_smoke}" "$@"
