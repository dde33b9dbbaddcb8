#!/usr/bin/env bash
# The embedded pipeline on a CPU, stage by stage (papers 000 and 004 in miniature). Every command is
# printed before it runs, so you can copy it (and swap the flags for the papers' defaults) to a GPU.
#   ./run_cpu.sh [--force] [--rebuild-base] [--rebuild-teacher] [--plan] [OUT_DIR]
#       OUT_DIR defaults to out/cpu; a finished stage (OUT_DIR/NAME/wall_seconds) is skipped and a killed one
#       resumed from its last state; --force reruns all; --rebuild-base trains the base model here instead of
#       copying the shipped one (pretrained/tiny-base, this script's own base stage: stage 0 below);
#       --rebuild-teacher likewise OPD's teacher (pretrained/tiny-teacher, stage 1's teacher command);
#       --plan prints the order the stages would run in on this machine, and runs nothing
#   Stages that do not need each other run side by side (plumbing/pipeline.py), as many as the machine has cores (one
#   more where nothing waits for them), sharing them; each stage's output goes to OUT_DIR/logs/NAME.log and a status
#   line comes every 30 s (STATUS_EVERY).
#   SERIAL=1 ./run_cpu.sh               one stage at a time, with every core
#   CORES=4 ./run_cpu.sh                the cores to use (default: torch's count of physical cores, or OMP_NUM_THREADS)
#   RLT=1 ./run_cpu.sh                  also paper 004's comparison: RLT's teacher and its student against two
#                                       students (the teacher's accepted samples, the solver's traces); ~+17 min here
#   RLT_CONTROL=1 ./run_cpu.sh          RLT=1 and RLT's control: a student of the untrained teacher (+26 min in all
#                                       on 2 cores with AVX512-BF16, 9 of them the control's)
#   RLT_STUDENT=sft RLT=1 ./run_cpu.sh  RLT's reward scored by the SFT model, not teacher_student (chosen on val)
#   ANTICOLLAPSE=1 ./run_cpu.sh         also paper 000's anti-collapse study (two more OPD stages, ~+10 min)
#   NUMBERS=3to4 ./run_cpu.sh           the papers' task: a balanced 3/4-number mix (paper 001), 400 test problems,
#                                       256-token responses, its own shipped base and teacher (pretrained/*-3to4),
#                                       into out/cpu_3to4 (docs/studies/four_numbers.md)
#   COMPILE=1 ./run_cpu.sh              torch.compile the SFT stages (it did not pay over 1,000 steps here)
#   COUNTDOWN_CPU_BF16=0|1 ./run_cpu.sh  train in fp32 or bf16, not the path measured faster on this machine
#   Each adds to a finished run: its stages run, the finished ones are skipped
# At the end: OUT_DIR/results.json, paper 000's Tables 1-2 and OUT_DIR/{pass_at_k,rl_curves}.png.
set -euo pipefail
cd "$(dirname "$0")"
FORCE=${FORCE:-}
RLT_CONTROL=${RLT_CONTROL:-}
RLT=${RLT:-$RLT_CONTROL}
RLT_STUDENT=${RLT_STUDENT:-teacher_student}
[[ $RLT_STUDENT == sft || $RLT_STUDENT == teacher_student ]] || {
  echo "error: RLT_STUDENT=$RLT_STUDENT: the reward's student is sft or teacher_student" >&2; exit 2; }
REBUILD_BASE=${REBUILD_BASE:-}
REBUILD_TEACHER=${REBUILD_TEACHER:-}
SERIAL=${SERIAL:-}
ANTICOLLAPSE=${ANTICOLLAPSE:-}
COMPILE=${COMPILE:-}
NUMBERS=${NUMBERS:-3}
[[ $NUMBERS == 3 || $NUMBERS == 3to4 ]] || {
  echo "error: NUMBERS=$NUMBERS: the embedded task has 3 numbers (the default) or a 3to4 mix" >&2; exit 2; }
LANE=${NUMBERS#3}; LANE=${LANE:+3to4}  # the lane (empty: the default), which names its output and shipped models
PLAN=""
UNIT=""  # --unit NAME: run one unit of stages (how plumbing/pipeline.py starts each)
FLAGS=()
while [[ ${1:-} == --* ]]; do
  case $1 in --force) FORCE=1;; --rebuild-base) REBUILD_BASE=1;; --rebuild-teacher) REBUILD_TEACHER=1;;
    --plan) PLAN=1;; --unit) UNIT=$2; shift;;
    *) echo "unknown flag $1" >&2; exit 2;; esac
  [[ $1 == --unit || $1 == --plan ]] || FLAGS+=("$1")
  shift
