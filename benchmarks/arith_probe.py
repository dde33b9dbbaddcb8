"""Greedy arithmetic of a checkpoint on fresh text, the base stage's own yardstick: a base model
writes no answers, so evaluate.py cannot measure it. The model reads 400 rows of fresh arithmetic
(traces.arith_text, the base stage's format: 4 random paths over random numbers a row), and a step
`a op b = v` (`3+5=8`) counts as right when every token of v is the model's argmax given the text before it
(teacher-forced). Wrong steps for 3- and for 4-number paths, overall and by operator: the 3-number
base against 4-number paths is why the 3to4 lane has a base of its own (docs/studies/four_numbers.md).

  python benchmarks/arith_probe.py pretrained/tiny-base pretrained/tiny-base-3to4 [--range 1-20]
"""
import argparse
import os
import random
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.models import load_model  # noqa: E402
from plumbing.traces import arith_text  # noqa: E402


def step_errors(model, tok, texts, batch=50):
    """{op: (wrong, steps)} over the `a op b = v` steps of `texts`."""
    out = {}
    for b in range(0, len(texts), batch):
        enc = tok(texts[b:b + batch], add_special_tokens=False, return_offsets_mapping=True, padding=True,
                  return_tensors="pt")
        with torch.no_grad():
            pred = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.argmax(-1)
        right = pred[:, :-1] == enc["input_ids"][:, 1:]  # (B, T-1): token k+1 predicted at k
        for j, text in enumerate(texts[b:b + batch]):
            spans = enc["offset_mapping"][j].tolist()
            for m in re.finditer(r"\d+ ?([-+*/]) ?\d+ ?= ?(\d+)", text):  # a op b = v (' ' optional)
                ks = [k for k, (s, e) in enumerate(spans) if e > s and s < m.end(2) and e > m.start(2)]
                wrong, n = out.get(m.group(1), (0, 0))
                out[m.group(1)] = (wrong + (not all(right[j, k - 1] for k in ks)), n + 1)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--range", default="1-20", help="the numbers' range")
    p.add_argument("--rows", type=int, default=400)
    args = p.parse_args()
    lo, hi = map(int, args.range.split("-"))
    for path in args.models:
        model, tok = load_model(path)
        model.eval()
        for n in (3, 4):
            rng = random.Random(12345)  # the same text for every model
            nums = [[rng.randint(lo, hi) for _ in range(n)] for _ in range(4 * args.rows)]
            texts = [arith_text(nums[i:i + 4], rng) for i in range(0, len(nums), 4)]
            ops = step_errors(model, tok, texts)
            wrong, steps = sum(w for w, _ in ops.values()), sum(s for _, s in ops.values())
            print(f"{path}: {n} numbers: step error {wrong / steps:.3f} of {steps} steps | "
                  + " ".join(f"{op} {w / s:.3f}" for op, (w, s) in sorted(ops.items())))


if __name__ == "__main__":
    main()
