"""How often does bottom-p cut anything? Samples 4 rollouts for each of 32 train problems from a model
and reports, for each p, the share of sampled positions where softmax(logits / T) has a head of
tokens holding at most 1 − p of the mass (what sampler._filter_logits drops).

    python benchmarks/bottom_p_cut_rate.py out/cpu/sft [--temperature 1.0]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import load_tasks, make_prompt  # noqa: E402
from logprobs import pack  # noqa: E402
from models import load_model  # noqa: E402
from sampler import HFSampler  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("model")
p.add_argument("--temperature", type=float, default=1.0)
p.add_argument("--data", default="gen:nums=3,range=1-20,test=200,val=100")
args = p.parse_args()
model, tok = load_model(args.model)
prompts = [make_prompt(t["nums"], t["target"], "compact") for t in load_tasks(args.data, "train", 32)]
ro = HFSampler(model, tok).generate(prompts, 4, args.temperature, max_new_tokens=160, seed=0)
ids, attn, mask = pack([x for x in ro.prompt_ids for _ in range(4)], ro.completion_ids, tok.pad_token_id)
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / args.temperature
sel = mask[:, 1:].bool()
head = logits.softmax(-1).sort(-1, descending=True).values.cumsum(-1)[sel]              # (N, V)
for bottom_p in (0.9, 0.7, 0.5):
    print(f"bottom_p {bottom_p} at T {args.temperature}: cuts at {(head <= 1 - bottom_p).any(-1).float().mean():.4f} "
          f"of {sel.sum().item()} sampled positions")
