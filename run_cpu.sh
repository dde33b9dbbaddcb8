#!/usr/bin/env bash
# The embedded pipeline on a CPU, stage by stage (papers 000 and 004 in miniature). Every command is
# printed before it runs, so you can copy it (and swap the flags for the papers' defaults) to a GPU.
#   ./run_cpu.sh [--force] [--rebuild-base] [OUT_DIR]
#       OUT_DIR defaults to out/cpu; a finished stage (OUT_DIR/NAME/wall_seconds) is skipped and a killed one
#       resumed from its last state; --force reruns all; --rebuild-base trains the base model here instead of
#       copying the shipped one (pretrained/tiny-base, this script's own base stage: stage 0 below)
#   RLT_CONTROL=1 ./run_cpu.sh          also RLT's control: a student of the untrained teacher (+2.5 min here)
#   SERIAL=1 ./run_cpu.sh               every stage one after the other (by default independent ones run in pairs)
# At the end: OUT_DIR/results.json, paper 000's Tables 1-2 and OUT_DIR/{pass_at_k,rl_curves}.png.
set -euo pipefail
cd "$(dirname "$0")"
FORCE=${FORCE:-}
RLT_CONTROL=${RLT_CONTROL:-}
REBUILD_BASE=${REBUILD_BASE:-}
SERIAL=${SERIAL:-}
while [[ ${1:-} == --* ]]; do
  case $1 in --force) FORCE=1;; --rebuild-base) REBUILD_BASE=1;; *) echo "unknown flag $1" >&2; exit 2;; esac
  shift
done
OUT=${1:-out/cpu}
mkdir -p "$OUT"

# One problem distribution for every stage: 3 numbers in 1-20, targets 10-100. Its 200 test problems
# are never trained on; periodic evals use the 100 val problems x 4 samples (a pass@1 curve; the 200 x 16
# test evaluation after each stage makes the pass@k tables); training draws from the rest (~12k).
# 1-9 has only 1,345 problems in all: a tiny model memorizes them (README, "difficulty").
DATA="gen:nums=3,range=1-20,test=200,val=100"
COMMON=(--data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4 --eval_max_new_tokens 160)
# Only solving pays: a wrong answer and a search cut short both earn 0 (--wrong_reward 0 --no_answer_reward 0), not
# paper 000's 0.1 (which paid the policy to claim "found" falsely) nor -0.5 for a wrong answer (which made a search
# cut short the better bet); chosen on val over both (docs/strategies.md). lr 5e-5 for 50 steps, not 2e-4 for 20:
# at 2e-4 the training reward fell in every stage (docs/arithmetic.md); here it climbs, and RL's selection is done by
# step 25
RL=(--lr 5e-5 --temperature 0.7 --batch_size 32 --micro_batch 64 --max_response_len 160 --max_steps 50 --eval_every 25
    --save_every 25 --wrong_reward 0 --no_answer_reward 0 --term_grads)
# RLOO and OPD take Eq. 3's log-prob per token (--pg_norm mean), not summed over the rollout's ~100 tokens: summed, it
# drowns λ_H and λ_KL (3e-5 and 5e-3 of its pull) and RLOO's val pass@1 fell 0.50 -> 0.32, against 0.45 (docs/loss_terms.md)
PG=(--pg_norm mean)

stage() {  # stage NAME COMMAND...: run unless finished before; record its wall seconds; evaluate it if it is a policy
  local name=$1; shift
  if [[ -f "$OUT/$name/wall_seconds" && -z "$FORCE" ]]; then
    echo "== $name: finished in $OUT/$name, skipping (--force to rerun)"
  else
    local again=(--overwrite)  # a stage killed halfway goes on from its last state; else it starts afresh
    [[ -d $OUT/$name/state && -z "$FORCE" ]] && again=(--resume "$OUT/$name")
    echo "+ $* ${again[*]}"
    local start=$SECONDS
    "$@" "${again[@]}"
    echo $((SECONDS - start)) > "$OUT/$name/wall_seconds"
  fi
  case $name in base|rlt_sft|rlt|rlt0) return 0;; esac  # no answers yet / a teacher explains given solutions
  echo "+ python evaluate.py --model $OUT/$name --data $DATA --template compact --num_problems 200 --max_new_tokens 160 --out $OUT/eval/$name"
  python evaluate.py --model "$OUT/$name" --data "$DATA" --template compact --num_problems 200 \
    --max_new_tokens 160 --out "$OUT/eval/$name"
}