done
# The venv's python if there is one and none is active (README, Quickstart), else python (or python3) on the PATH
PY=${PYTHON:-$(if [[ -z ${VIRTUAL_ENV:-} && -x .venv/bin/python ]]; then echo .venv/bin/python;
               else command -v python || command -v python3 || echo python; fi)}
python() { "$PY" "$@"; }
OUT=${1:-out/cpu${LANE:+_$LANE}}
[[ -n $PLAN ]] || mkdir -p "$OUT/logs"
if [[ -z $UNIT ]]; then
  python -c "import torch, transformers" 2>/dev/null || {
    echo "error: $PY cannot import torch and transformers: install first (README, Quickstart: ./install.sh)" >&2
    exit 2; }
  # Every thread pool a command may start, sized to the machine's cores (plumbing/pipeline.py gives each stage side by side
  # its share): torch counts physical cores (macOS too) and keeps a user's OMP_NUM_THREADS
  CORES=${CORES:-${OMP_NUM_THREADS:-$(python -c "import torch; print(torch.get_num_threads())")}}
  export OMP_NUM_THREADS=$CORES MKL_NUM_THREADS=$CORES OPENBLAS_NUM_THREADS=$CORES VECLIB_MAXIMUM_THREADS=$CORES \
    RAYON_NUM_THREADS=$CORES TORCHINDUCTOR_COMPILE_THREADS=$CORES
fi

# One problem distribution for every stage: 3 numbers in 1-20, targets 10-100. Its 200 test problems
# are never trained on; periodic evals use the 100 val problems x 4 samples (a pass@1 curve; the 200 x 16
# test evaluation after each stage makes the pass@k tables); training draws from the rest (~12k).
# 1-9 has only 1,345 problems in all: a tiny model memorizes them (README, "difficulty").
DATA="gen:nums=3,range=1-20,test=200,val=100"
TEST=200 LEN=160  # test problems, response budget (new tokens) in training and evaluation
# NUMBERS=3to4: the papers' distribution, 3 and 4 numbers half and half in every split (generate_splits' balanced
# mix, paper 001), 200 test problems of each; 4-number traces run longer (median 79 tokens, 14 % over 160, 3 % over
# 256), so 256 (docs/studies/four_numbers.md). Its RL steps cost ~2x the default's (longer rollouts), so 50
# RL steps, not 75, to end in an hour on 2 AVX2 cores: the lr is constant after warmup, and the lane's val
# pass@1 at step 50 of 75 was RLOO 0.295, GRPO 0.293 from SFT's 0.160 (docs/studies/four_numbers.md)
RL_STEPS=75
if [[ -n $LANE ]]; then DATA="gen:nums=3-4,range=1-20,test=400,val=200" TEST=400 LEN=256 RL_STEPS=50; fi
COMMON=(--data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4 --eval_max_new_tokens $LEN)
# Only solving pays: a wrong answer and a search cut short both earn 0 (--wrong_reward 0 --no_answer_reward 0), not
# paper 000's 0.1 (which paid the policy to claim "found" falsely) nor -0.5 for a wrong answer (which made a search
# cut short the better bet); chosen on val over both (docs/studies/strategies.md). A small lr (5e-5; 6.7e-5 below), not 2e-4 for 20 steps: at 2e-4
# the training reward fell in every stage (docs/studies/arithmetic.md); here it climbs, and RL's selection is done by step 25.
# 75 steps at lr 6.7e-5, the lr x steps of 100 at 5e-5 (chosen on val over 50, issue 44): from two SFT models the same val
# and test numbers as 100 steps at 5e-5, a quarter less RL work (issue 61; 75 steps at 5e-5 cost GRPO 0.03 of its val
# lift over five runs: docs/studies/performance.md, "Fewer RL steps at a higher lr"). A backward every 16 groups (128 rollouts), each
# prompt's forward once for its group, the rollouts in forwards sorted by length (--forward_rows): the same loss, and
# one GRPO-shaped update 0.81x the per-row forward's in bf16, 0.78x in fp32 capped at AVX2. Forwards of 32 where the RL
# stages train in bf16 (path.env), 16 in fp32: the three stages side by side on two cores, bf16 ran no slower at 32, fp32
# 0.86-0.97x at 16 (docs/studies/performance.md, "The shared forward inside autograd"). No --term_grads: each loss term's own gradient
# (grad/<term>, docs/studies/loss_terms.md) cost a backward per term on 5 steps of each stage, ~12 s each here
RL_ROWS=$([[ ${COUNTDOWN_CPU_BF16:-} == 1 ]] && echo 32 || echo 16)
RL=(--lr 6.7e-5 --temperature 0.7 --batch_size 32 --micro_batch 128 --forward_rows $RL_ROWS --max_response_len $LEN --max_steps $RL_STEPS
    --eval_every 25 --save_every 25 --wrong_reward 0 --no_answer_reward 0)
