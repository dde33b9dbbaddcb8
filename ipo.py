"""IPO: preference optimization against a frozen reference (paper 000 §3.2, Eq. 2; Table 4 recipe).

    h(x, y_w, y_l) = [log π_θ(y_w|x) − log π_ref(y_w|x)] − [log π_θ(y_l|x) − log π_ref(y_l|x)]
    L_IPO = E (h − 1/(2β))²                                                                     (Eq. 2)
    L = L_IPO + α · NLL(y_w) / |y_w|                                      (RPO anchor, paper 001)

The squared loss pulls the margin to 1/(2β) instead of pushing it to infinity as DPO does, which
matters here: the verifier never flips a label. π_ref is the frozen init (the SFT model).
Departures from the paper:
  1. Pairs are built here (--pairs onpolicy | solver | a file) instead of the paper's pre-made
     countdown_tasks_3to4-dpo split; 10% of the prompts are held out to measure preference accuracy.
  2. `--length_norm` (paper 001) averages instead of sums the log-probs; off by default as in 000.

Real (1×H100):  python ipo.py --init out/sft --output_dir out/ipo
CPU (embedded): the `ipo` stage of run_cpu.sh, which prints its exact command.
"""
import copy
import math
import random
import time
from dataclasses import dataclass

import torch
from transformers import get_cosine_schedule_with_warmup

from checkpoints import load_state, prepare_run, save_checkpoint, save_state, step_is_finite
from common import CountdownError, Logger, arg, autocast, cli, load_model, load_records, load_tasks, \
    make_prompt, parse_args, seed_everything, token_stats, tokenize_pairs
from evaluate import eval_metrics
from sampler import make_sampler
from verifier import dense_score, extract_answer, flip_operator, make_trace, score


@dataclass
class Args:
    # shared by every script, in this order
    init: str = arg("out/sft", "checkpoint to start from; also the frozen reference")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks whose prompts the pairs are built on")
    eval_data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks for periodic pass@k (its `val` split)")
    output_dir: str = arg("out/ipo", "where the checkpoint, args.json and metrics.jsonl go")
    seed: int = arg(0, "seed for pairing, shuffling and sampling")
    template: str = arg("base", "prompt template: base | compact")
    lr: float = arg(5e-6, "peak learning rate (000 Table 4)")
    batch_size: int = arg(1024, "pairs per optimizer step (000 Table 4: 64 x 16 accumulation)")
    micro_batch: int = arg(16, "pairs per forward/backward; batch_size must be a multiple")
    weight_decay: float = arg(0.01, "AdamW weight decay (000 Table 4)")
    grad_clip: float = arg(1.0, "global grad-norm clip (000 Table 4)")
    max_prompt_len: int = arg(512, "prompts longer than this are an error (000 Table 4)")
    max_response_len: int = arg(1024, "responses are truncated to this (000 Table 4)")
    eval_every: int = arg(0, "steps between held-out evaluations (0: only at start and end)")
    eval_problems: int = arg(200, "held-out problems per evaluation")
    eval_samples: int = arg(16, "samples per problem (pass@k up to this)")
    eval_max_new_tokens: int = arg(1024, "generation budget at evaluation")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward to save memory")
    wandb_project: str = arg("", "log to this wandb project too (off when empty)")
    save_every: int = arg(100, "steps between resumable states in OUTPUT_DIR/state (the newest 2 are kept)")
    resume: str = arg("", "continue the run saved in this dir from its newest state (it becomes --output_dir)")
    overwrite: bool = arg(False, "start again in a non-empty --output_dir (refused otherwise)")
    skip_nonfinite: bool = arg(False, "drop a step whose loss or gradient is NaN/inf instead of stopping the run")
    # IPO specific
    beta: float = arg(0.05, "IPO β: the target margin is 1/(2β) nats (000 Table 4: 0.05, selected over 0.1; 001: 0.1)")
    length_norm: bool = arg(False, "average log-probs over response tokens (001) instead of summing")
    rpo_alpha: float = arg(0.0, "weight of the NLL anchor on the chosen response (001: 0.1)")
    epochs: float = arg(1.0, "passes over the pairs (000 Table 4)")
    warmup: float = arg(0.05, "warmup fraction of the cosine schedule (000 Table 4)")
    pairs: str = arg("onpolicy", "onpolicy | solver | hub/JSONL with prompt, chosen, rejected")
    num_prompts: int = arg(4096, "onpolicy/solver: prompts to build pairs on")
    group_size: int = arg(8, "onpolicy: samples per prompt to find a correct and a wrong one among")
    rejected: str = arg("any", "onpolicy: rejected is `any` wrong sample or a `near_miss` (right numbers, wrong value)")
    temperature: float = arg(1.0, "onpolicy: sampling temperature for the pairs")
    max_new_tokens: int = arg(1024, "onpolicy: generation budget for the pairs")
    backend: str = arg("hf", "sampler of the pairs and evaluations: hf (plain PyTorch, CPU ok) | vllm (sampler.py)")
    heldout: float = arg(0.1, "share of prompts whose pairs are held out for eval/pref_acc")


