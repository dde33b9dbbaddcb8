"""SFT: supervised warm start on reasoning traces (paper 000 §3.2, Eq. 1; Table 4 recipe).

    L(θ) = − Σ_t 1[resp_t] · log π_θ(y_t | y_<t, x)  /  Σ_t 1[resp_t]                        (Eq. 1)

Only response tokens count (EOS included: the model must learn to stop); the prompt conditions.
Departures from the paper:
  1. The loss is averaged over the response tokens of the whole effective batch (Eq. 1 is a sum).
  2. Embedded setting: `--data gen:...` trains on traces written by traces.make_trace for
     generated problems (a fresh trace each epoch), a tiny model from scratch, the compact prompt
     template.
  3. Periodic eval samples on the `val` split of --eval_data; evaluate.py owns the `test` split.

Real (1×H100, the paper's recipe = the defaults):
  python sft.py --init Qwen/Qwen2.5-0.5B --output_dir out/sft
CPU (embedded): the `sft`, `teacher` and student stages of run_cpu.sh (it prints the commands).
"""
import math
import random
import time
from dataclasses import dataclass
from functools import partial

import torch
from transformers import (get_cosine_schedule_with_warmup,
                          get_cosine_with_min_lr_schedule_with_warmup)

from common import autocast, data_parallel, spans, token_stats, tokenize_pairs
from evaluate import eval_metrics
from plumbing.flags import CountdownError, TrainArgs, arg, cli, parse_args, seed_everything
from plumbing.harness import Run, load_policy, prepare_run
from plumbing.tasks import (LLM_MISTAKES, common_queries, load_tasks, only_problems, parse_mixes,
                            sft_data, teacher_sft_data)


@dataclass
class Args(TrainArgs):
    # shared, with this script's defaults (000 Table 4)
    init: str = arg("Qwen/Qwen2.5-0.5B",
                    "model to fine-tune: hub name, checkpoint dir, or `tiny` (from scratch)")
    data: str = arg("Asap7772/cog_behav_all_strategies",
                    "SFT data: hub/JSONL with query+completion, gen[:...] traces, arith[:...] "
                    "plain arithmetic over those problems' numbers (the base stage), or "
                    "rlt:SPEC|FILE.jsonl RLT's teacher format warm-up (004 §A.1) on solver traces "
                    "or on a file's samples (plumbing/tasks.py: teacher_sft_data)")
    output_dir: str = arg("out/sft", "where the checkpoint, args.json and metrics.jsonl go")
    seed: int = arg(0, "seed for init, shuffling and sampling")
    template: str = arg("base", "prompt template for generated data and eval: base | compact")
    lr: float = arg(5e-5, "peak learning rate (000 Table 4)")
    batch_size: int = arg(512, "sequences per optimizer step (000 Table 4: 64 x 8 accumulation)")
    micro_batch: int = arg(64, "sequences per forward/backward; batch_size must be a multiple")
    weight_decay: float = arg(0.01, "AdamW weight decay (000 Table 4)")
    max_prompt_len: int = arg(512, "prompts longer than this are an error (000 Table 4)")
    max_response_len: int = arg(1024,
                                "responses are truncated to this, EOS then dropped (000 Table 4)")
    eval_every: int = arg(100, "steps between held-out evaluations (0: only at the end)")
    save_every: int = arg(100, "steps between resumable states in OUTPUT_DIR/state (the newest 2 "
                               "are kept)")
    # SFT specific
    epochs: float = arg(6.0, "passes over the data (000 Table 4)")
    max_steps: int = arg(0, "stop after this many optimizer steps instead (0: use epochs)")
    micro_batch_tokens: int = arg(16384, "a micro-batch's most padded tokens too: its longest "
                                         "rows go fewer at a time (0: rows alone)")
    warmup: float = arg(0.05, "warmup fraction of the cosine schedule (000 Table 4)")
    final_lr: float = arg(0.0, "the cosine schedule's last lr (000 Table 4: 0; 004 Table 5, the "
                               "student recipe: 1e-6)")
    num_train: int = arg(0, "training problems: gen writes traces for this many (0: 20,000); a "
                            "dataset keeps its first rows (0: all)")
    problems: str = arg("", "comma-separated JSONL files: train only on the problems all of them "
                            "train on (students of other sources on the same problems, 004 §4)")
    dead_ends: float = arg(0.0, "gen data: mean number of abandoned tries before the one that "
                                "finds the target")
    near_misses: float = arg(0.0, "gen data: share of dead ends that are near misses, the closest "
                                  "miss of 8 random paths (traces.near_miss), instead of a "
                                  "random path")
    strategies: str = arg("random", "gen data: the traces' search strategies and weights, e.g. "
                                    "'random:0.7,backward:0.3' (traces.STRATEGIES)")
    mistakes: str = arg(LLM_MISTAKES, "gen data: the unverified source, the analog of LLM-written "
                                      "traces: each trace carries mistake KIND with probability "
                                      "RATE (traces.MISTAKES); the default leaves ~37 %% correct, "
                                      "as in the real SFT set; 'none': the solver's own traces")
    verified: bool = arg(False, "gen data: paper 001's verification gate: drop every trace the "
                                "scorer rejects (of the default source, ~37 %% stay)")
    fixed_traces: bool = arg(False, "gen data: one trace per problem for the whole run, not a new "
                                    "one each epoch")
    rebuild_prompts: bool = arg(False, "a dataset's queries rebuilt in --template from the numbers "
                                       "and target each names (else one that differs is an error)")
    compile: bool = arg(False, "torch.compile the training forward (dynamic shapes): a first "
                               "compile of ~2 min, ~20 s from inductor's cache; then steps 1.25x "
                               "faster here (docs/studies/performance.md). SFT only: the RL scripts' "
                               "per-term gradients need a backward that keeps the graph, where "
                               "the compiled one failed or disagreed with eager")
    tiny_hidden: int = arg(128, "tiny model: hidden size")
    tiny_layers: int = arg(4, "tiny model: transformer layers")



