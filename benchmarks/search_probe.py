"""Does a model search, or aim? Its tries in an evaluation's samples beside a random searcher's.

Reads the `samples.jsonl` that evaluate.py writes and splits each completion into its tries
(`... = v. Target T, found/back.`). It reports tries per sample, repeated tries, the hit rate per
try and on the first try. It also reports the share of tries whose first step is the first step of
some solution ("aimed"), with the hit rate of those and of the others. The same numbers for random
legal paths (traces.random_path) over the same problems are the yardstick. A model whose aimed
share is no higher than a random path's picks its first step at random (docs/studies/arithmetic.md).

  python benchmarks/search_probe.py out/cpu/eval/sft out/cpu/eval/rloo
"""
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.traces import _STEP, _solutions, _steps_text, random_path  # noqa: E402  _STEP: a step as written

# a try: its steps (a line each) up to its verdict
TRY = re.compile(r"((?:[^\n]*\n)*?[^\n]*) Target (\d+), (?:found|back)\.")


def first_step(text):
    """'9*2=18, left ...' -> ('2', '*', '9', '18'): operands sorted for + and *, so order does
    not count."""
    m = _STEP.match(text.strip())
    if not m:
        return None
    a, op, b, v = m.groups()
    return (*sorted((a, b), key=int), op, v) if op in "+*" else (a, b, op, v)


def try_stats(problems):
    """problems: [(nums, target, [tries as text])] -> a dict of rates."""
    n = tries = hits = first_hits = repeats = aimed = aimed_hits = 0
    for nums, target, samples in problems:
        openers = {first_step(_steps_text(path)) for _, path in _solutions(tuple(nums), target)}
        for sample in samples:
            n, seen = n + 1, set()
            for k, text in enumerate(sample):
                values = re.findall(r"= ?(\d+)", text)
                hit = bool(values) and int(values[-1]) == target
                on_path = first_step(text) in openers - {None}
                tries, hits, first_hits = tries + 1, hits + hit, first_hits + (hit and k == 0)
                repeats, aimed, aimed_hits = repeats + (text in seen), aimed + on_path, aimed_hits + (hit and on_path)
                seen.add(text)
    return {"tries/sample": tries / max(n, 1), "repeated": repeats / max(tries, 1), "hit/try": hits / max(tries, 1),
            "hit/first try": first_hits / max(n, 1), "aimed": aimed / max(tries, 1),
            "hit/aimed try": aimed_hits / max(aimed, 1), "hit/other try": (hits - aimed_hits) / max(tries - aimed, 1)}


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rows, records = [], []
    for d in sys.argv[1:]:
        path = os.path.join(d, "samples.jsonl")
        if not os.path.isfile(path):
            sys.exit(f"error: no {path} (write one with evaluate.py --out {d})")
        with open(path) as f:
            records = [json.loads(line) for line in f]
        rows.append((d, try_stats([(r["nums"], r["target"], [[m.group(0) for m in TRY.finditer(c)]
                                                             for c in r["completions"]]) for r in records])))
    rng = random.Random(0)  # the random searcher: one legal path a try, 16 tries per problem
    rows.append(("random legal path", try_stats([(r["nums"], r["target"], [[_steps_text(random_path(r["nums"], rng)[1])]
                                                                          for _ in range(16)]) for r in records])))
    print(f"{'':40s}" + "".join(f"{k:>15s}" for k in rows[0][1]))
    for name, stats in rows:
        print(f"{name[-40:]:40s}" + "".join(f"{v:15.3f}" for v in stats.values()))


if __name__ == "__main__":
    main()
