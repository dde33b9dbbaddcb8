"""One SFT step of run_cpu.sh's `sft` stage (64 traces: random tries and working backward, a dead
end on average, micro-batches of 16) under each way of running the training forward, timed in
interleaved rounds so that the machine's drift hits every variant alike (docs/studies/performance.md,
"Training forwards"):
  mask      the attention mask as pack() builds it (what token_stats passed before causal_only)
  causal    the causal mask alone (logprobs.causal_only: today's default)
  sdpa      the same through the fused attention kernel instead of the eager one
  compile   causal, with the decoder torch.compile'd as --compile does (its compile is not timed)
bf16 autocast where the CPU has native bf16 (as training runs), else fp32; COUNTDOWN_CPU_BF16=0
forces fp32.
    python benchmarks/sft_step.py --init out/cpu/sft
"""
import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import logprobs  # noqa: E402
from common import autocast, trains_in_bf16  # noqa: E402
from models import load_model  # noqa: E402
from sft import micro_batches, sft_data, sft_loss  # noqa: E402
from traces import parse_mix  # noqa: E402

DATA = "gen:nums=3,range=1-20,test=200,val=100"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", default="out/cpu/sft")
    p.add_argument("--rounds", type=int, default=5, help="rounds of 5 steps per variant")
    args = p.parse_args()
    model, tok = load_model(args.init)
    model.train()
    prompts, write = sft_data(DATA, "train", 64 * 5 * args.rounds + 64, "compact", 100,
                              dead_ends=1.0, near_misses=0.5,
                              mix=parse_mix("random:0.7,backward:0.3"))
    responses = write(random.Random(0))
    compiled = torch.compile(model.get_decoder(), dynamic=True)
    decoder = model.get_decoder()

    def step(k, variant):
        idx = range(64 * k, 64 * k + 64)
        mbs = list(micro_batches(tok, [prompts[i] for i in idx], [responses[i] for i in idx], 16,
                                 512, 1024, "cpu"))
        n = sum(int(m[:, 1:].sum()) for _, _, m in mbs)
        for ids, attn, mask in mbs:
            with autocast("cpu", model):
                if variant == "sdpa":  # autocast switched to eager attention: switch back inside
                    model.set_attn_implementation("sdpa")
                (sft_loss(logprobs.token_stats(model, ids, attn, mask)["logp"], mask[:, 1:])
                 / n).backward()
        model.zero_grad(set_to_none=True)

    variants = ["mask", "causal", "sdpa", "compile"]
    causal_only = logprobs.causal_only
    times = {v: [] for v in variants}
    for r in range(args.rounds + 1):  # round 0 warms up (and compiles): not counted
        for v in variants:
            logprobs.causal_only = (lambda a: a) if v == "mask" else causal_only
            model.get_decoder = (lambda: compiled) if v == "compile" else (lambda: decoder)
            t0 = time.perf_counter()
            for k in range(5 * r, 5 * r + 5):
                step(k % (5 * args.rounds + 1), v)
            if r:
                times[v].append((time.perf_counter() - t0) / 5)
    print(f"{torch.get_num_threads()} threads, training forward in "
          f"{'bf16 autocast' if trains_in_bf16('cpu') else 'fp32'}")
    for v in variants:
        print(f"{v:8s} {statistics.median(times[v]):.3f} s / step (rounds: "
              f"{', '.join(f'{t:.3f}' for t in times[v])})")


if __name__ == "__main__":
    main()
