#!/usr/bin/env bash
# Issue 44's RL lever on val: more steps. A finished run_cpu.sh dir's RL stages are copied and resumed from their
# 50-step states to 75 and 100 steps (constant lr and per-step seeds: the same runs made longer), each evaluated on
# val (100 problems x SAMPLES, 16 by default) at 50, 75 and 100; then a table, and each longer run against its
# 50-step self paired on the same problems (benchmarks/paired.py: at 128 samples the paired interval halves).
#   [SAMPLES=128] benchmarks/rl_steps.sh OUT CPU_OUT [ALG ...]      ALG: rloo grpo opd (default rloo grpo)
set -uo pipefail
cd "$(dirname "$0")/.."
O=$1; M=$2; shift 2; ALGS=("$@"); [[ ${#ALGS[@]} -gt 0 ]] || ALGS=(rloo grpo)
S=${SAMPLES:-16}; mkdir -p "$O"
DATA="gen:nums=3,range=1-20,test=200,val=100"
COMMON=(--data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4 --eval_max_new_tokens 160)
RL=(--lr 5e-5 --temperature 0.7 --batch_size 32 --micro_batch 64 --max_response_len 160 --eval_every 25
    --save_every 25 --wrong_reward 0 --no_answer_reward 0 --term_grads)  # run_cpu.sh's RL of the 50-step runs
declare -A ALG=([rloo]="rloo.py --pg_norm mean" [grpo]="grpo.py --group_size 8 --beta 0.04"
                [opd]="opd.py --teacher $M/teacher --kl_coef 0.03 --pg_norm mean")
t() { local n=$1; shift; local s=$SECONDS; echo "== $n: $*"; "$@" > "$O/$n.log" 2>&1; echo "== $n rc $? in $((SECONDS-s)) s"; }
val() { t "val_$1" python evaluate.py --model "$2" --data "$DATA" --split val --num_problems 100 --num_samples "$S" \
  --template compact --max_new_tokens 160 --out "$O/val_$1"; }
for a in "${ALGS[@]}"; do
  val "${a}50" "$M/$a"
  rm -rf "${O:?}/$a" && cp -r "$M/$a" "$O/$a"
  for n in 75 100; do
    # shellcheck disable=SC2086  # ALG's flags split on purpose
    t "$a$n" python ${ALG[$a]} --init "$M/sft" "${COMMON[@]}" "${RL[@]}" --max_steps "$n" --resume "$O/$a"
    val "$a$n" "$O/$a"
  done
done
python - "$O" "${ALGS[@]}" <<'PY'
import json, sys
O = sys.argv[1]
print("| stage | steps | val pass@1 ± 95 % | pass@16 |\n|---|---|---|---|")
for a in sys.argv[2:]:
    for n in (50, 75, 100):
        s = json.load(open(f"{O}/val_{a}{n}/summary.json"))
        print(f"| {a} | {n} | {s['pass_at_k']['1']:.3f} ± {1.96 * s['pass_at_1_stderr']:.3f} | {s['pass_at_k']['16']:.3f} |")
PY
for a in "${ALGS[@]}"; do python benchmarks/paired.py "$O/val_${a}50" "$O/val_${a}75" "$O/val_${a}100"; done
