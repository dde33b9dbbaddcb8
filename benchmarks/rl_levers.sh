#!/usr/bin/env bash
# Issue 28's RL levers, each alone (docs/studies/strategies.md): run_cpu.sh's rloo stage from an SFT model, with
# one flag changed per run, then a val evaluation (100 x 16) of each. Two runs at a time, one thread each,
# as measured there. Then: python benchmarks/summarize_runs.py OUT/* (and OUT/eval_NAME/summary.json).
#   benchmarks/rl_levers.sh OUT SFT_DIR     (SFT_DIR: run_cpu.sh's sft stage)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; SFT=$2
DATA="gen:nums=3,range=1-20,test=200,val=100"
# run_cpu.sh's COMMON, RL and PG arrays; a flag given again later overrides
RLOO=(--init "$SFT" --data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4
      --eval_max_new_tokens 160 --lr 5e-5 --temperature 0.7 --batch_size 32 --micro_batch 64 --max_response_len 160
      --max_steps 50 --eval_every 25 --save_every 25 --wrong_reward 0 --no_answer_reward 0 --pg_norm mean --overwrite)
run() {  # run NAME FLAGS...: skip a finished run
  local name=$1; shift
  [[ -f $OUT/eval_$name/summary.json ]] && { echo "== $name: done"; return; }
  echo "+ python rloo.py ${RLOO[*]} $* --output_dir $OUT/$name"
  python rloo.py "${RLOO[@]}" "$@" --output_dir "$OUT/$name" > "$OUT/$name.log" 2>&1
  python evaluate.py --model "$OUT/$name" --data "$DATA" --split val --template compact --num_problems 100 \
    --max_new_tokens 160 --out "$OUT/eval_$name" > "$OUT/$name.val.log" 2>&1
}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
run recipe & run temp1.0 --temperature 1.0 & wait
run filter --curriculum filter --probe_problems 512 & run group16 --batch_size 16 --group_size 16 & wait
run batch64 --batch_size 64 & run lr1e-5_150 --lr 1e-5 --max_steps 150 --eval_every 50 --save_every 50 & wait
