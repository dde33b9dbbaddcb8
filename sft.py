"""SFT: supervised warm start on reasoning traces (paper 000 §3.2, Eq. 1; Table 4 recipe).

    L(θ) = − Σ_t 1[resp_t] · log π_θ(y_t | y_<t, x)  /  Σ_t 1[resp_t]                        (Eq. 1)

Only response tokens count (EOS included: the model must learn to stop); the prompt conditions.
Departures from the paper:
  1. The loss is averaged over the response tokens of the whole effective batch (Eq. 1 is a sum).
  2. Embedded setting: `--data gen:...` trains on traces written by verifier.make_trace for generated
     problems (a fresh trace each epoch), a tiny model from scratch, the compact prompt template.
  3. Periodic eval samples on the `val` split of --eval_data; evaluate.py owns the `test` split.

Real (1×H100, the paper's recipe = the defaults):
  python sft.py --output_dir out/sft
CPU (embedded): the `sft`, `teacher` and student stages of run_cpu.sh, which prints their exact commands.
"""
import math
import os
import random
import time
from dataclasses import dataclass

import torch
from transformers import get_cosine_schedule_with_warmup

from checkpoints import load_state, prepare_run, save_checkpoint, save_state, step_is_finite
from common import CountdownError, Logger, arg, autocast, cli, load_model, load_records, load_tasks, make_prompt, \
    parse_args, seed_everything, token_stats, tokenize_pairs
from evaluate import eval_metrics
from verifier import arith_text, make_trace


@dataclass
class Args:
    # shared by every script, in this order
    model: str = arg("Qwen/Qwen2.5-0.5B", "model to fine-tune: hub name, checkpoint dir, or `tiny` (from scratch)")
    data: str = arg("Asap7772/cog_behav_all_strategies", "SFT data: hub/JSONL with query+completion, gen[:...] "
                    "traces, or arith[:...] plain arithmetic over those problems' numbers (the base stage)")
    eval_data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks for periodic pass@k (its `val` split)")
    output_dir: str = arg("out/sft", "where the checkpoint, args.json and metrics.jsonl go")
    seed: int = arg(0, "seed for init, shuffling and sampling")
    template: str = arg("base", "prompt template for generated data and eval: base | compact")
    lr: float = arg(5e-5, "peak learning rate (000 Table 4)")
    batch_size: int = arg(512, "sequences per optimizer step (000 Table 4: 64 x 8 accumulation)")
    micro_batch: int = arg(64, "sequences per forward/backward; batch_size must be a multiple")
    weight_decay: float = arg(0.01, "AdamW weight decay (000 Table 4)")
    grad_clip: float = arg(1.0, "global grad-norm clip (000 Table 4)")
    max_prompt_len: int = arg(512, "prompts longer than this are an error (000 Table 4)")
    max_response_len: int = arg(1024, "responses are truncated to this, EOS then dropped (000 Table 4)")
    eval_every: int = arg(100, "steps between held-out evaluations (0: only at the end)")
    eval_problems: int = arg(200, "held-out problems per evaluation")
    eval_samples: int = arg(16, "samples per problem (pass@k up to this)")
    eval_max_new_tokens: int = arg(1024, "generation budget at evaluation")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward to save memory")
    wandb_project: str = arg("", "log to this wandb project too (off when empty)")
    save_every: int = arg(100, "steps between resumable states in OUTPUT_DIR/state (the newest 2 are kept)")
    resume: str = arg("", "continue the run saved in this dir from its newest state (it becomes --output_dir)")
    overwrite: bool = arg(False, "start again in a non-empty --output_dir (refused otherwise)")
    skip_nonfinite: bool = arg(False, "drop a step whose loss or gradient is NaN/inf instead of stopping the run")
    # SFT specific
    epochs: float = arg(6.0, "passes over the data (000 Table 4)")
    max_steps: int = arg(0, "stop after this many optimizer steps instead (0: use epochs)")
    warmup: float = arg(0.05, "warmup fraction of the cosine schedule (000 Table 4)")
    num_train: int = arg(0, "training problems: gen writes traces for this many (0: 20,000); a dataset keeps its "
                            "first rows (0: all)")
    dead_ends: float = arg(0.0, "gen data: mean number of abandoned tries before the one that finds the target")
    near_misses: float = arg(0.0, "gen data: share of dead ends that are near misses, the closest miss of 8 random "
                                  "paths (verifier.near_miss), instead of a random path")
    fixed_traces: bool = arg(False, "gen data: one trace per problem for the whole run, not a new one each epoch")
    tiny_hidden: int = arg(128, "tiny model: hidden size")
    tiny_layers: int = arg(4, "tiny model: transformer layers")


def sft_loss(logp, mask):
    """Eq. 1 summed over response tokens; logp, mask: (B, T-1). The caller divides by the token count
    of the whole optimizer step, so micro-batches of any padding add up to one token mean."""
    return -(logp * mask).sum()


