#!/usr/bin/env bash
# Paper 004's comparison in the embedded setting: students SFT'd on the same problems, "each sample only
# differing in terms of its reasoning trace" (004 §4). From a finished run_cpu.sh dir (its rlt teacher's
# export, the teacher's accepted samples, base, sft, rlt_sft), it exports the untrained RLT teacher's
# explanations (the RL control: rlt_sft, 0 steps, the same flags), keeps the problems every source covers
# (sft.py --problems), and trains one student per source and seed with run_cpu.sh's STUDENT recipe:
# RLT's, the teacher's accepted samples (004's baseline), the RL control's, the solver's clean traces, and the
# writer's control: the verified teacher as RLT's writer (run_cpu.sh's rlt_sft from CPU_OUT/teacher, 0 RL steps).
# Then each on the test split (200 x 16) at the pipeline's budget, 160 new tokens, and at LONG (320: how much of a
# student's deficit is searches the budget cuts), and a table with the rows each trained on.
#   benchmarks/rlt_compare.sh OUT CPU_OUT [SEEDS]      (SEEDS: default "0 1"; LONG=0 skips the second evaluation)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1; CPU=$2; SEEDS=${3:-0 1}; LONG=${LONG:-320}
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
  --micro_batch 64 --max_response_len 160 --max_steps 0 --no-balance --export "$OUT/rlt0.jsonl" --export_redraws 3 \
  --output_dir "$OUT/rlt0" --overwrite
# the writer's control: the same format SFT and export from the verified teacher instead of the SFT model
run vrlt_sft python sft.py --init "$CPU/teacher" "${COMMON[@]}" --near_misses 0.5 --micro_batch 16 --dead_ends 1 \
  --data "rlt:$SPEC" --lr 1e-3 --warmup 0 --batch_size 64 --max_steps 100 --eval_every 100 --output_dir "$OUT/vrlt_sft" \
  --overwrite
run vrlt0 python rlt.py --init "$OUT/vrlt_sft" --student "$CPU/sft" "${COMMON[@]}" --batch_size 16 --group_size 8 \
  --micro_batch 64 --max_response_len 160 --max_steps 0 --no-balance --export "$OUT/vrlt0.jsonl" --export_redraws 3 \
  --output_dir "$OUT/vrlt0" --overwrite
# the problems every student trains on: those of the first three (the writer's control keeps those it covers too)
FILES="$CPU/rlt/traces.jsonl,$CPU/teacher/accepted.jsonl,$OUT/rlt0.jsonl"
declare -A SOURCE=([rlt]="--data $CPU/rlt/traces.jsonl" [teacher]="--data $CPU/teacher/accepted.jsonl"
  [rlt0]="--data $OUT/rlt0.jsonl" [vrlt0]="--data $OUT/vrlt0.jsonl"
  [solver]="--fixed_traces --dead_ends 1 --near_misses 0.5 --mistakes none")
for seed in $SEEDS; do
  for src in rlt teacher rlt0 vrlt0 solver; do
    # shellcheck disable=SC2086  # SOURCE's flags split on purpose
    run "${src}_s$seed" python sft.py "${STUDENT[@]}" ${SOURCE[$src]} --problems "$FILES" --seed "$seed" \
      --output_dir "$OUT/${src}_s$seed" --overwrite
    run "eval_${src}_s$seed" python evaluate.py --model "$OUT/${src}_s$seed" --data "$DATA" --template compact \
      --num_problems 200 --max_new_tokens 160 --out "$OUT/eval/${src}_s$seed"
    [[ $LONG == 0 ]] || run "eval${LONG}_${src}_s$seed" python evaluate.py --model "$OUT/${src}_s$seed" --data "$DATA" \
      --template compact --num_problems 200 --max_new_tokens "$LONG" --out "$OUT/eval$LONG/${src}_s$seed"
  done
done
python - "$OUT" "$CPU" "$LONG" $SEEDS <<'EOF'
import json, os, re, sys
from transformers import AutoTokenizer
from traces import arithmetic
out, cpu, long, seeds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
tok = AutoTokenizer.from_pretrained(f"{cpu}/base")
# what each file teaches before the common problems are kept: its rows, their length in the tokens a student
# learns to write (sft.py's tokenization), wrong steps and false `found` claims
print("| source | rows | tokens: median, p90 | over 160 tokens | wrong step | false `found` |\n|---|---|---|---|---|---|")
for src, path in (("rlt", f"{cpu}/rlt/traces.jsonl"), ("teacher", f"{cpu}/teacher/accepted.jsonl"),
                  ("rlt0", f"{out}/rlt0.jsonl"), ("vrlt0", f"{out}/vrlt0.jsonl")):
    rows = [json.loads(x) for x in open(path)]
    n = sorted(len(tok(r["completion"])["input_ids"]) for r in rows)
    a = arithmetic([r["completion"].split("</think>")[0] for r in rows], [r["target"] for r in rows])
    print(f"| {src} | {len(rows)} | {n[len(n) // 2]}, {n[9 * len(n) // 10]} | {100 * sum(x > 160 for x in n) / len(n):.1f} % "
          f"| {100 * a['step_error']:.1f} % | {100 * a['false_claims']:.1f} % |")
print(f"\n| student | seed | rows | test pass@1 ± 95 % | pass@16 | answered | slip | false `found` | at {long} tokens: "
      "pass@1, answered |\n|---|---|---|---|---|---|---|---|---|")
for src in ("rlt", "teacher", "rlt0", "vrlt0", "solver"):
    for s in seeds:
        rows = re.search(r"(\d+) training examples", open(f"{out}/{src}_s{s}.log").read()).group(1)
        e = json.load(open(f"{out}/eval/{src}_s{s}/summary.json"))
        line = (f"| {src} | {s} | {rows} | {e['pass_at_k']['1']:.3f} ± {1.96 * e['pass_at_1_stderr']:.3f} | "
                f"{e['pass_at_k']['16']:.3f} | {e['format_rate']:.3f} | {100 * e['mistakes']['slip']:.1f} % | "
                f"{100 * e['arithmetic']['false_claims']:.1f} % |")
        p = f"{out}/eval{long}/{src}_s{s}/summary.json"
        if os.path.exists(p):
            e = json.load(open(p))
            line += f" {e['pass_at_k']['1']:.3f} ± {1.96 * e['pass_at_1_stderr']:.3f}, {e['format_rate']:.3f} |"
        print(line)
EOF
