"""IPO: preference optimization against a frozen reference (paper 000 §3.2, Eq. 2; Table 4 recipe).

    h(x, y_w, y_l) = [log π_θ(y_w|x) − log π_ref(y_w|x)] − [log π_θ(y_l|x) − log π_ref(y_l|x)]
    L_IPO = E (h − 1/(2β))²                                                              (Eq. 2)
    L = L_IPO + α · NLL(y_w) / |y_w|                                     (RPO anchor, paper 001)

The squared loss pulls the margin to 1/(2β) instead of pushing it to infinity as DPO does, which
matters here: the verifier never flips a label. π_ref is the frozen init (the SFT model).
Departures from the paper:
  1. Pairs are built here (--pairs onpolicy | solver | a file) instead of the paper's pre-made
     countdown_tasks_3to4-dpo split; 10% of the prompts are held out to measure preference accuracy.
  2. `--length_norm` (paper 001) averages instead of sums the log-probs; off by default as in 000.

Real (1×H100):  python ipo.py --init out/sft --output_dir out/ipo
CPU (embedded): the `ipo` stage of run_cpu.sh, which prints its exact command.
"""
import math
import random
from dataclasses import dataclass
from functools import partial

import torch
from transformers import get_cosine_schedule_with_warmup

from common import (autocast, data_parallel, make_sampler, score_rollouts, token_stats,
                    tokenize_pairs)
from evaluate import eval_metrics
from plumbing.flags import CountdownError, TrainArgs, arg, cli, parse_args, seed_everything
from plumbing.harness import Run, StepStats, frozen_copy, load_policy, prepare_run
from plumbing.tasks import load_records, load_tasks, make_prompt, solver_pairs


@dataclass
class Args(TrainArgs):
    # shared, with this script's defaults (000 Table 4)
    init: str = arg("out/sft", "checkpoint to start from; also the frozen reference")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks whose prompts the pairs are built on")
    output_dir: str = arg("out/ipo", "where the checkpoint, args.json and metrics.jsonl go")
    seed: int = arg(0, "seed for pairing, shuffling and sampling")
    lr: float = arg(5e-6, "peak learning rate (000 Table 4)")
    batch_size: int = arg(1024, "pairs per optimizer step (000 Table 4: 64 x 16 accumulation)")
    micro_batch: int = arg(16, "pairs per forward/backward; batch_size must be a multiple")
    weight_decay: float = arg(0.01, "AdamW weight decay (000 Table 4)")
    max_prompt_len: int = arg(512, "prompts longer than this are an error (000 Table 4)")
    max_response_len: int = arg(1024, "responses are truncated to this (000 Table 4)")
    eval_every: int = arg(0, "steps between held-out evaluations (0: only at start and end)")
    save_every: int = arg(100, "steps between resumable states in OUTPUT_DIR/state (the newest 2 "
                               "are kept)")
    # IPO specific
    beta: float = arg(0.05, "IPO β: the target margin is 1/(2β) nats (000 Table 4: 0.05, selected "
                            "over 0.1; 001: 0.1)")
    length_norm: bool = arg(False,
                            "average log-probs over response tokens (001) instead of summing")
    rpo_alpha: float = arg(0.0, "weight of the NLL anchor on the chosen response (001: 0.1)")
    epochs: float = arg(1.0, "passes over the pairs (000 Table 4)")
    warmup: float = arg(0.05, "warmup fraction of the cosine schedule (000 Table 4)")
    pairs: str = arg("onpolicy", "onpolicy | solver | hub/JSONL with prompt, chosen, rejected")
    num_prompts: int = arg(4096, "onpolicy/solver: prompts to build pairs on")
    group_size: int = arg(8, "onpolicy: samples per prompt to find a correct and a wrong one among")
    rejected: str = arg("any", "onpolicy: rejected is `any` wrong sample or a `near_miss` (right "
                               "numbers, wrong value)")
    temperature: float = arg(1.0, "onpolicy: sampling temperature for the pairs")
    max_new_tokens: int = arg(1024, "onpolicy: generation budget for the pairs")
    backend: str = arg("hf", "sampler of the pairs and evaluations: hf (plain PyTorch, CPU ok) | "
                             "vllm (common.py)")
    heldout: float = arg(0.1, "share of prompts whose pairs are held out for eval/pref_acc")



def ipo_loss(logp_w, logp_l, ref_w, ref_l, beta):
    """Eq. 2 per pair. All inputs (B,): sequence log-probs (summed or length-normalized) of chosen
    (w) and rejected (l) under the policy and the reference. Returns (loss (B,), margin h (B,))."""
    h = (logp_w - ref_w) - (logp_l - ref_l)                                    # (B,)
    return (h - 1.0 / (2.0 * beta)) ** 2, h