# RLOO and OPD take Eq. 3's log-prob per token (--pg_norm mean), not summed over the rollout's ~100 tokens: summed, it
# drowns λ_H and λ_KL (3e-5 and 5e-3 of its pull) and RLOO's val pass@1 fell 0.50 -> 0.32, against 0.45 (docs/studies/loss_terms.md)
PG=(--pg_norm mean)

stage() {  # stage NAME COMMAND...: run unless finished before; record its wall seconds; evaluate it if it is a policy
  local name=$1; shift
  if [[ -f "$OUT/$name/wall_seconds" && -z "$FORCE" ]]; then
    echo "== $name: finished in $OUT/$name, skipping (--force to rerun)"
  else
    local again=(--overwrite)  # a stage killed halfway goes on from its last state; else it starts afresh
    [[ -d $OUT/$name/state && -z "$FORCE" ]] && again=(--resume "$OUT/$name")
    echo "== $name: training (log: $OUT/logs/$name.log)"
    echo "+ $* ${again[*]}"
    local start=$SECONDS bf16=${COUNTDOWN_CPU_BF16:-}
    [[ ${2:-} == sft.py ]] && bf16=${SFT_CPU_BF16:-$bf16}  # the precision measured for SFT steps (path.env)
    COUNTDOWN_CPU_BF16=$bf16 logged "$name" "$@" "${again[@]}"
    echo $((SECONDS - start)) > "$OUT/$name/wall_seconds"
  fi
  evaluated "$name"
}

logged() {  # logged NAME COMMAND...: run it, its output to OUT/logs/NAME.log when run side by side, else here
  local name=$1; shift
  if [[ -n $UNIT ]]; then "$@" >> "$OUT/logs/$name.log" 2>&1; else "$@"; fi
}

evaluated() {  # evaluated NAME: paper 000's test evaluation (200 problems x 16 samples) of a policy
  local name=$1 summary=$OUT/eval/$1/summary.json
  case $name in base|rlt_sft|rlt|rlt0) return 0;; esac  # no answers yet / a teacher explains given solutions
  # evaluated once the stage had finished: a summary no older than the stage (both can share a timestamp tick)
  if [[ -f $summary && -z $FORCE && ! $OUT/$name/wall_seconds -nt $summary ]]; then
    echo "== $name: evaluated in $OUT/eval/$name, skipping"; return 0; fi
  echo "== $name: evaluating ($TEST test problems x 16 samples)"
  echo "+ python evaluate.py --model $OUT/$name --data $DATA --template compact --num_problems $TEST --max_new_tokens $LEN --out $OUT/eval/$name"
  logged "$name" python evaluate.py --model "$OUT/$name" --data "$DATA" --template compact --num_problems $TEST \
    --max_new_tokens $LEN --out "$OUT/eval/$name"
  python -c "import json, sys; s = json.load(open(sys.argv[1])); p = s['pass_at_k']
print(f'== {sys.argv[2]}: test pass@1 {p[\"1\"]:.3f} ± {1.96 * s[\"pass_at_1_stderr\"]:.3f}, pass@16 {p[\"16\"]:.3f}')" \
    "$OUT/eval/$name/summary.json" "$name"
}