def sft_loss(logp, mask):
    """Eq. 1 summed over response tokens; logp, mask: (B, T-1). The caller divides by the token
    count of the whole optimizer step, so micro-batches of any padding add up to one token mean."""
    return -(logp * mask).sum()


def micro_batches(tok, prompts, responses, size, max_prompt_len, max_response_len, device,
                  max_tokens=0):
    """Tokenize a step's examples once, sort them by length (the step's loss is a sum, so order is
    free), and yield micro-batches (input_ids, attention_mask, response mask) cut to their own
    longest row. A None response (a trace the verification gate dropped) drops its row."""
    keep = [i for i, r in enumerate(responses) if r is not None]
    prompts, responses = [prompts[i] for i in keep], [responses[i] for i in keep]
    ids, attn, mask = tokenize_pairs(tok, prompts, responses, max_prompt_len, max_response_len)
    by_len = attn.sum(1).argsort()                                                       # (B,)
    ids, attn, mask = ids[by_len], attn[by_len], mask[by_len]
    for s, e in spans(attn.sum(1), size, max_tokens):  # up to `size` rows and max_tokens tokens
        L = int(attn[s:e].sum(1).max())
        yield tuple(x[s:e, :L].to(device) for x in (ids, attn, mask))


def evaluation(model, tok, val_batches, eval_fn):
    """eval/loss on held-out responses of problems never trained on, and the sampled eval/ metrics
    (`eval_fn`, None for a base model that writes no answers yet)."""
    metrics = {}
    if val_batches:
        with torch.no_grad(), autocast(model.device.type, model):
            val = [(sft_loss(token_stats(model, i, a, m)["logp"],
                             m[:, 1:]).item(), int(m[:, 1:].sum())) for i, a, m in val_batches()]
        metrics["eval/loss"] = sum(x for x, _ in val) / sum(n for _, n in val)
    return {**metrics, **(eval_fn() if eval_fn else {})}


