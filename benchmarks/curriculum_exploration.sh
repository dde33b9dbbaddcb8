#!/usr/bin/env bash
# Issue 18's measurements in the embedded setting: the curriculum (paper 001 Alg. 1 tiers, paper 002's
# filter) in rloo.py, and paper 002's exploration knobs in grpo.py (temperature 0.6 / 1.0 / 1.5,
# bottom-p, per-problem temperature) and LoRA rank 8, each against run_cpu.sh's own rloo / grpo stage (the default).
# Every run is that stage's command with the knob added; val pass@k is each run's last evaluation (100
# val problems x 4). Then a table: python benchmarks/summarize_runs.py OUT/*
#   benchmarks/curriculum_exploration.sh OUT SFT_DIR     (SFT_DIR: run_cpu.sh's sft stage)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; SFT=$2
DATA="gen:nums=3,range=1-20,test=200,val=100"
COMMON=(--init "$SFT" --data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4
        --eval_max_new_tokens 160 --lr 2e-4 --temperature 0.7 --batch_size 32 --micro_batch 64 --max_response_len 160
        --max_steps 20 --eval_every 20 --save_every 20 --wrong_reward -0.5 --overwrite)
GRPO=(--group_size 8 --beta 0.04)
PROBE=(--probe_problems 640 --probe_samples 4)  # 640 = the 20 x 32 problems a run draws
run() {  # run NAME SCRIPT FLAGS...: skip a finished run
  local name=$1 script=$2; shift 2
  [[ -f $OUT/$name/wall_seconds ]] && { echo "== $name: done"; return; }
  echo "+ python $script ${COMMON[*]} $* --output_dir $OUT/$name"
  local start=$SECONDS
  python "$script" "${COMMON[@]}" "$@" --output_dir "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo $((SECONDS - start)) > "$OUT/$name/wall_seconds"
}
mkdir -p "$OUT"
run grpo_T1.0 grpo.py "${GRPO[@]}" --temperature 1.0
run grpo_T1.0_bottom0.9 grpo.py "${GRPO[@]}" --temperature 1.0 --bottom_p 0.9
run grpo_T0.6 grpo.py "${GRPO[@]}" --temperature 0.6
run grpo_T1.5 grpo.py "${GRPO[@]}" --temperature 1.5
run grpo_adaptive grpo.py "${GRPO[@]}" --adaptive_temperature 0.6,1.5 "${PROBE[@]}"
run rloo_filter rloo.py --curriculum filter "${PROBE[@]}"
run rloo_tiers rloo.py --curriculum tiers --curriculum_window 4 --curriculum_threshold 0.45
run grpo_lora8 grpo.py "${GRPO[@]}" --lora_rank 8  # 002 §5's rank, at the full fine-tuning lr
# after the first results: bottom-p 0.9 cuts nothing from this model (benchmarks/bottom_p_cut_rate.py), 0.5 cuts
# at 4% of positions; and LoRA at the full fine-tuning lr hardly moves the policy, so 10x the lr
run grpo_T1.0_bottom0.5 grpo.py "${GRPO[@]}" --temperature 1.0 --bottom_p 0.5
run grpo_lora8_lr2e-3 grpo.py "${GRPO[@]}" --lora_rank 8 --lr 2e-3