# 0. The base model, the analog of pretraining: a tiny Qwen2 from scratch learns arithmetic by plain next-token
#    training on random computation paths over the task's numbers, written as the traces write steps (no prompt,
#    every token a target). 2,000 steps: greedy step error 1.6% (1,200: 5.8%; docs/studies/arithmetic.md). Like a hub
#    model it is downloaded, not trained, by default: pretrained/tiny-base is this stage's output, built by the
#    command below (its README says where and how well). --rebuild-base runs that command here instead (about 6 min
#    on 2 cores with AVX512-BF16, 25 without). NUMBERS=3to4 has its own (the same command on its data): the 3-number
#    base gets 30 % of the steps of 4-number paths wrong, this one 3.9 % (benchmarks/arith_probe.py)
base() {
  if [[ -n $REBUILD_BASE ]]; then
    [[ -f $OUT/base/wall_seconds && $(cat "$OUT/base/wall_seconds") == 0 ]] && rm -rf "$OUT/base"  # a copy: train
    stage base python sft.py --init tiny --data "arith:${DATA#gen:}" --eval_data "$DATA" --lr 2e-3 --warmup 0.08 \
      --batch_size 64 --micro_batch 64 --max_steps 2000 --eval_every 500 --save_every 500 --output_dir "$OUT/base"
  elif [[ -n $FORCE || ! -f $OUT/base/wall_seconds ]]; then
    echo "+ cp -r pretrained/tiny-base${LANE:+-$LANE} $OUT/base    # the shipped base; --rebuild-base trains it as above"
    rm -rf "$OUT/base" && cp -r "pretrained/tiny-base${LANE:+-$LANE}" "$OUT/base" && echo 0 > "$OUT/base/wall_seconds"
  fi
}

# 1. SFT from the base (000 §3.2 Eq. 1) on an *unverified* source, the analog of the real SFT set: LLM-written
#    traces (Cognitive Behaviors' cog_behav_all_strategies) of which only ~37 % are correct. The solver writes each
#    trace in one of two search strategies (plumbing/traces.py), so that RL has a behaviour to select: 70% random tries until
#    one reaches the target (a mean of one dead end; each try writes the target beside its value before the
#    verdict; half the dead ends near misses, without which "found" means "close"), 30% working backward from the
#    target, one subgoal a line (docs/studies/strategies.md). Then 63% of them get one mistake an LLM makes (sft.py
#    --mistakes: a slip claimed as a hit, a number reused or left out, a give-up that answers its closest try, an
#    answer written as an equation), so that RL has something to remove (docs/studies/unverified.md). 700 steps at lr
#    2e-3, chosen on val: the SFT model of 1,000 steps at 1e-3 (val pass@1 0.260-0.273 over five runs, eval loss 0.163) in
#    30 % fewer steps (0.292-0.297, 0.162-0.163); 700 at 1e-3, or 32 traces a step, fell short (0.18-0.20;
#    docs/studies/performance.md, "Less work"). Not compiled unless COMPILE=1: the first compile (2-2.5 min) cost more
#    than the compiled steps saved over 1,000 of them on both CPUs measured (docs/studies/performance.md). Its
#    micro-batches hold at most 2,048 padded tokens, not 16 rows whatever their length: rows run 57-412 tokens, and
#    padding to the longest of 16 was a quarter of a step's tokens (an eighth now); the same loss, a step 3-12 % faster
TRACES=(--near_misses 0.5 --micro_batch 16 --dead_ends 1 --strategies random:0.7,backward:0.3)
SFT=(--init "$OUT/base" "${COMMON[@]}" "${TRACES[@]}" --lr 2e-3 --batch_size 64 --max_steps 700 --eval_every 350
     ${COMPILE:+--compile})
SFT_MICRO=(--micro_batch_tokens 2048)
sft() { stage sft python sft.py "${SFT[@]}" "${SFT_MICRO[@]}" --output_dir "$OUT/sft"; }
#    Beside it, OPD's teacher, the analog of paper 000's Countdown-tuned 7B: the same source through paper 001's
#    verification gate (--verified: what the scorer rejects is dropped; 160 traces a step keep ~59, as many as the
#    SFT stage trains on), 2,000 steps at lr 1e-3 (as it was built, when the SFT stage took 1,000 at that lr), its
#    strategy mix chosen on val for what OPD learns from it (a teacher that works backward more is better alone and
#    worse as a teacher: docs/studies/teachers.md). Like the base it is
#    shipped (pretrained/tiny-teacher; 29 min on a core); --rebuild-teacher runs this command here instead.
#    With RLT=1, then paper 004's baseline for RLT: a student SFT'd from the base on the teacher's own samples that the
#    verifier accepts (rejection sampling: 4 samples of each of the first 2,000 training problems, RLT's problems),
#    and (a unit of its own) the student of the solver's own clean traces, the ceiling; STUDENT is every student's recipe
STUDENT=(--init "$OUT/base" "${COMMON[@]}" --num_train 1800 --lr 2e-3 --batch_size 64 --micro_batch 32 --max_steps 400 \
  --eval_every 400)
