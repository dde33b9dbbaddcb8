#!/usr/bin/env bash
# Issue 44's equal-time RL lever on val: half the prompts a step for twice the steps (--batch_size 16 for 100 steps
# against run_cpu.sh's 32 for 50: the same rollouts sampled and trained on, twice the updates). Each arm runs from a
# finished run_cpu.sh dir's sft model, alone on every core; then every arm and the dir's own stages are evaluated
# on val at 128 samples a problem (the sampling noise of a paired difference 1/8 of its variance at 16), and
# compared paired (benchmarks/paired.py).
#   benchmarks/rl_batch.sh OUT CPU_OUT [ALG ...]      ALG: rloo grpo opd (default rloo grpo)
set -uo pipefail
cd "$(dirname "$0")/.."
O=$1; M=$2; shift 2; ALGS=("$@"); [[ ${#ALGS[@]} -gt 0 ]] || ALGS=(rloo grpo)
mkdir -p "$O"
DATA="gen:nums=3,range=1-20,test=200,val=100"
COMMON=(--data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4 --eval_max_new_tokens 160)
RL=(--lr 5e-5 --temperature 0.7 --micro_batch 64 --max_response_len 160 --wrong_reward 0 --no_answer_reward 0
    --term_grads)  # run_cpu.sh's RL less the batch and the steps
declare -A ALG=([rloo]="rloo.py --pg_norm mean" [grpo]="grpo.py --group_size 8 --beta 0.04"
                [opd]="opd.py --teacher $M/teacher --kl_coef 0.03 --pg_norm mean")
t() { local n=$1 s=$SECONDS rc; shift; echo "== $n: $*"; "$@" > "$O/$n.log" 2>&1; rc=$?
  echo "== $n rc $rc in $((SECONDS-s)) s"; return $rc; }
val() { [[ -f $O/val128_$1/summary.json ]] || t "val128_$1" python evaluate.py --model "$2" --data "$DATA" --split val \
  --num_problems 100 --num_samples 128 --template compact --max_new_tokens 160 --out "$O/val128_$1"; }
for a in "${ALGS[@]}"; do
  val "${a}_b32x50" "$M/$a"
  # shellcheck disable=SC2086  # ALG's flags split on purpose
  [[ -f $O/${a}_b16x100/done ]] || { t "${a}_b16x100" python ${ALG[$a]} --init "$M/sft" "${COMMON[@]}" "${RL[@]}" \
    --batch_size 16 --max_steps 100 --eval_every 50 --save_every 50 --output_dir "$O/${a}_b16x100" --overwrite &&
    touch "$O/${a}_b16x100/done"; }
  val "${a}_b16x100" "$O/${a}_b16x100"
  python benchmarks/paired.py "$O/val128_${a}_b32x50" "$O/val128_${a}_b16x100"
done