def ipo_loss(logp_w, logp_l, ref_w, ref_l, beta):
    """Eq. 2 per pair. All inputs (B,): sequence log-probs (summed or length-normalized) of chosen (w)
    and rejected (l) under the policy and the reference. Returns (loss (B,), margin h (B,))."""
    h = (logp_w - ref_w) - (logp_l - ref_l)                                    # (B,)
    return (h - 1.0 / (2.0 * beta)) ** 2, h


def sequence_logp(logp, mask, length_norm):
    """log π(y|x) from per-token log-probs (B, T-1): summed (000), or averaged over the response tokens
    (001's length normalization, which stops long responses from dominating the margin). -> (B,)"""
    total = (logp * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if length_norm else total


def rpo_nll(logp_tokens_w, mask_w):
    """Paper 001's anchor: mean NLL per token of the chosen response. (B, T-1), (B, T-1) -> (B,)."""
    return -(logp_tokens_w * mask_w).sum(-1) / mask_w.sum(-1).clamp(min=1)


def pair_report(loss, h, w, l, rw, rl):
    """What to log per pair: loss, preference accuracy, margin, log-probs and their change vs π_ref."""
    return {"loss": loss, "pref_acc": (h > 0).float() + 0.5 * (h == 0).float(), "margin": h, "chosen_logp": w, "rejected_logp": l,
            "chosen_delta": w - rw, "rejected_delta": l - rl}


def build_pairs(args, sampler):
    """(prompt, chosen, rejected) triples and a one-line report of how they were made."""
    if args.pairs not in ("onpolicy", "solver"):
        rows = load_records(args.pairs, "train", ["prompt", "chosen", "rejected"])
        return [(r["prompt"], r["chosen"], r["rejected"]) for r in rows], f"{len(rows)} pairs from {args.pairs}"
    tasks = load_tasks(args.data, "train", args.num_prompts)
    prompts = [make_prompt(t["nums"], t["target"], args.template) for t in tasks]
    rng, pairs = random.Random(args.seed), []
    if args.pairs == "solver":  # paper 001 "scripted": a solver trace vs the same trace, operator flipped
        for p, t in zip(prompts, tasks):
            trace = make_trace(t["nums"], t["target"], rng)
            neg = flip_operator(extract_answer(trace), t["nums"], t["target"], rng)
            if neg is not None:
                pairs.append((p, trace, trace.replace(f"<answer>{extract_answer(trace)}</answer>", f"<answer>{neg}</answer>")))
        return pairs, f"{len(pairs)} solver pairs from {len(prompts)} prompts"
    ro = sampler.generate(prompts, args.group_size, args.temperature, 1.0, 0, args.max_new_tokens, args.seed)  # the init's
    sampler.sleep()
    for i, (p, t) in enumerate(zip(prompts, tasks)):
        texts = ro.texts[i * args.group_size:(i + 1) * args.group_size]
        good = [x for x in texts if score(x, t["nums"], t["target"]) == 1.0]
        bad = [x for x in texts if (dense_score(x, t["nums"], t["target"]) > 0.1 if args.rejected == "near_miss"
                                    else score(x, t["nums"], t["target"]) < 1.0)]
        if good and bad:  # prompts the model always or never solves give no pair
            pairs.append((p, rng.choice(good), rng.choice(bad)))
    return pairs, f"{len(pairs)} on-policy pairs from {len(prompts)} prompts x {args.group_size} samples"


def main(argv=None):
    args = parse_args(Args, argv)
    if args.batch_size % args.micro_batch:
        raise CountdownError(f"--batch_size {args.batch_size} is not a multiple of --micro_batch {args.micro_batch}")
    prepare_run(args)  # refuse to write over a run, or point --resume at one
    seed_everything(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(args.init, device, torch.float32)
    ref = copy.deepcopy(model).eval().requires_grad_(False)  # π_ref: the frozen init
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    sampler = make_sampler(args.backend, model, tok, args.init, args.seed, args.max_prompt_len + args.max_new_tokens)
    pairs, report = build_pairs(args, sampler)
    random.Random(args.seed).shuffle(pairs)
    n_held = int(args.heldout * len(pairs))
    held, pairs = pairs[:n_held], pairs[n_held:]
    if not pairs:
        raise CountdownError(f"no training pairs ({report}); sample more prompts or a larger --group_size")
    print(f"{report}: {len(pairs)} to train on, {len(held)} held out")
    eval_tasks = load_tasks(args.eval_data, "val", args.eval_problems)
    batch = min(args.batch_size, len(pairs))  # a small pair set makes one smaller step
    total = max(1, math.ceil(args.epochs * len(pairs) / batch))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup * total), total)
    # --resume: the pairs were rebuilt above from the init, as the first time; now the trained state
    start, extra = load_state(args.output_dir, model, opt, sched) if args.resume else (0, {})
    order, skipped = extra.get("order", []), extra.get("skipped", 0)
    log = Logger(args.output_dir, total, args, args.wandb_project, start)

    def seq_logps(net, chunk):
        """Policy or reference log-probs of chosen and rejected for a list of pairs: (b,) each, plus the
        chosen per-token log-probs and mask for the RPO anchor. One forward over the 2b sequences."""
        ps, ws, ls = zip(*chunk)
        ids, attn, mask = (x.to(device) for x in tokenize_pairs(tok, list(ps) * 2, list(ws) + list(ls),
                                                                 args.max_prompt_len, args.max_response_len))
        with autocast(device, net):
            logp = token_stats(net, ids, attn, mask)["logp"]                      # (2b, T-1)
        m = mask[:, 1:].float()
        seq = sequence_logp(logp, m, args.length_norm)                            # (2b,)
        b = len(chunk)
        return seq[:b], seq[b:], logp[:b], m[:b]

    def heldout_metrics():
        sums = {}
        with torch.no_grad():
            for s in range(0, len(held), args.micro_batch):
                w, l, _, _ = seq_logps(model, held[s:s + args.micro_batch])
                rw, rl, _, _ = seq_logps(ref, held[s:s + args.micro_batch])
                for k, v in pair_report(*ipo_loss(w, l, rw, rl, args.beta), w, l, rw, rl).items():
                    sums[k] = sums.get(k, 0.0) + v.sum().item()
        return {f"eval/{k}": v / len(held) for k, v in sums.items()}

    def evaluation():
        return {**eval_metrics(model, tok, eval_tasks, args, sampler), **(heldout_metrics() if held else {})}

    if not start:
        log.log(0, evaluation())  # the start: pass@k of the init and its held-out preference accuracy
    for step in range(start + 1, total + 1):
        t0 = time.time()
        # ---- batch of pairs (reshuffled every epoch) ----
        if len(order) < batch:
            order = random.Random(args.seed + step).sample(range(len(pairs)), len(pairs))
        idx, order = order[:batch], order[batch:]
        sums = {}
        # ---- forward / backward per micro-batch: policy and reference log-probs, Eq. 2 (+ RPO) ----
        for s in range(0, batch, args.micro_batch):
            chunk = [pairs[i] for i in idx[s:s + args.micro_batch]]
            w, l, logp_w_tok, mask_w = seq_logps(model, chunk)
            with torch.no_grad():
                rw, rl, _, _ = seq_logps(ref, chunk)
            loss, h = ipo_loss(w, l, rw, rl, args.beta)
            nll = rpo_nll(logp_w_tok, mask_w)
            ((loss + args.rpo_alpha * nll).sum() / batch).backward()
            for k, v in {**pair_report(loss, h, w, l, rw, rl), "rpo_nll": nll}.items():
                sums[k] = sums.get(k, 0.0) + v.detach().sum().item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if step_is_finite(step, sums["loss"], grad_norm, args):  # else stop, or with --skip_nonfinite drop the step
            opt.step()
        else:
            skipped += 1
        sched.step()
        opt.zero_grad(set_to_none=True)
        # ---- log, evaluate, checkpoint ----
        metrics = {f"train/{k}": v / batch for k, v in sums.items()}
        metrics.update({"train/lr": sched.get_last_lr()[0], "train/grad_norm": grad_norm, "train/skipped_steps": skipped,
                        "time/step": time.time() - t0})
        if step == total or (args.eval_every and step % args.eval_every == 0):
            metrics.update(evaluation())
            save_checkpoint(model, tok, args.output_dir)
        log.log(step, metrics)
        if step == total or step % args.save_every == 0:
            save_state(args.output_dir, step, model, opt, sched, order=order, skipped=skipped)
    log.close()
    print(f"saved {args.output_dir}")
    return model, ref


if __name__ == "__main__":
    cli(main)