teacher() {
  if [[ -n $REBUILD_TEACHER ]]; then
    [[ -f $OUT/teacher/wall_seconds && $(cat "$OUT/teacher/wall_seconds") == 0 ]] && rm -rf "$OUT/teacher"  # a copy
    stage teacher python sft.py "${SFT[@]}" --verified --batch_size 160 --max_steps 2000 --lr 1e-3 --eval_every 500 \
      --strategies random:0.7,backward:0.3 --output_dir "$OUT/teacher"
  else
    if [[ -n $FORCE || ! -f $OUT/teacher/wall_seconds ]]; then
      echo "+ cp -r pretrained/tiny-teacher${LANE:+-$LANE} $OUT/teacher    # shipped; --rebuild-teacher trains it as above"
      rm -rf "$OUT/teacher" && cp -r "pretrained/tiny-teacher${LANE:+-$LANE}" "$OUT/teacher" && echo 0 > "$OUT/teacher/wall_seconds"
    fi
    evaluated teacher
  fi
}
teacher_student() {
  local accepted=$OUT/teacher/accepted.jsonl
  if [[ ! -f $accepted || -n $FORCE ]]; then
    echo "== teacher: evaluating (4 samples of 2,000 training problems: teacher_student's data)"
    echo "+ python evaluate.py --model $OUT/teacher --data $DATA --split train --num_problems 2000 --num_samples 4 --template compact --max_new_tokens $LEN --export $accepted"
    logged teacher python evaluate.py --model "$OUT/teacher" --data "$DATA" --split train --num_problems 2000 \
      --num_samples 4 --template compact --max_new_tokens $LEN --export "$accepted"
    tail -n 1 "$OUT/logs/teacher.log"  # (its table is of training problems)
  fi
  stage teacher_student python sft.py "${STUDENT[@]}" --data "$accepted" --output_dir "$OUT/teacher_student"
}
solver_student() { stage solver_student python sft.py "${STUDENT[@]}" --fixed_traces --dead_ends 1 --near_misses 0.5 \
  --mistakes none --output_dir "$OUT/solver_student"; }

# 2. RLOO from the SFT checkpoint (000 Eq. 3): 32 prompts x 8 rollouts per step, the paper's other knobs. Watch
#    train/mistake/* and train/strategy/backward in metrics.jsonl (and rl_curves.png): RL removes the mistakes SFT
#    imitated and selects among its two strategies. Then on-policy distillation from the teacher, hybrid with RLOO
#    (000 Eq. 4, Algorithm 1): from the SFT model like RLOO, same geometry and steps, paper 000's forward KL
#    (--kd_loss reverse: docs/studies/teachers.md), λ_KL 0.03, not 0.5, chosen on val: with the per-token L_PG the KL at 0.5
#    pulls 2.5-7x as hard as L_PG (the paper's summed L_PG outweighs its KL) and drags the student toward a skill it
#    cannot learn in 50 steps (val 0.379 against RLOO's 0.464; at 0.03: 0.463)
#    Beside them GRPO (004 Eq. 1-2, 002 Eq. 1): same batch geometry, KL to the frozen SFT model; rollouts at T 0.7
#    like RLOO's and β 0.04 (004's), not grpo.py's defaults (002's T 1.5, β 0.001); IPO on the SFT model's own
#    verifier-labelled samples (000 Eq. 2; lr 3e-5: at 1e-4 the chosen responses lost 1.8 nats too and val pass@1
#    fell 0.509 -> 0.404, docs/studies/arithmetic.md); and RLT's teacher's short SFT in its own format (004 §A.1: the
#    solution in the prompt; as the paper's, the explanations are its baseline's own data, here the teacher's accepted
#    samples of 2,000 other training problems; `--data rlt:SPEC` writes solver traces instead, docs/studies/teachers.md)
rloo() { stage rloo python rloo.py --init "$OUT/sft" "${COMMON[@]}" "${RL[@]}" "${PG[@]}" --output_dir "$OUT/rloo"; }
OPD=(--teacher "$OUT/teacher" --kl_coef 0.03 "${COMMON[@]}" "${RL[@]}" "${PG[@]}")
opd() { stage opd python opd.py --init "$OUT/sft" "${OPD[@]}" --output_dir "$OUT/opd"; }
grpo() { stage grpo python grpo.py --init "$OUT/sft" "${COMMON[@]}" "${RL[@]}" --group_size 8 --beta 0.04 \
  --output_dir "$OUT/grpo"; }
