"""Where one GRPO step's time goes on this CPU: sampling, the policy's forward and backward, the
reference's forward, the optimizer, in bf16 autocast and in fp32 (median of --rounds), with the
update's GFLOP/s beside the cores' matmul rate at the model's own shapes. For the numbers in
docs/studies/performance.md ("Where the time goes"); run it alone on the machine.

    OMP_NUM_THREADS=1 python benchmarks/step_profile.py --init out/cpu/sft --threads 1
Shape: the pipeline's GRPO step, 32 prompts x 8 rollouts at T 0.7, 160 new tokens, micro-batch 32
(--micro_batch 64: the pipeline's before; a CPU's cache favours 16-32)."""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import HFSampler, autocast, micro_batches, rollouts, token_stats  # noqa: E402
from plumbing.harness import frozen_copy, load_policy  # noqa: E402
from plumbing.tasks import load_tasks  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--init", default="out/cpu/sft")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--micro_batch", type=int, default=32)
p.add_argument("--per_row", action="store_true", help="every row whole, no prompt shared")
args = p.parse_args()
torch.set_num_threads(args.threads)
model, tok, device = load_policy(args.init)
ref = frozen_copy(model)
tasks = load_tasks("gen:nums=3,range=1-20,test=200,val=100", "train")[:32]
sampler, opt = HFSampler(model, tok), torch.optim.SGD(model.parameters(), lr=0.0)
seconds, tokens = {}, None  # {phase: [seconds in round 0, round 1, ...]}


def clock(name, r, fn):
    t0 = time.perf_counter()
    out = fn()
    seconds.setdefault(name, [0.0] * args.rounds)[r] += time.perf_counter() - t0
    return out


for r in range(args.rounds):
    samples = clock("sample", r, lambda: rollouts(sampler, model, tok, tasks, 8, "compact", 256,
                                                    0.7, 160, r))
    batches = list(micro_batches(samples, args.micro_batch, tok.pad_token_id, device,
                                 not args.per_row))
    tokens = sum(int(m.sum()) for _, _, _, m, *_ in batches), sum(  # padded: rows' and prompts'
        i.numel() + (p.ids.numel() if p else 0) for _, i, _, _, _, p in batches)
    for bf16 in ("1", "0"):
        os.environ["COUNTDOWN_CPU_BF16"] = bf16  # what common.autocast reads
        for _, ids, attn, mask, _, prompts in batches:
            with autocast(device, model, ref):
                out = clock(f"fwd/{bf16}", r, lambda: token_stats(model, ids, attn, mask, 0.7,
                                                                  entropy="logged", prompts=prompts))
                with torch.no_grad():
                    clock(f"ref/{bf16}", r, lambda: token_stats(ref, ids, attn, mask, 0.7,
                                                                prompts=prompts))
            clock(f"bwd/{bf16}", r, lambda: (out["logp"] * mask[:, 1:]).sum().backward())
        clock(f"opt/{bf16}", r, lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
step = {k: statistics.median(v) for k, v in seconds.items()}
print(f"{args.threads} thread(s); response tokens {tokens[0]}, padded tokens {tokens[1]}")
print(" | ".join(f"{k} {v:.2f} s" for k, v in step.items()))
cfg = model.config
weights = sum(p.numel() for n_, p in model.named_parameters() if p.dim() == 2 and "embed" not in n_)
weights += model.get_output_embeddings().weight.numel() if cfg.tie_word_embeddings else 0
forward = (2 * weights + 4 * cfg.num_hidden_layers * 70 * cfg.hidden_size) * tokens[1]
for bf16, name in (("1", "bf16"), ("0", "fp32")):
    s = step[f"fwd/{bf16}"] + step[f"bwd/{bf16}"] + step[f"ref/{bf16}"]
    print(f"{name}: update {s:.2f} s, {4 * forward / s / 1e9:.1f} GFLOP/s (3 x forward + reference)")
for dtype in (torch.float32, torch.bfloat16):
    rates = []
    for m, k, n_ in ((8192, 128, 384), (8192, 384, 128), (8192, 128, 128), (2048, 2048, 2048)):
        a, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n_, dtype=dtype)
        a @ w
        t0, reps = time.perf_counter(), 10
        for _ in range(reps):
            a @ w
        rates.append(2 * m * k * n_ * reps / (time.perf_counter() - t0) / 1e9)
    print(f"{dtype}: matmul GFLOP/s at the model's shapes {[round(x) for x in rates[:3]]}, "
          f"2048^3 {rates[3]:.0f}")
