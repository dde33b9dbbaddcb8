#!/usr/bin/env bash
# Paper 004's comparison in the embedded setting: students SFT'd on the same problems, "each sample only
# differing in terms of its reasoning trace" (004 §4). From a finished run_cpu.sh dir (its rlt teacher's
# export, the teacher's accepted samples, base, sft, rlt_sft), it exports the untrained RLT teacher's
# explanations (the RL control: rlt_sft, 0 steps, the same flags), keeps the problems every source covers
# (sft.py --problems), and trains one student per source and seed with run_cpu.sh's STUDENT recipe:
# RLT's, the teacher's accepted samples (004's baseline), the RL control's, the solver's clean traces.
# Then each on the test split (200 x 16) and a table with the rows each trained on.
#   benchmarks/rlt_compare.sh OUT CPU_OUT [SEEDS]      (SEEDS: default "0 1")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; CPU=$2; SEEDS=${3:-0 1}
SPEC="nums=3,range=1-20,test=200,val=100"; DATA="gen:$SPEC"
COMMON=(--data "$DATA" --eval_data "$DATA" --template compact --eval_problems 100 --eval_samples 4 --eval_max_new_tokens 160)
STUDENT=(--init "$CPU/base" "${COMMON[@]}" --num_train 2000 --lr 2e-3 --batch_size 64 --micro_batch 32 --max_steps 400 \
  --eval_every 400)
mkdir -p "$OUT"
run() {  # run NAME COMMAND...: skip a finished one, log to OUT/NAME.log
  local name=$1; shift
  [[ -f $OUT/$name.done ]] && { echo "== $name: done"; return; }
  echo "+ $*"
  "$@" > "$OUT/$name.log" 2>&1
  touch "$OUT/$name.done"
}
# the RL control: the teacher RL starts from, exported with the pipeline's rlt flags and 0 steps
run rlt0 python rlt.py --init "$CPU/rlt_sft" --student "$CPU/sft" "${COMMON[@]}" --batch_size 16 --group_size 8 \
  --micro_batch 64 --max_response_len 160 --max_steps 0 --no-balance --export "$OUT/rlt0.jsonl" --export_redraws 3 --output_dir "$OUT/rlt0" --overwrite
FILES="$CPU/rlt/traces.jsonl,$CPU/teacher/accepted.jsonl,$OUT/rlt0.jsonl"
declare -A SOURCE=([rlt]="--data $CPU/rlt/traces.jsonl" [teacher]="--data $CPU/teacher/accepted.jsonl"
  [rlt0]="--data $OUT/rlt0.jsonl" [solver]="--fixed_traces --dead_ends 1 --near_misses 0.5 --mistakes none")
for seed in $SEEDS; do
  for src in rlt teacher rlt0 solver; do
    # shellcheck disable=SC2086  # SOURCE's flags split on purpose
    run "${src}_s$seed" python sft.py "${STUDENT[@]}" ${SOURCE[$src]} --problems "$FILES" --seed "$seed" \
      --output_dir "$OUT/${src}_s$seed" --overwrite
    run "eval_${src}_s$seed" python evaluate.py --model "$OUT/${src}_s$seed" --data "$DATA" --template compact \
      --num_problems 200 --max_new_tokens 160 --out "$OUT/eval/${src}_s$seed"
  done
done
python - "$OUT" "$CPU" $SEEDS <<'EOF'
import json, re, sys
from traces import arithmetic
out, cpu, seeds = sys.argv[1], sys.argv[2], sys.argv[3:]
# what each file teaches before the common problems are kept: its rows, wrong steps and false `found` claims
print("| source | rows | wrong step | false `found` |\n|---|---|---|---|")
for src, path in (("rlt", f"{cpu}/rlt/traces.jsonl"), ("teacher", f"{cpu}/teacher/accepted.jsonl"),
                  ("rlt0", f"{out}/rlt0.jsonl")):
    rows = [json.loads(x) for x in open(path)]
    a = arithmetic([r["completion"].split("</think>")[0] for r in rows], [r["target"] for r in rows])
    print(f"| {src} | {len(rows)} | {100 * a['step_error']:.1f} % | {100 * a['false_claims']:.1f} % |")
print()
print("| student | seed | rows | test pass@1 ± 95 % | pass@16 | slip | false `found` |\n|---|---|---|---|---|---|---|")
for src in ("rlt", "teacher", "rlt0", "solver"):
    for s in seeds:
        rows = re.search(r"(\d+) training examples", open(f"{out}/{src}_s{s}.log").read()).group(1)
        e = json.load(open(f"{out}/eval/{src}_s{s}/summary.json"))
        print(f"| {src} | {s} | {rows} | {e['pass_at_k']['1']:.3f} ± {1.96 * e['pass_at_1_stderr']:.3f} | "
              f"{e['pass_at_k']['16']:.3f} | {100 * e['mistakes']['slip']:.1f} % | "
              f"{100 * e['arithmetic']['false_claims']:.1f} % |")
EOF
