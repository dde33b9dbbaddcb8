"""HFSampler's tokens/s: today's decode loop against the one it replaced, kept below as the
reference (the transformers forward once per token with a growing DynamicCache). The two alternate
A/B/A/B in one process, so background load hits both alike; each rate is of the summed rounds.

    python benchmarks/sampler_speed.py [--init out/cpu/sft] [--shape rl|eval|both] [--rounds 3]

Shapes: `rl`, 64 prompts x 8 rollouts at T 0.7 (the RL scripts' sampling); `eval`, 200 problems x 16
at T 0.6, top_p 0.95, top_k 20 (evaluate.py's); both with 160 new tokens. `--profile` prints
torch.profiler's op table and cProfile's function table of one run of each implementation instead.
Each runs at its own default batch (the old loop 256 rows, today's 1,024); `--old_batch_size 1024`
gives the old loop the larger batch too.
"""
import argparse
import cProfile
import inspect
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import CountdownError  # noqa: E402
from data import load_tasks, make_prompt  # noqa: E402
from models import load_model  # noqa: E402
from sampler import HFSampler, _filter_logits  # noqa: E402

SHAPES = {"rl": dict(split="train", problems=64, n=8, temperature=0.7, top_p=1.0, top_k=0),
          "eval": dict(split="test", problems=200, n=16, temperature=0.6, top_p=0.95, top_k=20)}