ipo() { stage ipo python ipo.py --init "$OUT/sft" "${COMMON[@]}" --lr 3e-5 --num_prompts 1024 --max_new_tokens $LEN \
  --batch_size 64 --micro_batch 32 --epochs 2 --output_dir "$OUT/ipo"; }
rlt_sft() {  # RLT's format warm-up on the baseline's own data (004 §A.1): the teacher's accepted samples of the
  #             2,000 training problems after RLT's, each rewritten as a teacher example (sft.py --data rlt:FILE)
  local warmup=$OUT/teacher/warmup.jsonl
  if [[ ! -f $warmup || -n $FORCE ]]; then
    echo "== teacher: evaluating (4 samples of training problems 2,000-4,000: rlt_sft's data)"
    echo "+ python evaluate.py --model $OUT/teacher --data $DATA --split train --num_problems 2000 --skip_problems 2000 --num_samples 4 --template compact --max_new_tokens $LEN --export $warmup"
    logged rlt_sft python evaluate.py --model "$OUT/teacher" --data "$DATA" --split train --num_problems 2000 \
      --skip_problems 2000 --num_samples 4 --template compact --max_new_tokens $LEN --export "$warmup"
  fi
  stage rlt_sft python sft.py --init "$OUT/sft" "${COMMON[@]}" --micro_batch 16 --data "rlt:$warmup" --lr 1e-3 \
    --warmup 0 --batch_size 64 --max_steps 100 --eval_every 100 --output_dir "$OUT/rlt_sft"
}
#    Then RLT's teacher (004), after rlt_sft in its unit: it learns to explain given solutions to a frozen
#    student, RLT_STUDENT: teacher_student, the analogue of 004's (its baseline's student; its RLT student's val
#    pass@1 0.238 against 0.198 with sft, docs/studies/teachers.md §4c), or sft; with the reward as its authors
#    run it (the written token's log-ratio for KL_t, both models at T 0.7) and 004 Table 3's λ 3, α 0.01
#    (--no-balance: §A.1's rule gives λ 13.4, α 0.085 here, and its student scored val 0.187 against 0.223;
#    docs/studies/teachers.md §4b), and writes explanations for the first 2,000 training problems at twice the
#    training budget (004 Table 4); a quarter of them are searches that never end, so a problem whose explanation
#    did not close is drawn again, up to 3 times (004 §B).
#    With RLT_CONTROL=1 also the untrained teacher's explanations (the same model, 0 steps)
rlt() {
  rlt_sft
  stage rlt python rlt.py --init "$OUT/rlt_sft" --student "$OUT/$RLT_STUDENT" "${COMMON[@]}" --lr 1e-4 \
    --batch_size 16 --group_size 8 --micro_batch 64 --max_response_len $LEN --max_steps 30 --eval_every 10 \
    --no-balance --export "$OUT/rlt/traces.jsonl" --export_redraws 3 --output_dir "$OUT/rlt"
  if [[ -n $RLT_CONTROL ]]; then
    stage rlt0 python rlt.py --init "$OUT/rlt_sft" --student "$OUT/$RLT_STUDENT" "${COMMON[@]}" --batch_size 16 \
      --group_size 8 --micro_batch 64 --max_response_len $LEN --max_steps 0 --no-balance \
      --export "$OUT/rlt0/traces.jsonl" --export_redraws 3 --output_dir "$OUT/rlt0"
  fi
}

