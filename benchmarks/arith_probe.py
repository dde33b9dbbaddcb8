"""Greedy arithmetic of a checkpoint on held-out text, the base stage's own yardstick
(docs/studies/arithmetic.md).
 A base model writes no answers, so evaluate.py's sampled diagnostics cannot measure it. Here the
model reads fresh arithmetic (traces.arith_text over random numbers of the task's range, the base
stage's format) and a step `a op b = v` counts as right when every token of v is the model's argmax
given the text before it. Wrong steps, overall and by operator.

  python benchmarks/arith_probe.py out/cpu/base
  python benchmarks/arith_probe.py out/cpu/sft --rows 400 --range 1-20 --nums 3
"""
import argparse
import os
import random
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from logprobs import token_stats, tokenize_pairs  # noqa: E402
from models import load_model  # noqa: E402
from traces import arith_text  # noqa: E402


def probe(model, tok, texts):
    """(wrong steps, steps) and the same by operator, teacher-forced, greedy."""
    ids, attn, mask = tokenize_pairs(tok, [""] * len(texts), texts, 0, 10**6)
    with torch.no_grad():
        correct = token_stats(model, ids, attn, mask)["correct"]                          # (B, T-1)
    wrong, total = {op: 0 for op in "+-*/"}, {op: 0 for op in "+-*/"}
    for b, text in enumerate(texts):
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for m in re.finditer(r"\d+ ([-+*/]) \d+ = (\d+)", text):
            # tokens overlapping v; token k is predicted at position k - 1 of `correct`
            ks = [k for k, (s, e) in enumerate(offsets) if s < m.end(2) and e > m.start(2)]
            total[m.group(1)] += 1
            wrong[m.group(1)] += not all(correct[b, k - 1] for k in ks)
    return wrong, total


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--range", default="1-20", help="the numbers' range")
    p.add_argument("--nums", type=int, default=3, help="numbers per path")
    p.add_argument("--rows", type=int, default=200, help="rows of 4 paths each")
    args = p.parse_args()
    model, tok = load_model(args.model)
    rng, (lo, hi) = random.Random(12345), map(int, args.range.split("-"))
    nums = [[rng.randint(lo, hi) for _ in range(args.nums)] for _ in range(4 * args.rows)]
    texts = [arith_text(nums[i:i + 4], rng) for i in range(0, len(nums), 4)]
    wrong, total = probe(model.eval(), tok, texts)
    by_op = " ".join(f"{op} {wrong[op] / max(total[op], 1):.3f}" for op in total)
    print(f"{args.model}: greedy step error {sum(wrong.values()) / sum(total.values()):.3f} of "
          f"{sum(total.values())} steps ({by_op})")


if __name__ == "__main__":
    main()
