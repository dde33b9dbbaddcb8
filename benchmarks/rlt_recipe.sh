#!/usr/bin/env bash
# RLT's full recipe in the embedded setting (paper 004 §A.1): the teacher is first SFT'd in its own
# format (the solution in the prompt, a solver trace up to </think> as the explanation), then trained
# with rlt.py exactly as run_cpu.sh's rlt stage, exports traces, and a student is SFT'd on them exactly
# as run_cpu.sh's rlt_student. Compare with run_cpu.sh's rlt / rlt_student (no teacher SFT).
#   benchmarks/rlt_recipe.sh OUT CPU_OUT     (CPU_OUT: a finished run_cpu.sh dir, for base and sft)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; CPU=$2
SPEC="nums=3,range=1-20,test=200,val=100"; DATA="gen:$SPEC"
COMMON=(--data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4 --eval_max_new_tokens 160)
stage() {  # stage NAME COMMAND...: skip a finished one
  local name=$1; shift
  [[ -f $OUT/$name/wall_seconds ]] && { echo "== $name: done"; return; }
  echo "+ $*"
  local start=$SECONDS
  "$@" --overwrite > "$OUT/$name.log" 2>&1
  echo $((SECONDS - start)) > "$OUT/$name/wall_seconds"
}
mkdir -p "$OUT"
# 004 §A.1: a short SFT in the teacher's format (here 100 steps of 64 from the SFT model, the sft stage's lr)
stage rlt_sft python sft.py --init "$CPU/sft" "${COMMON[@]}" --data "rlt:$SPEC" --dead_ends 1 --near_misses 0.5 \
  --micro_batch 16 --lr 1e-3 --warmup 0 --batch_size 64 --max_steps 100 --eval_every 100 --output_dir "$OUT/rlt_sft"
stage rlt python rlt.py --init "$OUT/rlt_sft" --student "$CPU/sft" "${COMMON[@]}" --lr 1e-4 --batch_size 16 \
  --group_size 8 --micro_batch 64 --max_response_len 160 --max_steps 30 --eval_every 10 \
  --export "$OUT/rlt/traces.jsonl" --output_dir "$OUT/rlt"
stage rlt_student python sft.py --init "$CPU/base" "${COMMON[@]}" --num_train 1800 --lr 2e-3 --batch_size 64 \
  --micro_batch 32 --max_steps 400 --eval_every 400 --data "$OUT/rlt/traces.jsonl" --output_dir "$OUT/rlt_student"
python evaluate.py --model "$OUT/rlt_student" --data "$DATA" --template compact --num_problems 200 \
  --max_new_tokens 160 --out "$OUT/eval/rlt_student"