# 3. RLT's student, SFT'd from the base on the RLT teacher's explanations (sft.py holds out a file's last 100 rows),
#    against stage 1's two students (and with RLT_CONTROL=1 the untrained teacher's). With ANTICOLLAPSE=1, paper
#    000's anti-collapse OPD (§3.3): warm-started from OPD, exactly two knobs changed (λ_H x10, T 1.3), against its
#    control, OPD run on for the same 50 steps with its knobs unchanged, so the table credits the knobs, not the
#    steps. Off by default since issue 44: nine seed pairs measured no effect here (docs/studies/teachers.md §3), and the
#    two stages were a fifth of the pipeline's time
rlt_student() {
  stage rlt_student python sft.py "${STUDENT[@]}" --data "$OUT/rlt/traces.jsonl" --output_dir "$OUT/rlt_student"
  if [[ -n $RLT_CONTROL ]]; then
    stage rlt0_student python sft.py "${STUDENT[@]}" --data "$OUT/rlt0/traces.jsonl" --output_dir "$OUT/rlt0_student"
  fi
}
opd_anticollapse() { stage opd_anticollapse python opd.py --init "$OUT/opd" "${OPD[@]}" --entropy_coef 1e-2 \
  --kd_temperature 1.3 --max_steps 50 --output_dir "$OUT/opd_anticollapse"; }
opd_longer() { stage opd_longer python opd.py --init "$OUT/opd" "${OPD[@]}" --max_steps 50 --output_dir "$OUT/opd_longer"; }

# ---- The run. Each unit is a stage or stages in order, after the units it needs (NAME:NEEDS); plumbing/pipeline.py starts
#      a unit when what it needs has finished, the longest chain first, up to one unit a core (one more where nothing
#      waits for them: the RL stages), and gives each running unit its share of the cores (a unit that ends hands its
#      share on). It runs each as
#      `run_cpu.sh --unit NAME`, which lands here
if [[ -n $UNIT ]]; then "$UNIT"; exit; fi
# Paper 000's table by default, the teacher's test evaluation beside sft; with COMPILE=1 after it, so that the compiled
# sft starts on every core (it keeps the threads it starts with)
UNITS=(sft teacher${COMPILE:+:sft} grpo:sft opd:sft,teacher rloo:sft ipo:sft)
if [[ -n $RLT ]]; then UNITS=(sft teacher solver_student teacher_student:teacher "rlt:sft,teacher,$RLT_STUDENT" grpo:sft
                               opd:sft,teacher rloo:sft ipo:sft rlt_student:rlt); fi
if [[ -n $ANTICOLLAPSE ]]; then UNITS+=(opd_anticollapse:opd opd_longer:opd); fi
export PYTHON=$PY CORES
ARGS=(--out "$OUT" --cores "$CORES" --status_every "${STATUS_EVERY:-30}")
if [[ -n $SERIAL ]]; then ARGS+=(--serial); fi
if [[ -n $PLAN ]]; then python -m plumbing.pipeline "${ARGS[@]}" --plan "${UNITS[@]}"; exit; fi
base
# The training path that is fastest on this machine, measured on the base model in ~15-30 s before the first stage
# (plumbing/machine.py): bf16 or fp32 forwards, for SFT steps shaped as the sft stage's and for RL updates apart; kept
# for the run's later resumes; COUNTDOWN_CPU_BF16=0|1 overrides both
if [[ ! -f $OUT/path.env || -n $FORCE || -n ${COUNTDOWN_CPU_BF16:-} ]]; then
  echo "+ python -m plumbing.machine --init $OUT/base --cores $CORES --out $OUT/path.env -- <the sft stage's flags>"
  python -m plumbing.machine --init "$OUT/base" --cores "$CORES" --out "$OUT/path.env" -- "${SFT[@]}" "${SFT_MICRO[@]}"
else
  echo "== training forwards as measured before: $(head -n 1 "$OUT/path.env" | cut -c3-) ($OUT/path.env)"
fi
source "$OUT/path.env"
echo "== $CORES cores: stages side by side, each with its share; status every ${STATUS_EVERY:-30} s, logs in $OUT/logs"
python -m plumbing.pipeline "${ARGS[@]}" --command "bash ./run_cpu.sh ${FLAGS[*]:-} --unit {} $(printf %q "$OUT")" "${UNITS[@]}"

# 4. Paper 000's Tables 1 and 2 for every stage, results.json and the plots
echo "+ python evaluate.py --run $OUT"
python evaluate.py --run "$OUT"
