"""Paper 001's questions on the 3to4 lane (docs/studies/four_numbers.md): RLOO from the lane's SFT
model with the lane's own flags (LANE/rloo/args.json, as `NUMBERS=3to4 ./run_cpu.sh` ran it), one
thing changed per variant:
  none     the lane's distribution, no curriculum (the control)
  tiers    paper 001's Algorithm 1 (--curriculum tiers): 3 target bins per operand count, 3-number
           tiers first; τ 0.35 over W 5 steps (001 gives neither; the default τ 0.6 is above anything the
           lane's SFT model solves, so the first tier would never unlock)
  three    RL on the training split's 3-number problems only (a file of them), tested on the mix
each at seeds 0 and 1, two runs side by side on a thread each. Then each run's val evaluation (all
200 val problems x 16: choosing) and test evaluation (400 x 16, both counts: the table). A finished
run or evaluation is skipped, so a killed study goes on from its unfinished runs (each from its start).

  python benchmarks/four_numbers.py [LANE]           # default out/cpu_3to4; writes LANE/study/
  python benchmarks/four_numbers.py LANE --table     # the table of what has finished, and each variant
                                                     # against none, paired by problem
"""
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rloo  # noqa: E402
from plumbing.tasks import load_tasks, read_jsonl, write_jsonl  # noqa: E402

VARIANTS = {"none": {}, "tiers": {"curriculum": "tiers", "curriculum_bins": 3, "curriculum_threshold": 0.35,
                                  "curriculum_window": 5},
            "three": {"data": "train_3.jsonl"}}  # a file in the study's folder
SEEDS = (0, 1)


def flags(args, **override):
    """rloo.py's command line for an args.json (its Args fields), with `override` applied."""
    out = []
    for f in dataclasses.fields(rloo.Args):
        v = override.get(f.name, args.get(f.name, f.default))
        if f.name in ("resume", "overwrite") or v == "" and f.default == "":
            continue
        out += ([f"--{f.name}" if v else f"--no-{f.name}"] if isinstance(v, bool) else [f"--{f.name}", str(v)])
    return out + ["--overwrite"]


def commands(lane, study, args, tag, name, seed):
    """A run's commands: training, then its val and test evaluations."""
    out, change = os.path.join(study, tag), dict(VARIANTS[name])
    if "data" in change:
        change["data"] = os.path.join(study, change["data"])
    train = [sys.executable, "rloo.py", *flags(args, output_dir=out, seed=seed, init=os.path.join(lane, "sft"),
                                             **change)]
    spec = dict(kv.split("=") for kv in args["eval_data"].split(":", 1)[1].split(","))  # gen:nums=3-4,...,test=400
    evals = [[sys.executable, "evaluate.py", "--model", out, "--data", args["eval_data"], "--split", split,
              "--template", args["template"], "--num_problems", spec[split], "--max_new_tokens",
              str(args["max_response_len"]), "--out", os.path.join(study, "eval", split, tag)]
             for split in ("val", "test")]
    return out, train, evals