def main(argv=None):
    args = parse_args(Args, argv)
    if args.batch_size % args.micro_batch:
        raise CountdownError(f"--batch_size {args.batch_size} is not a multiple of --micro_batch "
                             f"{args.micro_batch}")
    mix, mistakes = parse_mixes(args.strategies, args.mistakes)  # one line for a bad mix
    output_dir = prepare_run(args.output_dir, args.resume, args.overwrite)  # never over a done run
    seed_everything(args.seed)
    model, tok, device = load_policy(args.init, **args.policy_options(), compile=args.compile,
                                     hidden_size=args.tiny_hidden,
                                     num_hidden_layers=args.tiny_layers)
    world = data_parallel(model, args.fsdp, args.batch_size)  # torchrun's N ranks, else 1
    if args.data.startswith("rlt"):  # 004 §A.1: RLT's teacher format, the solution in the prompt
        data = partial(teacher_sft_data, args.data, template=args.template,
                       eval_problems=args.eval_problems, seed=args.seed, dead_ends=args.dead_ends,
                       near_misses=args.near_misses, mix=mix)
    else:
        data = partial(sft_data, args.data, template=args.template,
                       eval_problems=args.eval_problems, dead_ends=args.dead_ends,
                       near_misses=args.near_misses, fixed_traces=args.fixed_traces, seed=args.seed,
                       mix=mix, mistakes=mistakes, verified=args.verified,
                       rebuild=args.rebuild_prompts)
    prompts, write_responses = data("train", args.num_train)
    if args.problems:  # a file's training rows: all but its held-out tail, as sft_data splits it
        prompts, write_responses = only_problems(prompts, write_responses, common_queries(
            args.problems.split(","), args.eval_problems))
    val_prompts, write_val = data("val", args.eval_problems)  # disjoint from train by construction
    batches = partial(micro_batches, tok, size=args.micro_batch, max_prompt_len=args.max_prompt_len,
                      max_response_len=args.max_response_len, device=device,
                      max_tokens=args.micro_batch_tokens)
    val_batches = val_prompts and partial(batches, val_prompts, write_val(random.Random(0)))
    eval_tasks = load_tasks(args.eval_data, "val", args.eval_problems)
    eval_fn = None if args.data.startswith("arith") else partial(  # a base model writes no answers
        eval_metrics, model, tok, eval_tasks, args.eval_samples, args.eval_max_new_tokens,
        args.template, args.seed, decode=args.decode)
    steps_per_epoch = max(1, math.ceil(len(prompts) / args.batch_size))  # a last partial batch too
    total = args.max_steps or math.ceil(args.epochs * steps_per_epoch)
    warmup = math.ceil(round(args.warmup * total, 6))  # at least one step when asked for
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # cosine from lr down to final_lr (0: transformers' plain cosine)
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt, warmup, total, min_lr=args.final_lr) if args.final_lr else \
        get_cosine_schedule_with_warmup(opt, warmup, total)
    run = Run(output_dir, total, model, tok, opt, sched=sched, **args.run_options(output_dir))
    evaluate = partial(evaluation, model, tok, val_batches, eval_fn)  # nothing to show at step 0
    responses = run.extra.get("responses", [])
    print(f"{len(prompts)} training examples, {steps_per_epoch} steps/epoch, {total} steps, "
          f"{len(set(prompts))} problems, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          "parameters")
    for step in run.steps():  # from run.start + 1: a resumed run goes on where its state ends
        # ---- batch: a fresh shuffle (and, for generated data, fresh traces) every epoch ----
        idx, new_epoch = run.next_indices(range(len(prompts)), args.batch_size // world)  # rank's
        if new_epoch:
            responses = write_responses(run.rng)
        micro = list(batches([prompts[i] for i in idx], [responses[i] for i in idx]))
        # ---- forward / backward per micro-batch; Eq. 1's token mean over the whole step ----
        stats = run.stats(len(idx), sum(int(mask[:, 1:].sum()) for _, _, mask in micro))
        for ids, attn, mask in micro:
            with autocast(device, model):
                out = token_stats(model, ids, attn, mask)
            nll = sft_loss(out["logp"], mask[:, 1:])
            (nll / stats.n_tokens).backward()  # torchrun: DDP's mean over ranks, the step's too
            stats.add("loss", nll.item())  # Eq. 1's numerator: metrics() divides by the tokens
            stats.add("token_acc", out["correct"].sum().item())
        # ---- the update: clip, the non-finite stop, step, the schedule ----
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if run.finite(step, stats.sums["loss"] / stats.n_tokens, grad_norm):  # else stop (or skip)
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        # ---- log, evaluate, checkpoint ----
        metrics = {**stats.metrics(per_token=True),  # Eq. 1's token mean, every rank's tokens
                   "time/tokens_per_s": stats.n_tokens * world / (time.time() - run.t0)}
        if step == total or (args.eval_every and step % args.eval_every == 0):
            run.checkpoint()  # first: an evaluation that fails loses nothing
            metrics.update(evaluate())
        run.log(step, metrics)
        if step == total or step % args.save_every == 0:  # what --resume restarts from
            run.save(step, responses=responses)
    run.close()
    return model


if __name__ == "__main__":
    cli(main)