def sft_data(args, split, n):
    """Prompts and a function rng -> responses: solver traces of generated problems (new ones each call:
    another solution path, other dead ends), plain arithmetic over their numbers (no prompt: the whole
    text is the target, 4 random paths a row), or a dataset's fixed query/completion pairs."""
    kind, _, spec = args.data.partition(":")
    if kind in ("gen", "arith"):
        tasks = load_tasks("gen:" + spec, split, n or 20_000)
        if kind == "arith":
            nums = [t["nums"] for t in tasks]
            return [""] * len(tasks), lambda rng: [arith_text(nums[i:i + 4], rng) for i in range(len(nums))]
        write = lambda rng: [make_trace(t["nums"], t["target"], rng, args.dead_ends, args.near_misses)  # noqa: E731
                             for t in tasks]
        fixed = write(random.Random(args.seed)) if args.fixed_traces else None
        return [make_prompt(t["nums"], t["target"], args.template) for t in tasks], lambda rng: fixed or write(rng)
    if os.path.exists(args.data):  # a file has no splits: its last rows (up to 10%) are the held-out set
        rows = load_records(args.data, "train", ["query", "completion"])
        k = min(args.eval_problems, len(rows) // 10)
        rows = rows[:len(rows) - k] if split == "train" else rows[len(rows) - k:]
    else:
        rows = load_records(args.data, "train" if split == "train" else "test", ["query", "completion"])
    rows = rows[:n or None]
    return [r["query"] for r in rows], lambda rng: [r["completion"] for r in rows]


def main(argv=None):
    args = parse_args(Args, argv)
    if args.batch_size % args.micro_batch:
        raise CountdownError(f"--batch_size {args.batch_size} is not a multiple of --micro_batch {args.micro_batch}")
    prepare_run(args)  # refuse to write over a run, or point --resume at one
    seed_everything(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(args.model, device, torch.float32, hidden_size=args.tiny_hidden,
                            num_hidden_layers=args.tiny_layers)  # fp32 master weights; bf16 compute via autocast
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    prompts, write_responses = sft_data(args, "train", args.num_train)
    val_prompts, write_val = sft_data(args, "val", args.eval_problems)  # disjoint from train by construction
    val_responses = write_val(random.Random(0))
    eval_tasks = load_tasks(args.eval_data, "val", args.eval_problems)
    rng = random.Random(args.seed)
    steps_per_epoch = max(1, len(prompts) // args.batch_size)
    total = args.max_steps or math.ceil(args.epochs * steps_per_epoch)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup * total), total)
    # --resume: weights, optimizer, schedule, RNGs and this epoch's order, so step start+1 is as if never stopped
    start, extra = load_state(args.output_dir, model, opt, sched, rng) if args.resume else (0, {})
    order, responses, skipped = extra.get("order", []), extra.get("responses", []), extra.get("skipped", 0)
    log = Logger(args.output_dir, total, args, args.wandb_project, start)
    print(f"{len(prompts)} training examples, {steps_per_epoch} steps/epoch, {total} steps, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    def micro_batches(ps, rs):
        """Tokenize a step's examples once, sort them by length (the step's loss is a sum, so order is free);
        yield micro-batches cut to their own longest row: little padding."""
        ids, attn, mask = tokenize_pairs(tok, ps, rs, args.max_prompt_len, args.max_response_len)
        by_len = attn.sum(1).argsort()                                                   # (B,)
        ids, attn, mask = ids[by_len], attn[by_len], mask[by_len]
        for s in range(0, len(ps), args.micro_batch):
            L = int(attn[s:s + args.micro_batch].sum(1).max())
            yield tuple(x[s:s + args.micro_batch, :L].to(device) for x in (ids, attn, mask))

    for step in range(start + 1, total + 1):
        t0 = time.time()
        # ---- batch: a fresh shuffle (and, for generated data, fresh traces) every epoch ----
        if len(order) < args.batch_size:
            order, responses = rng.sample(range(len(prompts)), len(prompts)), write_responses(rng)
        idx, order = order[:args.batch_size], order[args.batch_size:]
        # ---- forward / backward per micro-batch; the loss is a token mean over the whole step ----
        mbs = list(micro_batches([prompts[i] for i in idx], [responses[i] for i in idx]))
        n_tokens = sum(int(mask[:, 1:].sum()) for _, _, mask in mbs)
        loss_sum, correct = 0.0, 0.0
        for ids, attn, mask in mbs:
            with autocast(device, model):
                stats = token_stats(model, ids, attn, mask)
            nll = sft_loss(stats["logp"], mask[:, 1:])
            (nll / n_tokens).backward()
            loss_sum, correct = loss_sum + nll.item(), correct + stats["correct"].sum().item()
        loss = loss_sum / n_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if step_is_finite(step, loss, grad_norm, args):  # else stop, or with --skip_nonfinite drop the step
            opt.step()
        else:
            skipped += 1
        sched.step()
        opt.zero_grad(set_to_none=True)
        # ---- log, evaluate, checkpoint ----
        dt = time.time() - t0
        metrics = {"train/loss": loss, "train/token_acc": correct / n_tokens, "train/lr": sched.get_last_lr()[0],
                   "train/grad_norm": grad_norm, "train/skipped_steps": skipped, "time/step": dt,
                   "time/tokens_per_s": n_tokens / dt}
        if step == total or (args.eval_every and step % args.eval_every == 0):
            if val_prompts:  # held-out loss on responses of problems never trained on
                with torch.no_grad(), autocast(device, model):
                    val = [(sft_loss(token_stats(model, i, a, m)["logp"], m[:, 1:]).item(), int(m[:, 1:].sum()))
                           for i, a, m in micro_batches(val_prompts, val_responses)]
                metrics["eval/loss"] = sum(x for x, _ in val) / sum(n for _, n in val)
            if not args.data.startswith("arith"):  # a base model writes no answers yet: its eval is eval/loss
                metrics.update(eval_metrics(model, tok, eval_tasks, args))
            save_checkpoint(model, tok, args.output_dir)
        log.log(step, metrics)
        if step == total or step % args.save_every == 0:
            save_state(args.output_dir, step, model, opt, sched, rng, order=order, responses=responses, skipped=skipped)
    log.close()
    print(f"saved {args.output_dir}")
    return model


if __name__ == "__main__":
    cli(main)