# the loop's sampling as it was (sampler.py's draws the same tokens, faster): the reference times it
def _old_filter_logits(logits, temperature, top_k, top_p, bottom_p=1.0, explore=None):
    """sampler._filter_logits as it was: top-p sorted the whole vocabulary. (N, V) -> (N, V)"""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = torch.full_like(logits, float("-inf")).scatter(
            -1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return _filter_logits(logits, 1.0, 0, 1.0, bottom_p, explore)  # bottom-p: unchanged since


def _old_sample(logits, gen):
    """sampler._sample as it was: the inverse CDF by a comparison and a sum. (N, V) -> (N,)"""
    cdf = logits.softmax(-1).cumsum(-1)  # (N, V)
    u = torch.rand(len(cdf), 1, generator=gen, device=cdf.device) * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp(max=cdf.shape[-1] - 1)  # the first index whose cdf reaches u


def _cache_arg(model):
    """The name under which this transformers takes and returns the KV cache: `cache` since 5.x
    renamed `past_key_values` (gone in 5.40), which 4.x does not know."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's: kwargs
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else \
        "past_key_values"


class OldHFSampler(HFSampler):
    """HFSampler with its decode loop before the rewrite, verbatim: the reference for speed here
    and for the distribution in tests/test_sampler.py."""

    def decode_mode(self):  # its own _batch on any device (a GPU's default is the graph's loop)
        return "dynamic"

    def _batch(self, rows, temperature, top_p, top_k, max_new_tokens, gen, bottom_p, bottom_p_freq):
        eos, dev = self.tok.eos_token_id, self.model.device
        P = max(map(len, rows))
        ids = torch.tensor([[eos] * (P - len(r)) + r for r in rows], device=dev)  # (b, P)
        attn = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        b = len(rows)
        toks = torch.full((b, max_new_tokens), eos, device=dev)  # (b, L)
        lps = torch.zeros(b, max_new_tokens, device=dev)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)
        # which of the b rows the running batch (and its cache) holds
        live = torch.arange(b, device=dev)
        # live rows that have not produced EOS yet
        active = torch.ones(b, dtype=torch.bool, device=dev)
        for t in range(max_new_tokens):
            logits = out.logits[:, -1]  # (live, V)
            # a blown-up model: say so, not a sampling error
            if t == 0 and not torch.isfinite(logits).all():
                raise CountdownError("the model's logits are not finite: its weights have "
                                     "blown up (too large an --lr?)")
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                # which rows cut their head this token (drawn only if bottom-p is on)
                explore = None
                if bottom_p < 1.0:
                    explore = torch.rand(len(logits), generator=gen, device=dev) < bottom_p_freq
                tok = _old_sample(_old_filter_logits(logits, temperature, top_k, top_p, bottom_p,
                                                     explore), gen)
            rows_t = live[active]
            toks[rows_t, t] = tok[active]
            # the trainer's token_stats(temperature=T)
            tempered = logits[active].float() / (temperature or 1.0)
            lps[rows_t, t] = torch.log_softmax(tempered, -1).gather(-1, tok[active, None])[:, 0]
            lengths[rows_t] += 1
            active = active & (tok != eos)
            if not active.any():
                break
            # drop finished rows from the batch and its KV cache
            if active.sum() <= 0.75 * len(live):
                keep = active.nonzero()[:, 0]
                out[_cache_arg(self.model)].batch_select_indices(keep)
                live, tok, attn, pos = live[keep], tok[keep], attn[keep], pos[keep]
                active = active[keep]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            pos = pos[:, -1:] + 1
            name = _cache_arg(self.model)
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                             use_cache=True, **{name: out[name]})
        finished = (toks.gather(1, (lengths - 1)[:, None])[:, 0] == eos).tolist()
        lengths = lengths.tolist()
        return ([x[:k] for x, k in zip(toks.tolist(), lengths)],
                [x[:k] for x, k in zip(lps.tolist(), lengths)], finished)


def run(sampler, prompts, shape, max_new_tokens):
    """(seconds, tokens sampled) of one generate call."""
    start = time.perf_counter()
    ro = sampler.generate(prompts, shape["n"], shape["temperature"], shape["top_p"],
                          shape["top_k"], max_new_tokens, seed=0)
    return time.perf_counter() - start, sum(map(len, ro.completion_ids))


def profile(samplers, prompts, shape, max_new_tokens):
    """One run of each sampler under torch.profiler (ops by self CPU time) and cProfile (Python
    functions by cumulative time, the transformers forward's layers of calls included)."""
    for name, sampler in samplers.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            seconds, tokens = run(sampler, prompts, shape, max_new_tokens)
        print(f"\n== {name}: torch.profiler, {tokens} tokens in {seconds:.2f} s (profiled)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        pr = cProfile.Profile()
        pr.enable()
        seconds, tokens = run(sampler, prompts, shape, max_new_tokens)
        pr.disable()
        print(f"== {name}: cProfile, {tokens} tokens in {seconds:.2f} s (profiled)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", default="out/cpu/sft")
    p.add_argument("--data", default="gen:nums=3,range=1-20,test=200,val=100")
    p.add_argument("--shape", choices=["rl", "eval", "both"], default="both")
    p.add_argument("--rounds", type=int, default=3, help="A/B pairs per shape")
    p.add_argument("--max_new_tokens", type=int, default=160)
    p.add_argument("--batch_size", type=int, default=1024, help="of today's sampler (its default)")
    p.add_argument("--old_batch_size", type=int, default=256, help="of the old one (its default)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    model, tok = load_model(args.init)
    model.eval()
    cpu = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, avx512_bf16: "
          f"{'avx512_bf16' in cpu}, model {args.init}, batch_size {args.batch_size} (old: "
          f"{args.old_batch_size}), load average {os.getloadavg()[0]:.2f} (1 min)")
    samplers = {"old": OldHFSampler(model, tok, args.old_batch_size),
                "new": HFSampler(model, tok, args.batch_size)}
    for name in (["rl", "eval"] if args.shape == "both" else [args.shape]):
        shape = SHAPES[name]
        prompts = [make_prompt(t["nums"], t["target"], "compact")
                   for t in load_tasks(args.data, shape["split"], shape["problems"])]
        if args.profile:
            profile(samplers, prompts, shape, args.max_new_tokens)
            continue
        for sampler in samplers.values():  # warm-up: first-call allocations, lazy imports
            sampler.generate(prompts[:8], 2, 1.0, max_new_tokens=8)
        total = {k: [0.0, 0] for k in samplers}
        for r in range(args.rounds):
            for k, sampler in samplers.items():
                seconds, tokens = run(sampler, prompts, shape, args.max_new_tokens)
                total[k][0] += seconds
                total[k][1] += tokens
                print(f"{name} round {r} {k}: {tokens} tokens in {seconds:.2f} s, "
                      f"{tokens / seconds:,.0f} tokens/s", flush=True)
        rate = {k: tokens / seconds for k, (seconds, tokens) in total.items()}
        print(f"== {name} ({shape['problems']} x {shape['n']}, T {shape['temperature']}, "
              f"{args.max_new_tokens} tokens): old {rate['old']:,.0f} tokens/s, new "
              f"{rate['new']:,.0f} tokens/s, ratio {rate['new'] / rate['old']:.2f}x; load average "
              f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
