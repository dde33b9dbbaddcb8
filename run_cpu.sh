#!/usr/bin/env bash
# The embedded pipeline on a CPU, stage by stage. Every command is printed before it runs, so you can
# copy it (and swap the flags for the papers' defaults) to run the same stage on a GPU.
#   ./run_cpu.sh [OUT_DIR]          default out/cpu; a stage whose checkpoint exists is skipped
#   FORCE=1 ./run_cpu.sh            run every stage again
set -euo pipefail
cd "$(dirname "$0")"
OUT=${1:-out/cpu}
mkdir -p "$OUT"

# One problem distribution for every stage: 3 numbers in 1-20, targets 10-100. Its 200 test problems
# are never trained on and periodic evals use the 100 val problems; training draws from the rest
# (~12k). 1-9 has only 1,345 problems in all: a tiny model memorizes them (README, "difficulty").
DATA="gen:nums=3,range=1-20,test=200,val=100"
COMMON=(--data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_max_new_tokens 160)

stage() {  # stage NAME COMMAND...: run unless $OUT/NAME holds a finished checkpoint; record wall time
  local name=$1; shift
  if [[ -f "$OUT/$name/config.json" && -z "${FORCE:-}" ]]; then
    echo "== $name: $OUT/$name exists, skipping (FORCE=1 to rerun)"; return
  fi
  echo "+ $*"
  local start=$SECONDS
  "$@"
  echo $((SECONDS - start)) > "$OUT/$name/wall_seconds"
}

evaluate() {  # evaluate NAME: pass@k on the held-out test split, written to $OUT/eval/NAME
  local name=$1
  echo "+ python evaluate.py --model $OUT/$name --data $DATA --template compact --num_problems 200 --max_new_tokens 160 --out $OUT/eval/$name"
  python evaluate.py --model "$OUT/$name" --data "$DATA" --template compact --num_problems 200 \
    --max_new_tokens 160 --out "$OUT/eval/$name"
}

# 1. SFT from scratch on solver-written traces (000 §3.2 Eq. 1)
stage sft python sft.py --model tiny "${COMMON[@]}" --dead_ends 1 --lr 2e-3 --batch_size 64 --micro_batch 64 \
  --max_steps 1200 --eval_every 400 --output_dir "$OUT/sft"
evaluate sft

# 2. IPO on the SFT model's own verifier-labelled samples (000 Eq. 2)
stage ipo python ipo.py --init "$OUT/sft" "${COMMON[@]}" --lr 1e-4 --num_prompts 1024 --max_new_tokens 160 \
  --batch_size 64 --micro_batch 32 --epochs 2 --output_dir "$OUT/ipo"
evaluate ipo

# 3. RLOO from the SFT checkpoint (000 Eq. 3): 64 prompts x 8 rollouts per step, the paper's knobs
stage rloo python rloo.py --init "$OUT/sft" "${COMMON[@]}" --lr 1e-4 --batch_size 64 --micro_batch 128 \
  --max_response_len 160 --max_steps 20 --eval_every 10 --output_dir "$OUT/rloo"
evaluate rloo

# 4. GRPO from the SFT checkpoint (004 Eq. 1-2, 002 Eq. 1): same batch geometry, KL to the frozen SFT model
stage grpo python grpo.py --init "$OUT/sft" "${COMMON[@]}" --lr 1e-4 --batch_size 64 --group_size 8 --micro_batch 128 \
  --max_response_len 160 --max_steps 20 --eval_every 10 --output_dir "$OUT/grpo"
evaluate grpo

python evaluate.py --plot "$OUT/eval/sft,$OUT/eval/ipo,$OUT/eval/rloo,$OUT/eval/grpo" --out "$OUT/pass_at_k.png"
