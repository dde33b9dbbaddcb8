#!/usr/bin/env bash
# Issue 45's val study: RLT's recipe one lever at a time. Each teacher starts from a finished run_cpu.sh dir's
# rlt_sft (or exports from its trained rlt), explains the first 2,000 training problems, and a student is SFT'd
# on them from the base with run_cpu.sh's STUDENT recipe, then evaluated on val (100 x 16). Then a table: the
# teacher's held-out reward over its steps, what the export keeps and how its explanations slip, the student.
#   benchmarks/rlt_levers.sh OUT CPU_OUT [CONFIG ...]   (default: all configs below, in order)
set -uo pipefail
cd "$(dirname "$0")/.."
O=$1; M=$2; shift 2
DATA="gen:nums=3,range=1-20,test=200,val=100"
COMMON=(--data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4 --eval_max_new_tokens 160)
STUDENT=(--init $M/base "${COMMON[@]}" --num_train 1800 --lr 2e-3 --batch_size 64 --micro_batch 32 --max_steps 400 --eval_every 400)
RLT=(--student $M/sft "${COMMON[@]}" --lr 1e-4 --batch_size 16 --group_size 8 --micro_batch 64 --max_response_len 160 --eval_every 10)
declare -A CONFIG=(
  # the pipeline's trained teacher re-exported the old way (the solutions are the restricted solver's now)
  [before]="--init $M/rlt --max_steps 0 --no-balance --kl_estimator exact --reward_temperature 1 --export_max_new_tokens 160"
  [new]="--init $M/rlt_sft --max_steps 30"                              # the authors' reward, the rule's λ, α
  [nobal]="--init $M/rlt_sft --max_steps 30 --no-balance"               # ... with 004 Table 3's λ 3, α 0.01
  [rl0]="--init $M/rlt_sft --max_steps 0"                               # the RL control: no RL step
  [nobal_redraw]="--init $O/nobal/rlt --max_steps 0 --no-balance --export_redraws 3"  # the pipeline's export
  # each one change from the pipeline's recipe (nobal): the reward scored by the verified model, the old KL_t, T 1
  [vstudent]="--init $M/rlt_sft --max_steps 30 --no-balance --student $M/teacher"
  [exact]="--init $M/rlt_sft --max_steps 30 --no-balance --kl_estimator exact"
  [T1]="--init $M/rlt_sft --max_steps 30 --no-balance --reward_temperature 1")
t() { local n=$1; shift; local s=$SECONDS; echo "== $n: $*"; "$@" > "$O/$n.log" 2>&1; echo "== $n rc $? in $((SECONDS-s)) s"; }
mkdir -p "$O"
for n in "${@:-new nobal rl0 nobal_redraw vstudent exact T1}"; do
  for c in $n; do
    mkdir -p "$O/$c"
    # shellcheck disable=SC2086  # CONFIG's flags split on purpose
    [[ -f $O/$c/traces.jsonl ]] || t "rlt_$c" python rlt.py "${RLT[@]}" ${CONFIG[$c]} --export "$O/$c/traces.jsonl" \
      --output_dir "$O/$c/rlt" --overwrite
    [[ -f $O/$c/student/config.json ]] || t "student_$c" python sft.py "${STUDENT[@]}" --data "$O/$c/traces.jsonl" \
      --output_dir "$O/$c/student" --overwrite
    [[ -f $O/$c/val/summary.json ]] || t "val_$c" python evaluate.py --model "$O/$c/student" --data "$DATA" --split val \
      --num_problems 100 --template compact --max_new_tokens 160 --out "$O/$c/val"
  done
done
python - "$O" <<'PY'
import json, os, sys
from traces import arithmetic
O = sys.argv[1]
load = lambda p: [json.loads(x) for x in open(p)] if os.path.exists(p) else []  # noqa: E731
for n in sorted(os.listdir(O)):
    d, line = os.path.join(O, n), [n]
    ev = [r for r in load(f"{d}/rlt/metrics.jsonl") if "eval/reward" in r]
    if ev:
        line.append("held-out r " + " ".join(f"{r['step']}:{r['eval/reward']:.2f}" for r in ev) + f", penalized "
                    f"{ev[0]['eval/penalized']:.2f} -> {ev[-1]['eval/penalized']:.2f}")
    if os.path.exists(f"{d}/rlt/balance.json"):
        b = json.load(open(f"{d}/rlt/balance.json"))
        line.append(f"α {b['alpha']:.3g} λ {b['lam']:.3g}")
    if os.path.exists(f"{d}/traces.jsonl.stats.json"):
        s = json.load(open(f"{d}/traces.jsonl.stats.json"))
        line.append(f"exported {s['exported']}/{s['problems']}, first draw closed {s.get('closed_first_draw', s['closed']):.3f}")
    rows = load(f"{d}/traces.jsonl")
    if rows:
        a = arithmetic([r["completion"].split("</think>")[0] for r in rows], [r["target"] for r in rows])
        line.append(f"explanations: wrong step {a['step_error']:.3f}, false found {a['false_claims']:.3f}")
    if os.path.exists(f"{d}/val/summary.json"):
        s = json.load(open(f"{d}/val/summary.json"))
        line.append(f"student val pass@1 {s['pass_at_k']['1']:.3f} ± {1.96 * s['pass_at_1_stderr']:.3f}, pass@16 "
                    f"{s['pass_at_k']['16']:.3f}, slip {s['mistakes']['slip']:.3f}, false found "
                    f"{s['arithmetic']['false_claims']:.3f}")
    if len(line) > 1:
        print(" | ".join(line))
PY
