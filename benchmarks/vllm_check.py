"""The vLLM sampler beside the HF one on a real checkpoint: sampling speed and accuracy, the
log-prob gap to a trainer forward, and that gap before and after a weight sync. On a CPU, run it in
the vLLM lane's venv (.ci/vllm-lane makes .venv-vllm):

  .venv-vllm/bin/python benchmarks/vllm_check.py out/cpu/sft [--prompts 64 --n 8 --temperature 0.7]
"""
import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import tasks as D  # noqa: E402
import common as LP  # noqa: E402
from plumbing import models as M  # noqa: E402
import common as S  # noqa: E402
from verifier import score  # noqa: E402


@torch.no_grad()
def logprob_gap(model, tokenizer, samples, temperature):
    """Mean |trainer − sampler| log-prob over every sampled token of `samples`, in one pass: what
    the RL scripts log as train/sampler_gap, for checking a sampler here and in tests/test_vllm.py,
    benchmarks/gpu_smoke.py."""
    rows = list(range(len(samples.completion_ids)))
    ids, attn, mask, sampler_logp = (x.to(model.device) for x in
                                     LP.rollout_batch(samples, rows, tokenizer.pad_token_id)[:4])
    logp = LP.token_stats(model, ids, attn, mask, temperature=temperature)["logp"]  # (b, T-1)
    return (logp - sampler_logp).abs()[mask[:, 1:].bool()].mean().item()


def run(name, sampler, model, tok, tasks, args):
    prompts = [D.make_prompt(t["nums"], t["target"], "compact") for t in tasks]
    sampler.generate(prompts[:4], 2, args.temperature, max_new_tokens=16, seed=0)  # warm-up
    t0 = time.time()
    ro = sampler.generate(prompts, args.n, args.temperature, max_new_tokens=args.max_new_tokens, seed=1)
    dt = time.time() - t0
    tokens = sum(map(len, ro.completion_ids))
    rows = [t for t in tasks for _ in range(args.n)]
    acc = sum(score(x, t["nums"], t["target"]) == 1 for x, t in zip(ro.texts, rows)) / len(rows)
    gap = logprob_gap(model, tok, ro, args.temperature)
    print(f"{name:5s} {len(ro.texts)} rollouts, {tokens} tokens in {dt:.1f} s = {tokens / dt:,.0f} tokens/s | "
          f"accuracy {acc:.3f} | log-prob gap to the trainer {gap:.1e}")
    return prompts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--data", default="gen:nums=3,range=1-20,test=200,val=100")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max_new_tokens", type=int, default=160)
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok = M.load_model(args.checkpoint)
    tasks = D.load_tasks(args.data, "train", args.prompts)
    run("hf", S.HFSampler(model, tok), model, tok, tasks, args)
    engine = S.VLLMSampler(args.checkpoint, tok, seed=0, max_model_len=model.config.max_position_embeddings)
    prompts = run("vllm", engine, model, tok, tasks, args)
    moved = copy.deepcopy(model)  # a trainer one step on: every weight perturbed
    with torch.no_grad():
        for w in moved.parameters():
            w.add_(0.01 * w.std() * torch.randn_like(w))
    for when in ("before", "after"):
        if when == "after":
            engine.sync(moved)
        ro = engine.generate(prompts, args.n, args.temperature, max_new_tokens=args.max_new_tokens, seed=2)
        print(f"perturbed trainer, {when} sync: gap {logprob_gap(moved, tok, ro, args.temperature):.1e}")


if __name__ == "__main__":
    main()
