"""The HF sampler's decode loops side by side: common.py's plain loop over transformers' cache and
plumbing/fast_decode.py's twin, tokens/s of one generate call each, alternating A/B/A/B so that background
load hits both alike; the tokens must be the same. (docs/one_step.md)

    python benchmarks/decode_speed.py [--init out/cpu/sft] [--decodes plain,dynamic] [--rounds 2]
Shapes: the RL scripts' (64 prompts x 8, T 0.7) and evaluate.py's (200 x 16, T 0.6, top-p 0.95,
top-k 20), 160 new tokens each, as run_cpu.sh samples."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.tasks import load_tasks, make_prompt  # noqa: E402
from plumbing.models import load_model  # noqa: E402
from common import HFSampler  # noqa: E402

SHAPES = {"rl": dict(split="train", problems=64, n=8, temperature=0.7, top_p=1.0, top_k=0),
          "eval": dict(split="test", problems=200, n=16, temperature=0.6, top_p=0.95, top_k=20)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", default="out/cpu/sft")
    p.add_argument("--decodes", default="plain,dynamic")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max_new_tokens", type=int, default=160)
    args = p.parse_args()
    model, tok = load_model(args.init)
    decodes = args.decodes.split(",")
    for name, s in SHAPES.items():
        tasks = load_tasks("gen:nums=3-4,range=1-99,target=10-100", s["split"], s["problems"])
        prompts = [make_prompt(t["nums"], t["target"], "compact") for t in tasks]
        secs, toks, outs = {d: 0.0 for d in decodes}, {d: 0 for d in decodes}, {}
        for _ in range(args.rounds):
            for d in decodes:
                start = time.perf_counter()
                ro = HFSampler(model, tok, decode=d).generate(
                    prompts, s["n"], s["temperature"], s["top_p"], s["top_k"], args.max_new_tokens, seed=0)
                secs[d] += time.perf_counter() - start
                toks[d] += sum(map(len, ro.completion_ids))
                outs[d] = ro.completion_ids
        same = all(outs[d] == outs[decodes[0]] for d in decodes)
        print(f"{name}: " + " | ".join(f"{d} {toks[d] / secs[d]:,.0f} tokens/s ({secs[d] / args.rounds:.1f} s a call)"
                                       for d in decodes) + f" | same tokens: {same}")


if __name__ == "__main__":
    main()