def sequence_logp(logp, mask, length_norm):
    """log π(y|x) from per-token log-probs (B, T-1): summed (000), or averaged over the response
    tokens (001's length normalization, which stops long responses from dominating the margin).
    -> (B,)"""
    total = (logp * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if length_norm else total


def rpo_nll(logp_tokens_w, mask_w):
    """Paper 001's anchor: mean NLL per token of the chosen response. (B, T-1), (B, T-1) -> (B,)."""
    return -(logp_tokens_w * mask_w).sum(-1) / mask_w.sum(-1).clamp(min=1)


def pair_report(loss, h, w, l, rw, rl):
    """What to log per pair: loss, preference accuracy, margin, log-probs and their change vs
    π_ref."""
    return {"loss": loss, "pref_acc": (h > 0).float() + 0.5 * (h == 0).float(), "margin": h,
            "chosen_logp": w, "rejected_logp": l, "chosen_delta": w - rw, "rejected_delta": l - rl}


def build_pairs(pairs, data, num_prompts, template, sampler, group_size, temperature,
                max_new_tokens, rejected, seed):
    """(prompt, chosen, rejected) triples and a one-line report of how they were made: from a file
    or dataset, from the solver (a trace vs the same trace with an operator flipped), or
    on-policy from `sampler` (a correct and a wrong sample of the init on the same prompt)."""
    if pairs not in ("onpolicy", "solver"):
        rows = load_records(pairs, "train", ["prompt", "chosen", "rejected"])
        return [(r["prompt"], r["chosen"], r["rejected"]) for r in rows
                ], f"{len(rows)} pairs from {pairs}"
    tasks = load_tasks(data, "train", num_prompts)
    rng = random.Random(seed)
    if pairs == "solver":  # paper 001 "scripted": a solver trace vs the trace, operator flipped
        out = solver_pairs(tasks, template, rng)
        return out, f"{len(out)} solver pairs from {len(tasks)} prompts"
    # the init's samples: a right one and a wrong one of the same prompt
    prompts = [make_prompt(t["nums"], t["target"], template) for t in tasks]
    sampler.wake()  # under FSDP: the whole model on every rank
    samples = sampler.generate(prompts, group_size, temperature, 1.0, 0, max_new_tokens, seed)
    sampler.sleep()
    # (N*G,) 1 / 0.1 / 0, (N, G) 001's credit
    scores, dense = score_rollouts(samples, tasks, "dense")
    scores, out = scores.view(-1, group_size), []
    for i, p in enumerate(prompts):
        texts = samples.texts[i * group_size:(i + 1) * group_size]
        good = [x for x, s in zip(texts, scores[i]) if s == 1]
        near = rejected == "near_miss"  # right numbers, wrong value (credit above a wrong answer's)
        bad = [x for x, s, d in zip(texts, scores[i], dense[i]) if (d > s if near else s < 1)]
        if good and bad:  # prompts the model always or never solves give no pair
            out.append((p, rng.choice(good), rng.choice(bad)))
    return out, f"{len(out)} on-policy pairs from {len(prompts)} prompts x {group_size} samples"


def seq_logps(net, chunk, tok, length_norm, max_prompt_len, max_response_len):
    """Log-probs of chosen and rejected under `net` for a list of pairs: (b,) each, plus the chosen
    per-token log-probs and mask for the RPO anchor. One forward over the 2b sequences."""
    ps, ws, ls = zip(*chunk)
    ids, attn, mask = (x.to(net.device) for x in tokenize_pairs(tok, list(ps) * 2,
                                                                 list(ws) + list(ls),
                                                                 max_prompt_len, max_response_len))
    with autocast(net.device.type, net):
        logp = token_stats(net, ids, attn, mask)["logp"]                          # (2b, T-1)
    m = mask[:, 1:].float()
    seq = sequence_logp(logp, m, length_norm)                                     # (2b,)
    b = len(chunk)
    return seq[:b], seq[b:], logp[:b], m[:b]


@torch.no_grad()
def heldout_metrics(logps, model, ref, held, beta, micro_batch):
    """eval/ means of pair_report over the held-out pairs: preference accuracy, margin, log-prob
    shifts."""
    sums = {}
    for s in range(0, len(held), micro_batch):
        w, l, _, _ = logps(model, held[s:s + micro_batch])
        rw, rl, _, _ = logps(ref, held[s:s + micro_batch])
        for k, v in pair_report(*ipo_loss(w, l, rw, rl, beta), w, l, rw, rl).items():
            sums[k] = sums.get(k, 0.0) + v.sum().item()
    return {f"eval/{k}": v / len(held) for k, v in sums.items()}


def main(argv=None):
    args = parse_args(Args, argv)
    if args.batch_size % args.micro_batch:
        raise CountdownError(f"--batch_size {args.batch_size} is not a multiple of --micro_batch "
                             f"{args.micro_batch}")
    output_dir = prepare_run(args.output_dir, args.resume, args.overwrite)  # never over a done run
    seed_everything(args.seed)
    model, tok, device = load_policy(args.init, **args.policy_options())
    ref = frozen_copy(model)  # π_ref: the frozen init (bf16 on a GPU)
    world = data_parallel(model, args.fsdp)  # torchrun's N ranks (each builds the pairs), else 1
    sampler = make_sampler(args.backend, model, tok, args.init, args.seed,
                           args.max_prompt_len + args.max_new_tokens, args.decode)
    pairs, report = build_pairs(args.pairs, args.data, args.num_prompts, args.template, sampler,
                                args.group_size, args.temperature, args.max_new_tokens,
                                args.rejected, args.seed)
    random.Random(args.seed).shuffle(pairs)
    n_held = int(args.heldout * len(pairs))
    held, pairs = pairs[:n_held], pairs[n_held:]
    if not pairs:
        raise CountdownError(f"no training pairs ({report}); sample more prompts or a larger "
                             "--group_size")
    print(f"{report}: {len(pairs)} to train on, {len(held)} held out")
    eval_tasks = load_tasks(args.eval_data, "val", args.eval_problems)
    batch = min(args.batch_size, len(pairs))  # a small pair set makes one smaller step
    if batch % world:
        raise CountdownError(f"a step's {batch} pairs do not split over {world} ranks")
    total = max(1, math.ceil(args.epochs * len(pairs) / batch))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup * total), total)
    logps = partial(seq_logps, tok=tok, length_norm=args.length_norm,
                    max_prompt_len=args.max_prompt_len, max_response_len=args.max_response_len)
    evaluate = lambda: {  # noqa: E731  pass@k of the policy and its held-out preference accuracy
        **eval_metrics(model, tok, eval_tasks, args.eval_samples, args.eval_max_new_tokens,
                       args.template, args.seed, sampler),
        **(heldout_metrics(logps, model, ref, held, args.beta, args.micro_batch) if held else {})}
    # --resume: the pairs were rebuilt above from the init, as the first time; now the trained state
    run = Run(output_dir, total, model, tok, opt, sched=sched, **args.run_options(output_dir))
    if run.start == 0:  # where the init starts
        run.log(0, evaluate())
    for step in run.steps():  # from run.start + 1: a resumed run goes on where its state ends
        # ---- batch of pairs (reshuffled every epoch) ----
        if len(run.order) < batch:
            run.order = random.Random(args.seed + step).sample(range(len(pairs)), len(pairs))
        idx, run.order = run.share(run.order[:batch]), run.order[batch:]  # this rank's pairs
        # ---- per micro-batch: policy and reference log-probs, Eq. 2 (+ RPO) ----
        stats, b = StepStats(len(idx), 0), len(idx)
        for s in range(0, b, args.micro_batch):
            chunk = [pairs[i] for i in idx[s:s + args.micro_batch]]
            w, l, logp_w_tok, mask_w = logps(model, chunk)
            with torch.no_grad():
                rw, rl, _, _ = logps(ref, chunk)
            loss, h = ipo_loss(w, l, rw, rl, args.beta)                               # (b,) each
            nll = rpo_nll(logp_w_tok, mask_w)                                          # (b,)
            ((loss + args.rpo_alpha * nll).sum() / b).backward()  # torchrun: DDP's rank mean
            for k, v in {**pair_report(loss, h, w, l, rw, rl), "rpo_nll": nll}.items():
                stats.add(k, v.detach().sum().item() / b)
        # ---- the update: clip, the non-finite stop, step, the schedule ----
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if run.finite(step, stats.sums["loss"], grad_norm):  # else stop (or --skip_nonfinite)
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        # ---- log, evaluate, checkpoint ----
        metrics = stats.metrics()  # means over the step's pairs, every rank's
        if step == total or (args.eval_every and step % args.eval_every == 0):
            run.checkpoint()  # first: an evaluation that fails loses nothing
            metrics.update(evaluate())
        run.log(step, metrics)
        if step == total or step % args.save_every == 0:  # what --resume restarts from
            run.save(step)
    run.close()
    return model, ref


if __name__ == "__main__":
    cli(main)
