#!/usr/bin/env bash
# The GPU smoke test (benchmarks/gpu_smoke.py): the walkthrough's scripts for 3 steps each at its
# real lengths on a random Qwen2.5-0.5B-shaped model, no network; one JSON line per stage in
# $OUT/gpu_smoke.jsonl (else out/gpu_smoke/), a copy of each on the console.
#   bash benchmarks/gpu_smoke.sh                 # one GPU: ~4-5 min on an H100, 7.5 at most
#   bash benchmarks/gpu_smoke.sh --tiny          # a CPU, ~10 s (tests/test_gpu_smoke.py)
#   bash benchmarks/gpu_smoke.sh --stages sampler --budget_s 200 --deadline_s 300
#                                                # the HF sampler's loops alone: 5 min at most
#   bash benchmarks/gpu_smoke.sh --torchrun      # README's More GPUs: torchrun over this machine's
#     cards (NPROC, default all; on a CPU 2 gloo ranks) on the shipped tiny teacher: rloo.py 2 steps
#     with DDP, then sft.py 2 steps with FSDP2 (--fsdp), then a resume; ~1 min. Their metrics.jsonl
#     and checkpoints in $OUT/torchrun (else out/gpu_smoke/torchrun), the last step's metrics here.
# Extra flags go to the driver (--stages, --steps, --rows, --sampler_rows, --sampler_tokens,
# --budget_s, --deadline_s, --work);
# $PYTHON picks the interpreter (default: python on the PATH, as a GPU image brings its torch).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-$(command -v python || command -v python3)}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null || true
if [ "${1:-}" = "--torchrun" ]; then
  N=${NPROC:-$("$PY" -c "import torch; print(torch.cuda.device_count() or 2)")}
  W=${OUT:-out/gpu_smoke}/torchrun && rm -rf "$W" && mkdir -p "$W"
  D=gen:nums=3,range=1-20,test=200,val=100
  F="--data $D --eval_data $D --template compact --eval_problems 8 --eval_samples 4 --eval_max_new_tokens 160"
  run() { echo "+ torchrun --nproc_per_node $N $*"; "$PY" -m torch.distributed.run --standalone --nproc_per_node "$N" "$@"; }
  run rloo.py --init pretrained/tiny-teacher $F --batch_size $((4 * N)) --max_response_len 160 --max_steps 2 --save_every 1 --output_dir "$W/rloo"
  run rloo.py --init pretrained/tiny-teacher $F --batch_size $((4 * N)) --max_response_len 160 --max_steps 3 --save_every 1 --resume "$W/rloo"
  run sft.py --init pretrained/tiny-base $F --batch_size $((8 * N)) --micro_batch 8 --max_steps 2 --fsdp --output_dir "$W/sft_fsdp"
  for r in rloo sft_fsdp; do echo "$r: $(tail -n 1 "$W/$r/metrics.jsonl")"; done
  exit 0
fi
exec "$PY" benchmarks/gpu_smoke.py --out "${OUT:-out/gpu_smoke}" "$@"
