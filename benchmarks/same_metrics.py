"""Did a refactor change what the scripts compute? Run every training script for 3 steps with a
fixed seed, in this working tree and in a git revision of it, on the same CPU and init, and compare
their metrics.jsonl line by line: the same keys and the same values, `wall` and `time/*` aside. Exit
1 on any difference. (A stored golden file would not do: fp32 kernels round differently from one CPU
to another.)

    python benchmarks/same_metrics.py --base 5a2e3f2 [--init out/cpu/sft] [--keep DIR] [--rel 1e-3]
 --init: the policy every script but sft starts from (default: a 3-step SFT of the tiny model,
trained by the base tree). A trained SFT model gives rewards that vary within groups, so the RL
losses are not 0.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = "gen:nums=3,range=1-20,test=20,val=8"
SHARED = ["--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "4", "--eval_samples", "2",
          "--eval_max_new_tokens", "32", "--eval_every", "3", "--save_every", "3", "--seed", "1"]
RL = ["--batch_size", "4", "--group_size", "4", "--micro_batch", "6", "--max_response_len", "64", "--max_steps", "3",
      "--lr", "1e-4", "--temperature", "0.7"]


def commands(init):
    """Script -> its arguments (after SHARED and --output_dir)."""
    return {
        "sft": ["--init", init, "--batch_size", "8", "--micro_batch", "4", "--max_steps", "3", "--lr", "1e-4"],
        "ipo": ["--init", init, "--num_prompts", "24", "--group_size", "4", "--max_new_tokens", "64", "--batch_size", "4",
                "--micro_batch", "2", "--epochs", "1", "--lr", "1e-5", "--max_response_len", "64"],
        "rloo": ["--init", init, *RL, "--wrong_reward", "-0.5"],
        "grpo": ["--init", init, *RL, "--beta", "0.04", "--num_iterations", "2"],
        "opd": ["--init", init, "--teacher", init, *RL, "--rl_coef", "0.5"],
        "rlt": ["--init", init, "--student", init, *RL[:-2], "--export", "TRACES", "--export_problems", "4"],
    }


def init_flag(tree):
    """sft.py's flag for its starting model in `tree`: --init, or --model before the Args base
    classes."""
    return "--model" if "    model: str" in open(os.path.join(tree, "sft.py")).read() else "--init"


def run(tree, out, init, scripts):
    """{script: [rows of metrics.jsonl]} of `scripts` run in `tree`, writing under `out`."""
    env = {**os.environ, "PYTHONPATH": tree, "TQDM_DISABLE": "1"}
    rows = {}
    for script, args in commands(init).items():
        if script not in scripts:
            continue
        d = os.path.join(out, script)
        args = [a.replace("TRACES", os.path.join(d, "traces.jsonl")) for a in args]
        if script == "sft":
            args = [init_flag(tree) if a == "--init" else a for a in args]
        r = subprocess.run([sys.executable, f"{script}.py", *SHARED, "--output_dir", d, *args], cwd=tree, env=env,
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{script} failed in {tree}:\n{r.stderr[-2000:]}")
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rows[script] = [json.loads(line) for line in f if line.strip()]
        if script == "ipo":  # ipo's 3 steps need 12 pairs at batch 4; it logs however many it made
            rows[script] = [x for x in rows[script] if x["step"] <= 3]
    return rows


def same(x, y, rel):
    return x == y or (rel > 0 and isinstance(x, float) and isinstance(y, float)
                      and abs(x - y) <= rel * max(abs(x), abs(y)))


def compare(a, b, rel=0.0, new_keys=(), renamed=None):
    """Lines naming every difference between two runs' metrics (empty: identical; with `rel`, values
    that far apart, relatively, count as the same; `new_keys`: metrics only the working tree logs;
    `renamed`: base name -> its name here, the values compared)."""
    renamed = renamed or {}
    a = {s: [{renamed.get(k, k): v for k, v in r.items()} for r in rows] for s, rows in a.items()}
    b = {s: [{k: v for k, v in r.items() if k not in new_keys} for r in rows] for s, rows in b.items()}
    diffs = []
    for script in a:
        if [r["step"] for r in a[script]] != [r["step"] for r in b[script]]:
            diffs.append(f"{script}: steps {[r['step'] for r in a[script]]} vs {[r['step'] for r in b[script]]}")
            continue
        for ra, rb in zip(a[script], b[script]):
            ka = {k for k in ra if k != "wall" and not k.startswith("time/")}
            kb = {k for k in rb if k != "wall" and not k.startswith("time/")}
            if ka != kb:
                diffs.append(f"{script} step {ra['step']}: keys only in base {sorted(ka - kb)}, only here {sorted(kb - ka)}")
            diffs += [f"{script} step {ra['step']}: {k} {ra[k]!r} (base) vs {rb[k]!r}" for k in sorted(ka & kb)
                      if not same(ra[k], rb[k], rel)]
    return diffs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    p.add_argument("--init", default="", help="policy checkpoint for every script but sft (default: a 3-step tiny SFT)")
    p.add_argument("--keep", default="", help="write the runs here instead of a temporary dir")
    p.add_argument("--scripts", default="sft,ipo,rloo,grpo,opd,rlt", help="which scripts, comma-separated")
    p.add_argument("--rel", type=float, default=0.0, help="relative difference still the same (a change of "
                                                          "float rounding, e.g. another forward)")
    p.add_argument("--new_keys", default="", help="metrics the working tree adds, comma-separated: listed, "
                                                  "not a difference")
    p.add_argument("--renamed", default="", help="OLD=NEW,...: a metric the working tree renamed (values "
                                                 "compared)")
    a = p.parse_args()
    work = a.keep or tempfile.mkdtemp(prefix="same_metrics-")
    base = os.path.join(work, "tree")
    os.makedirs(base, exist_ok=True)
    subprocess.run(f"git archive {a.base} | tar -x -C {base}", shell=True, cwd=ROOT, check=True)
    init = os.path.abspath(a.init) if a.init else os.path.join(work, "init")
    # the tiny model after 3 SFT steps, made by the base tree: the same init for both
    if not a.init:
        subprocess.run([sys.executable, "sft.py", *SHARED, init_flag(base), "tiny", "--max_steps", "3", "--output_dir", init],
                       cwd=base, env={**os.environ, "PYTHONPATH": base}, check=True, capture_output=True)
    scripts = a.scripts.split(",")
    before = run(base, os.path.join(work, "base"), init, scripts)
    after = run(ROOT, os.path.join(work, "here"), init, scripts)
    new_keys = [k for k in a.new_keys.split(",") if k]
    renamed = dict(x.split("=", 1) for x in a.renamed.split(",") if x)
    diffs = compare(before, after, a.rel, new_keys, renamed)
    for k in new_keys:
        print(f"{k}: only here, in {[s for s in after if any(k in r for r in after[s])]}")
    for script in before:
        n = sum(len(r) for r in before[script])
        print(f"{script}: {len(before[script])} lines, {n} values: {'identical' if not any(d.startswith(script + ' ') or d.startswith(script + ':') for d in diffs) else 'DIFFERENT'}")
    print("\n".join(diffs) or f"identical to {a.base} (time/* and wall aside)")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