both() {  # both F G: two stages that do not depend on each other side by side, a core each (two RL stages
  # so gave 1.35x the throughput of one after the other on 2 cores: small matrices leave the second core half
  # idle; docs/performance.md). Each writes to OUT/F.log; the commands are printed when both are done.
  # SERIAL=1: one after the other, all output here
  if [[ -n $SERIAL ]]; then "$1"; "$2"; return; fi
  echo "== side by side: $1 | $2 (output in $OUT/$1.log, $OUT/$2.log)"
  (export OMP_NUM_THREADS=1; "$1") > "$OUT/$1.log" 2>&1 & local a=$!
  (export OMP_NUM_THREADS=1; "$2") > "$OUT/$2.log" 2>&1 & local b=$!
  local failed=""
  wait $a || failed="$1"
  wait $b || failed="$failed $2"
  grep -h '^+ \|^== ' "$OUT/$1.log" "$OUT/$2.log" || true
  [[ -z $failed ]] || { echo "error:$failed failed: see its log in $OUT" >&2; exit 1; }
}

# 0. The base model, the analog of pretraining: a tiny Qwen2 from scratch learns arithmetic by plain next-token
#    training on random computation paths over the task's numbers, written as the traces write steps (no prompt,
#    every token a target). 2,000 steps: greedy step error 1.6% (1,200: 5.8%; docs/arithmetic.md). Like a hub
#    model it is downloaded, not trained, by default: pretrained/tiny-base is this stage's output, built by the
#    command below (its README says where and how well). --rebuild-base runs that command here instead (about 6 min
#    on 2 cores with AVX512-BF16, 25 without)
if [[ -n $REBUILD_BASE ]]; then
  [[ -f $OUT/base/wall_seconds && $(cat "$OUT/base/wall_seconds") == 0 ]] && rm -rf "$OUT/base"  # a copy: train
  stage base python sft.py --init tiny --data "arith:${DATA#gen:}" --eval_data "$DATA" --lr 2e-3 --warmup 0.08 \
    --batch_size 64 --micro_batch 64 --max_steps 2000 --eval_every 500 --save_every 500 --output_dir "$OUT/base"
elif [[ -n $FORCE || ! -f $OUT/base/wall_seconds ]]; then
  echo "+ cp -r pretrained/tiny-base $OUT/base    # the shipped base; --rebuild-base trains it as above"
  rm -rf "$OUT/base" && cp -r pretrained/tiny-base "$OUT/base" && echo 0 > "$OUT/base/wall_seconds"
fi

# 1. SFT from the base (000 §3.2 Eq. 1) on an *unverified* source, the analog of the real SFT set: LLM-written
#    traces (Cognitive Behaviors' cog_behav_all_strategies) of which only ~37 % are correct. The solver writes each
#    trace in one of two search strategies (traces.py), so that RL has a behaviour to select: 70% random tries until
#    one reaches the target (a mean of one dead end; each try writes the target beside its value before the
#    verdict; half the dead ends near misses, without which "found" means "close"), 30% working backward from the
#    target, one subgoal a line (docs/strategies.md). Then 63% of them get one mistake an LLM makes (sft.py
#    --mistakes: a slip claimed as a hit, a number reused or left out, a give-up that answers its closest try, an
#    answer written as an equation), so that RL has something to remove (docs/unverified.md). Beside it, the same
#    source through paper 001's verification gate (--verified: what the scorer rejects is dropped): the SFT model
#    of clean traces, and OPD's teacher. SFT_STEPS chosen on val (docs/unverified.md). --compile: steps 1.3x
#    faster after a first compile of about 2 min (docs/performance.md)
TRACES=(--near_misses 0.5 --micro_batch 16 --dead_ends 1 --strategies random:0.7,backward:0.3)
SFT=(--init "$OUT/base" "${COMMON[@]}" "${TRACES[@]}" --lr 1e-3 --batch_size 64 --max_steps 1000 --eval_every 500 --compile)
sft() { stage sft python sft.py "${SFT[@]}" --output_dir "$OUT/sft"; }
# the gate keeps ~37 % of a batch: 160 traces a step keep ~59, as many as the unverified SFT trains on (at 64 the
# gated model saw a third of the examples and reached test pass@1 0.242, below the unverified one)
sft_verified() { stage sft_verified python sft.py "${SFT[@]}" --verified --batch_size 160 --output_dir "$OUT/sft_verified"; }
both sft sft_verified

# 2. RLOO from the SFT checkpoint (000 Eq. 3): 32 prompts x 8 rollouts per step, the paper's other knobs. Watch
#    train/mistake/* and train/strategy/backward in metrics.jsonl (and rl_curves.png): RL removes the mistakes SFT
#    imitated and selects among its two strategies. GRPO beside it (004 Eq. 1-2, 002 Eq. 1): same batch geometry,
#    KL to the frozen SFT model; rollouts at T 0.7 like RLOO's and β 0.04 (004's), not grpo.py's defaults (002's
#    T 1.5, β 0.001)
rloo() { stage rloo python rloo.py --init "$OUT/sft" "${COMMON[@]}" "${RL[@]}" "${PG[@]}" --output_dir "$OUT/rloo"; }
grpo() { stage grpo python grpo.py --init "$OUT/sft" "${COMMON[@]}" "${RL[@]}" --group_size 8 --beta 0.04 \
  --output_dir "$OUT/grpo"; }
