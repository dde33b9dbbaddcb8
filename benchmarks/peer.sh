#!/usr/bin/env bash
# The peer side by side (docs/studies/performance.md, The peer): TRL's trainer (benchmarks/trl_peer.py) and ours
# (grpo.py, rloo.py) on one checkpoint, the run_cpu.sh stage's recipe, one after the other on this machine, alone.
#   benchmarks/peer.sh INIT OUT STEPS PRECISION ALGO...    e.g. benchmarks/peer.sh out/cpu/sft out/peer 10 fp32 grpo rloo
# PRECISION fp32 or bf16 (both sides: TRL's bf16=True, ours COUNTDOWN_CPU_BF16=1). Each run's directory
# OUT/SIDE_ALGO_PRECISION gets its metrics.jsonl and, from /usr/bin/time -v, time.txt (peak resident memory).
# Needs the [trl] extra. The seconds a step: the median of time/step after the first (both sides log it).
set -euo pipefail
cd "$(dirname "$0")/.."
INIT=$1 OUT=$2 STEPS=$3 PRECISION=$4; shift 4
# the venv's python if there is one and none is active (as run_cpu.sh), else python on the PATH
PY=${PYTHON:-$(if [[ -z ${VIRTUAL_ENV:-} && -x .venv/bin/python ]]; then echo .venv/bin/python; else echo python; fi)}
DATA="gen:nums=3,range=1-20,test=200,val=100"
bf16=$([[ $PRECISION == bf16 ]] && echo 1 || echo 0)
rows=$([[ $bf16 == 1 ]] && echo 32 || echo 16)  # run_cpu.sh's --forward_rows for the path
# run_cpu.sh's COMMON and RL arrays; the evaluations (at the start and the end only) cut to 8 x 2: TRL's run has none
ours=(--init "$INIT" --data "$DATA" --eval_data "$DATA" --template compact --eval_problems 8 --eval_samples 2
      --eval_max_new_tokens 160 --lr 6.7e-5 --temperature 0.7 --batch_size 32 --micro_batch 128 --forward_rows "$rows"
      --max_response_len 160 --max_steps "$STEPS" --eval_every 0 --save_every 1000 --wrong_reward 0 --no_answer_reward 0
      --overwrite)
for algo in "$@"; do
  case $algo in
    grpo) own=(--group_size 8 --beta 0.04);;
    rloo) own=(--pg_norm mean);;
    *) echo "error: ALGO is grpo or rloo, not $algo" >&2; exit 2;;
  esac
  d=$OUT/trl_${algo}_$PRECISION
  mkdir -p "$d"
  echo "+ python benchmarks/trl_peer.py $algo --init $INIT --output_dir $d --max_steps $STEPS$([[ $bf16 == 1 ]] && echo " --bf16")"
  /usr/bin/time -v -o "$d.time.txt" "$PY" benchmarks/trl_peer.py "$algo" --init "$INIT" --output_dir "$d" \
    --max_steps "$STEPS" $([[ $bf16 == 1 ]] && echo --bf16) > "$d.log" 2>&1
  d=$OUT/ours_${algo}_$PRECISION
  echo "+ COUNTDOWN_CPU_BF16=$bf16 python $algo.py ${ours[*]} ${own[*]} --output_dir $d"
  COUNTDOWN_CPU_BF16=$bf16 /usr/bin/time -v -o "$d.time.txt" "$PY" "$algo.py" "${ours[@]}" "${own[@]}" \
    --output_dir "$d" > "$d.log" 2>&1
done
"$PY" - "$OUT" <<'EOF'
import glob, json, os, re, statistics, sys
for d in sorted(glob.glob(os.path.join(sys.argv[1], "*_*_*"))):
    if not os.path.isdir(d):
        continue
    rows = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
    steps = [r for r in rows if "time/step" in r][1:]  # after the first step
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(d + ".time.txt").read())
    med = lambda k: statistics.median(r[k] for r in steps)  # noqa: E731
    print(f"{os.path.basename(d):20s} s/step {med('time/step'):6.2f} sample {med('time/sample'):6.2f} "
          f"update {med('time/step') - med('time/sample'):6.2f} peak {int(peak.group(1)) / 2**20:5.2f} GB "
          f"reward {[round(r.get('train/reward') or 0, 3) for r in rows if 'time/step' in r]}")
EOF