def work(lane, study, args, tag, name, seed):
    """Run one variant's training and evaluations (those not finished), logged to study/logs/TAG.log."""
    out, train, evals = commands(lane, study, args, tag, name, seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    steps = [(train, os.path.join(out, "wall_seconds"))] + [(e, os.path.join(e[-1], "summary.json")) for e in evals]
    cmd = " && ".join(shlex.join(c) + (f" && echo $((SECONDS - s)) > {shlex.quote(done)}" if c is train else "")
                      for c, done in steps if not os.path.isfile(done))
    if not cmd:
        return None
    print(f"+ {tag}: " + cmd, flush=True)
    log = open(os.path.join(study, "logs", f"{tag}.log"), "a")
    return subprocess.Popen(["bash", "-c", "s=$SECONDS; " + cmd], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def last(path, key):
    """The last value of `key` in a metrics.jsonl, or None."""
    rows = [r for r in read_jsonl(path) if key in r] if os.path.isfile(path) else []
    return rows[-1][key] if rows else None


def table(study):
    """The study's rows: val (choosing) and test pass@1/pass@16, all and by operand count."""
    print("| variant | seed | tier reached | val pass@1 | test pass@1 all / 3 / 4 | test pass@16 all / 3 / 4 |"
          " 4-number mistakes (test) |")
    print("|---|---|---|---|---|---|---|")
    for name in VARIANTS:
        for seed in SEEDS:
            tag = f"{name}_s{seed}"
            val, test = (os.path.join(study, "eval", s, tag, "summary.json") for s in ("val", "test"))
            if not (os.path.isfile(val) and os.path.isfile(test)):
                continue
            val, test = json.load(open(val)), json.load(open(test))
            cols = [" / ".join(f"{p[k]:.3f}" for p in [test["pass_at_k"]] +
                               [test["by_size"][c]["pass_at_k"] for c in "34"]) for k in ("1", "16")]
            level = last(os.path.join(study, tag, "metrics.jsonl"), "train/curriculum_level")
            mistakes = ", ".join(f"{k} {v:.2f}" for k, v in test["by_size"]["4"]["mistakes"].items())
            print(f"| {name} | {seed} | {'-' if level is None else int(level)} | {val['pass_at_k']['1']:.3f} | "
                  f"{cols[0]} | {cols[1]} | {mistakes} |")


def solved(study, split, name):
    """{(nums, target): the problem's share of right samples over the variant's seeds}, or None."""
    paths = [os.path.join(study, "eval", split, f"{name}_s{seed}", "samples.jsonl") for seed in SEEDS]
    if not all(os.path.isfile(p) for p in paths):
        return None
    rows = [r for p in paths for r in read_jsonl(p)]
    out = {}
    for r in rows:
        out.setdefault((tuple(r["nums"]), r["target"]), []).extend(s == 1.0 for s in r["scores"])
    return {k: sum(v) / len(v) for k, v in out.items()}


def decision(study):
    """Each variant against `none`, paired by problem (seeds pooled): the pass@1 difference and its
    95 % interval over the problems, on val (where a setting is chosen) and test (the table)."""
    for split in ("val", "test"):
        base = solved(study, split, "none")
        for name in [v for v in VARIANTS if v != "none"]:
            other = solved(study, split, name)
            if base is None or other is None:
                continue
            d = [other[k] - base[k] for k in base]
            mean = sum(d) / len(d)
            se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
            print(f"{split}: {name} - none, pass@1 over {len(d)} problems and {len(SEEDS)} seeds: "
                  f"{mean:+.3f} ± {1.96 * se:.3f} (95 %)")


def main():
    lane = next((a for a in sys.argv[1:] if not a.startswith("--")), "out/cpu_3to4")
    study = os.path.join(lane, "study")
    if "--table" in sys.argv:
        return table(study), decision(study)
    args = json.load(open(os.path.join(lane, "rloo", "args.json")))
    os.makedirs(os.path.join(study, "logs"), exist_ok=True)
    three = os.path.join(study, "train_3.jsonl")  # the training split's 3-number problems, in its order
    if not os.path.isfile(three):
        write_jsonl(three, [t for t in load_tasks(args["data"], "train") if len(t["nums"]) == 3])
    runs = [(f"{name}_s{seed}", name, seed) for seed in SEEDS for name in VARIANTS]
    start = time.time()
    for i in range(0, len(runs), 2):  # two at a time: a thread each on 2 cores
        procs = [(tag, work(lane, study, args, tag, name, seed)) for tag, name, seed in runs[i:i + 2]]
        for tag, p in procs:
            if p is not None and p.wait():
                sys.exit(f"error: {tag} failed, see {study}/logs/{tag}.log")
        print(f"-- {', '.join(t for t, _ in procs)} done, {time.time() - start:.0f} s", flush=True)
    table(study), decision(study)


if __name__ == "__main__":
    main()