both rloo grpo

# 3. IPO on the SFT model's own verifier-labelled samples (000 Eq. 2). lr 3e-5: at 1e-4 the chosen responses
#    lost 1.8 nats too and val pass@1 fell 0.509 -> 0.404 (docs/arithmetic.md). Beside it, on-policy distillation
#    from the verified SFT model, hybrid with RLOO (000 Eq. 4, Algorithm 1): same geometry and steps as RLOO
ipo() { stage ipo python ipo.py --init "$OUT/sft" "${COMMON[@]}" --lr 3e-5 --num_prompts 1024 --max_new_tokens 160 \
  --batch_size 64 --micro_batch 32 --epochs 2 --output_dir "$OUT/ipo"; }
opd() { stage opd python opd.py --init "$OUT/sft" --teacher "$OUT/sft_verified" "${COMMON[@]}" "${RL[@]}" "${PG[@]}" \
  --output_dir "$OUT/opd"; }
both ipo opd

# 4. Anti-collapse OPD (000 §3.3): warm-started from OPD, exactly two knobs changed (λ_H x10, T 1.3), against
#    its control: OPD run on for the same 50 steps with its knobs unchanged, so the table credits the knobs, not the steps
OPD_ON=(--init "$OUT/opd" --teacher "$OUT/sft_verified" "${COMMON[@]}" "${RL[@]}" "${PG[@]}")
opd_anticollapse() { stage opd_anticollapse python opd.py "${OPD_ON[@]}" --entropy_coef 1e-2 --kd_temperature 1.3 \
  --output_dir "$OUT/opd_anticollapse"; }
opd_longer() { stage opd_longer python opd.py "${OPD_ON[@]}" --output_dir "$OUT/opd_longer"; }
both opd_anticollapse opd_longer

# 5. RLT (004): first the teacher's short SFT in its own format (004 §A.1: the solution in the prompt, a solver
#    trace as the explanation; it lifted the student from 0.035 to 0.173 test pass@1, docs/rlt_recipe.md), then it
#    learns to explain given solutions to the frozen SFT student, then it writes traces for 2,000 training problems,
#    and a student is SFT'd from the base on them. Beside it, the student of the solver's own (clean) traces:
#    the same steps on the same number of problems. With RLT_CONTROL=1 also the untrained teacher's student (the
#    same model, 0 steps). Of the 2,000 exported, RLT skips the few it cannot explain without truncation and
#    sft.py holds out the last 100 rows of a file
STUDENT=(--init "$OUT/base" "${COMMON[@]}" --num_train 1800 --lr 2e-3 --batch_size 64 --micro_batch 32 --max_steps 400 \
  --eval_every 400)
rlt_chain() {
  stage rlt_sft python sft.py --init "$OUT/sft" "${COMMON[@]}" --near_misses 0.5 --micro_batch 16 --dead_ends 1 \
    --data "rlt:${DATA#gen:}" --lr 1e-3 --warmup 0 --batch_size 64 --max_steps 100 --eval_every 100 --output_dir "$OUT/rlt_sft"
  stage rlt python rlt.py --init "$OUT/rlt_sft" --student "$OUT/sft" "${COMMON[@]}" --lr 1e-4 --batch_size 16 \
    --group_size 8 --micro_batch 64 --max_response_len 160 --max_steps 30 --eval_every 10 \
    --export "$OUT/rlt/traces.jsonl" --output_dir "$OUT/rlt"
  stage rlt_student python sft.py "${STUDENT[@]}" --data "$OUT/rlt/traces.jsonl" --output_dir "$OUT/rlt_student"
  if [[ -n $RLT_CONTROL ]]; then
    stage rlt0 python rlt.py --init "$OUT/rlt_sft" --student "$OUT/sft" "${COMMON[@]}" --micro_batch 64 \
      --max_response_len 160 --max_steps 0 --export "$OUT/rlt0/traces.jsonl" --output_dir "$OUT/rlt0"
    stage rlt0_student python sft.py "${STUDENT[@]}" --data "$OUT/rlt0/traces.jsonl" --output_dir "$OUT/rlt0_student"
  fi
}
solver_student() { stage solver_student python sft.py "${STUDENT[@]}" --fixed_traces --dead_ends 1 --near_misses 0.5 \
  --mistakes none --output_dir "$OUT/solver_student"; }
both rlt_chain solver_student

# 6. Paper 000's Tables 1 and 2 for every stage, results.json and the plots
echo "+ python report.py --run $OUT"
python report.py --run "$OUT"
