"""Paired difference of pass@1 between two evaluations of the same problems (evaluate.py --out dirs).

Two models' pass@1 on 100 val problems each carry a ±0.06-0.07 interval, mostly the problems' spread
in difficulty, which both models share. Their per-problem difference cancels it: what is left is
sampling noise (shrinks with --num_samples) and where the two models really differ.
    python benchmarks/paired.py A_DIR B_DIR [C_DIR ...]     B - A, C - A, ... with 95 % intervals
"""
import json
import sys


def pass1(path):
    """{(nums, target): fraction of samples correct} from an evaluate.py --out dir's samples.jsonl."""
    out = {}
    with open(f"{path}/samples.jsonl") as f:
        for line in f:
            r = json.loads(line)
            out[(tuple(r["nums"]), r["target"])] = sum(s == 1.0 for s in r["scores"]) / len(r["scores"])
    return out


def paired(a, b):
    """(mean of b - a over the shared problems, 95 % half-width, number of problems)."""
    keys = sorted(a.keys() & b.keys())
    if len(keys) < 2:
        raise SystemExit(f"error: the two evaluations share {len(keys)} problems; need the same --data/--split")
    d = [b[k] - a[k] for k in keys]
    m = sum(d) / len(d)
    var = sum((x - m) ** 2 for x in d) / (len(d) - 1)
    return m, 1.96 * (var / len(d)) ** 0.5, len(keys)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    base = pass1(sys.argv[1])
    print(f"| against {sys.argv[1]} ({sum(base.values()) / len(base):.3f}) | pass@1 | difference ± 95 % "
          f"(paired) | problems |\n|---|---|---|---|")
    for path in sys.argv[2:]:
        other = pass1(path)
        m, hw, n = paired(base, other)
        print(f"| {path} | {sum(other.values()) / len(other):.3f} | {m:+.3f} ± {hw:.3f} | {n} |")
