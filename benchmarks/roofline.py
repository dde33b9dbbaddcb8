"""Roofline of the embedded setting on this CPU: tokens/s of training (an SFT step, an RL update) and
of sampling (RL rollouts 64 x 8 at T 0.7 and the 200 x 16 evaluation, 160 new tokens), the FLOP/s
they imply, and their share of the cores' peak, measured with a 2048^3 matmul in the same precision.
Training runs in fp32 and, forced on with COUNTDOWN_CPU_BF16 (slow where the CPU lacks native bf16),
in bf16 autocast as the scripts do, and the SFT step again with --compile; sampling in fp32, with
today's HFSampler and the one it replaced.
    python benchmarks/roofline.py --init out/cpu/sft
FLOPs per token: 2 per weight of every linear layer and the tied lm_head (forward), plus attention's
4 · layers · context · hidden; training counts 3x the forward (forward and backward)."""
import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sampler_speed import OldHFSampler  # noqa: E402

from common import autocast  # noqa: E402
from data import load_tasks, make_prompt  # noqa: E402
from logprobs import token_stats, tokenize_pairs  # noqa: E402
from models import load_model  # noqa: E402
from sampler import HFSampler, micro_batches  # noqa: E402
from traces import make_trace  # noqa: E402

DATA = "gen:nums=3,range=1-20,test=200,val=100"


def peak(dtype, n=2048, reps=5):
    """GFLOP/s of an n^3 matmul, the best of `reps`."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(times) / 1e9


def flops_per_token(model, context):
    """Forward FLOPs of one token at a mean attention context of `context` tokens."""
    cfg = model.config
    # every projection and the lm_head (a Linear even when tied to the embedding)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attention = 4 * cfg.num_hidden_layers * context * cfg.num_attention_heads * head_dim
    return 2 * linear + attention


def timed(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sft_step(model, opt, tok, tasks, device, micro=16):
    """One SFT step as sft.py takes it: 64 traces (run_cpu.sh's flags), micro-batches of 16; returns
    the tokens it processed (prompts included) as a closure's side result."""
    rng = random.Random(0)
    prompts = [make_prompt(t["nums"], t["target"], "compact") for t in tasks]
    traces = [make_trace(t["nums"], t["target"], rng, 1.0, 0.5) for t in tasks]
    ids, attn, mask = tokenize_pairs(tok, prompts, traces, 512, 160)

    def step():
        for s in range(0, len(ids), micro):
            c = slice(s, s + micro)
            with autocast(device, model):
                st = token_stats(model, ids[c], attn[c], mask[c])
            m = mask[c, 1:].float()
            (-(st["logp"] * m).sum() / mask[:, 1:].sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, int(attn.sum())


def rl_update(model, tok, ro, device, micro=64):
    """The log-prob forward and backward of an RL update (rloo.py's), over rollouts `ro`."""
    def step():
        for rows, ids, attn, mask, old in micro_batches(ro, micro, tok.pad_token_id, device):
            with autocast(device, model):
                st = token_stats(model, ids, attn, mask, 0.7, entropy=True)
            m = mask[:, 1:].float()
            (-(st["logp"] * m).sum() / 512 - 1e-3 * (st["entropy"] * m).sum() / 512).backward()
        model.zero_grad(set_to_none=True)
    tokens = sum(len(ro.prompt_ids[r // 8]) + len(c) for r, c in enumerate(ro.completion_ids))
    return step, tokens


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", default="out/cpu/sft")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    bf16_cpu = any(getattr(torch.cpu, f, lambda: False)() for f in
                   ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"avx512_bf16/amx: {bf16_cpu}")
    peaks = {"fp32": peak(torch.float32), "bf16": peak(torch.bfloat16)}
    print(f"peak (2048^3 matmul): fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {peaks['bf16']:.0f}")
    model, tok = load_model(args.init)
    device = "cpu"
    rows = []

    def row(name, precision, tokens, seconds, ctx, factor):
        f = flops_per_token(model, ctx) * factor
        gflops = tokens / seconds * f / 1e9
        rows.append((name, precision, tokens / seconds, gflops, gflops / peaks[precision]))
        print(f"| {name} | {precision} | {tokens / seconds:,.0f} | {gflops:.1f} | "
              f"{100 * gflops / peaks[precision]:.1f}% |", flush=True)

    print("| work | compute | tokens/s | GFLOP/s | share of peak |")
    print("|---|---|---|---|---|")
    tasks = load_tasks(DATA, "train", 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: time the step, keep the weights
    for precision in ("fp32", "bf16"):
        os.environ["COUNTDOWN_CPU_BF16"] = "1" if precision == "bf16" else "0"
        step, tokens = sft_step(model, opt, tok, tasks, device)
        row("SFT step, 64 traces", precision, tokens, timed(step, args.reps), 60, 3)
    os.environ["COUNTDOWN_CPU_BF16"] = "0"
    prompts = [make_prompt(t["nums"], t["target"], "compact") for t in tasks]
    for name, cls in (("before", OldHFSampler), ("now", HFSampler)):
        sampler = cls(model, tok)
        ro = None

        def sample():
            nonlocal ro
            ro = sampler.generate(prompts, 8, 0.7, 1.0, 0, 160, seed=1)
        seconds = timed(sample, args.reps)
        row(f"RL rollouts 64 x 8, T 0.7 ({name})", "fp32", sum(map(len, ro.completion_ids)),
            seconds, 60, 1)
    eval_prompts = [make_prompt(t["nums"], t["target"], "compact")
                    for t in load_tasks(DATA, "test", 200)]
    for name, cls in (("before", OldHFSampler), ("now", HFSampler)):
        sampler = cls(model, tok)
        t0 = time.perf_counter()
        out = sampler.generate(eval_prompts, 16, 0.6, 0.95, 20, 160, seed=1)
        row(f"evaluation 200 x 16, T 0.6 ({name})", "fp32", sum(map(len, out.completion_ids)),
            time.perf_counter() - t0, 60, 1)
    for precision in ("fp32", "bf16"):
        os.environ["COUNTDOWN_CPU_BF16"] = "1" if precision == "bf16" else "0"
        step, tokens = rl_update(model, tok, ro, device)
        row("RL update, 512 rollouts", precision, tokens, timed(step, args.reps), 60, 3)
    # --compile (loop.load_policy): the warm-up call of timed() compiles, the timed ones reuse it
    model.get_decoder().compile(dynamic=True)
    for precision in ("fp32", "bf16"):
        os.environ["COUNTDOWN_CPU_BF16"] = "1" if precision == "bf16" else "0"
        step, tokens = sft_step(model, opt, tok, tasks, device)
        row("SFT step, 64 traces, --compile", precision, tokens, timed(step, args.reps), 60, 3)


if __name__ == "__main__":
    main()
