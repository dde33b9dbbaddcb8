"""GRPO: group-normalized advantages, a PPO-clipped ratio and a KL to a frozen reference (paper 004
§2 Eq. 1-2; paper 002 §3 Eq. 1 and its Countdown recipe).

    A_i = (r_i − mean_j r_j) / (std_j r_j + ε)                              (004 Eq. 2; Dr. GRPO: no std)
    l_it = min(ρ_it A_i, clip(ρ_it, 1−ε_lo, 1+ε_hi) A_i) − β D_KL(π_θ ‖ π_ref),   ρ_it = π_θ(o_it)/π_old(o_it)
    L = −agg(l):  seq-mean 1/G Σ_i 1/|o_i| Σ_t (DeepSeekMath, 004)  |  token-mean 1/Σ|o_i| Σ_i Σ_t
                  (DAPO; 002 Eq. 1)  |  constant 1/(G·L_max) Σ_i Σ_t (Dr. GRPO)
seq-mean gives each rollout the same weight, so a token of a long wrong answer is pushed down less than
one of a short one: it prefers long failures. token-mean and constant give every token the same weight.
π_θ and π_old in ρ are both softmax(logits / T) at the rollout temperature (as TRL): the policy that sampled.
D_KL is k3 times ρ (TRL's use_bias_correction_kl), whose gradient is that of KL(π_θ ‖ π_ref) as Eq. 1
writes it; --no-kl_ratio is DeepSeekMath's plain k3, whose gradient is that of KL(π_ref ‖ π_θ).
Defaults are 002's Countdown recipe (16 x 16, lr 5e-6, β 0.001, T 1.5); 004's values are in each --help.
Departures from the papers:
  1. With `--num_iterations 1` (DeepSeekMath's μ = 1) and the HF sampler ρ = 1: clipping only acts from
     the second pass over a batch on. Only 002's temperature of its exploration knobs is here.
  2. No LoRA (002 trains rank 8): full fine-tuning.
  3. Embedded setting: generated tasks, a tiny model, 64 prompts x 8, lr 1e-4, 20 steps, and a wrong answer
     rewarded -0.5, not 0.1: with 160 tokens the 0.1 pays for claiming "found" falsely (docs/arithmetic.md).

Real (1×H100, the defaults):  python grpo.py --init out/sft --backend vllm --output_dir out/grpo
CPU (embedded): the `grpo` stage of run_cpu.sh, which prints its exact command.
"""
import copy
import random
import time
from dataclasses import dataclass

import torch

from checkpoints import load_state, prepare_run, save_checkpoint, save_state, step_is_finite
from common import CountdownError, Logger, arg, autocast, cli, load_model, load_tasks, parse_args, \
    seed_everything, token_stats, warmup_lr
from evaluate import eval_metrics
from sampler import make_sampler, rollout_batch, rollouts, score_rollouts


@dataclass
class Args:
    # shared by every script, in this order
    init: str = arg("out/sft", "checkpoint to start from (the SFT model); also the frozen reference")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks whose prompts are rolled out (its train split)")
    eval_data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks for periodic pass@k (its `val` split)")
    output_dir: str = arg("out/grpo", "where the checkpoint, args.json and metrics.jsonl go")
    seed: int = arg(0, "seed for task order and sampling")
    template: str = arg("base", "prompt template: base | compact")
    lr: float = arg(5e-6, "constant learning rate (002 §5.1: higher was unstable; 004 Table 6: 1e-6)")
    warmup_steps: int = arg(0, "linear lr warm-up over this many steps, then constant (0: none, as the paper)")
    batch_size: int = arg(16, "prompts per step; each gets --group_size rollouts (002 §5.1: 16 x 16; 004 Table 6: 4 x 64)")
    micro_batch: int = arg(16, "rollouts per forward/backward (bounds memory)")
    weight_decay: float = arg(0.0, "AdamW weight decay (002 gives none; 004 Table 6: 0)")
    grad_clip: float = arg(1.0, "global grad-norm clip (004 Table 6)")
    max_prompt_len: int = arg(512, "prompts longer than this are an error")
    max_response_len: int = arg(1024, "rollout budget in new tokens (002 §4-5.1: 1024; shorter truncates good answers)")
    eval_every: int = arg(50, "steps between held-out evaluations (0: only at start and end)")
    eval_problems: int = arg(200, "held-out problems per evaluation")
    eval_samples: int = arg(16, "samples per problem (pass@k up to this)")
    eval_max_new_tokens: int = arg(1024, "generation budget at evaluation")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward to save memory")
    wandb_project: str = arg("", "log to this wandb project too (off when empty)")
    save_every: int = arg(25, "steps between resumable states in OUTPUT_DIR/state (the newest 2 are kept)")
    resume: str = arg("", "continue the run saved in this dir from its newest state (it becomes --output_dir)")
    overwrite: bool = arg(False, "start again in a non-empty --output_dir (refused otherwise)")
    skip_nonfinite: bool = arg(False, "drop a step whose loss or gradient is NaN/inf instead of stopping the run")
    # on-policy RL, shared by rloo/grpo/opd/rlt
    max_steps: int = arg(200, "rollout batches, --num_iterations optimizer steps each (002 §5.1: its best within 200; "
                              "004 Table 6: 250)")
    group_size: int = arg(16, "G rollouts per prompt (002 §5.1: 16; 004 Table 6: 64)")
    temperature: float = arg(1.5, "rollout temperature; log-probs are of logits / T (002 Table 1: 1.5 its best, "
                                  "0.6 its default before; 004 Table 6: 0.7); top_p 1, no top_k")
    reward: str = arg("sparse", "sparse: verifier.score 1/0.1/0 (000) | dense: partial credit for near misses (001)")
    wrong_reward: float = arg(0.1, "sparse reward of a wrong answer (000: 0.1); 0 or below when the budget cuts many "
                                   "searches short, or the 0.1 pays for claiming success falsely (docs/arithmetic.md)")
    backend: str = arg("hf", "sampler: hf (plain PyTorch, CPU ok) | vllm (GPU; pinned in sampler.py)")
    # GRPO specific
    beta: float = arg(0.001, "β, weight of the KL to the frozen reference (002 §5.2: 0.001; 004 Table 6: 0.04; "
                             "0: no reference)")
    kl_ratio: bool = arg(True, "k3 times ρ: the gradient of KL(π_θ‖π_ref) (--no-kl_ratio: DeepSeekMath's k3, KL(π_ref‖π_θ)'s)")
    epsilon: float = arg(0.2, "PPO clip ε: ρ is kept within [1−ε, 1+ε_high] (DeepSeekMath and TRL: 0.2)")
    epsilon_high: float = arg(0.0, "upper clip ε_high (DAPO's clip-higher: 0.28); 0 = same as --epsilon")
    num_iterations: int = arg(1, "optimizer steps per rollout batch, each over the whole batch (DeepSeekMath's μ)")
    scale_rewards: bool = arg(True, "divide by the group's reward std (--no-scale_rewards: Dr. GRPO)")
    loss_agg: str = arg("token-mean", "seq-mean (DeepSeekMath) | token-mean (DAPO, 002 Eq. 1) | constant (Dr. GRPO)")
    mask_truncated: bool = arg(False, "leave rollouts cut at --max_response_len out of the loss (002 §3)")
    ref_sync_every: int = arg(0, "every N steps move π_ref toward π_θ (002: never, 0; 004 Table 6: 32)")
    ref_sync_mix: float = arg(0.9, "π_ref ← mix · π_θ + (1 − mix) · π_ref at a sync (004 Table 6: 0.9)")


def grpo_advantages(reward, scale=True, eps=1e-4):
    """004 Eq. 2. reward (B, G) -> A (B, G): centered within each group, and divided by the group's
    (unbiased) std unless `scale` is off; a group of equal rewards gets A = 0 either way."""
    centered = reward - reward.mean(1, keepdim=True)                                  # (B, G)
    return centered / (reward.std(1, keepdim=True) + eps) if scale else centered


def k3_kl(logp, other_logp, sample_logp=None):
    """Schulman's k3 = r − 1 − log r, r = other/π_θ, per token (b, T-1) -> (b, T-1); never negative.
    On tokens from π_θ its value estimates KL(π_θ ‖ other), but as a loss its gradient is KL(other ‖ π_θ)'s.
    With `sample_logp`, the log-probs of the policy π_old that drew the tokens, k3 is multiplied by the
    differentiable ratio ρ = π_θ/π_old (TRL's use_bias_correction_kl): over π_old's tokens its expectation
    is then KL(π_θ ‖ other) and its gradient that KL's, exactly (tests/test_rl.py checks both)."""
    log_r = other_logp - logp
    k3 = log_r.exp() - 1 - log_r
    return k3 if sample_logp is None else (logp - sample_logp).exp() * k3


def grpo_loss(logp, old_logp, ref_logp, adv, args):
    """Per-token −l_it (b, T-1). logp, old_logp (π_old = the sampler), ref_logp (None if β = 0): (b, T-1);
    adv: (b,). Where the clipped term wins the min, the token has no gradient: `clipped` marks it."""
    eps_hi = args.epsilon_high or args.epsilon
    ratio = (logp - old_logp).exp()                                                    # (b, T-1) ρ_it
    A = adv[:, None]                                                                   # (b, 1)
    surrogate = torch.min(ratio * A, ratio.clamp(1 - args.epsilon, 1 + eps_hi) * A)
    kl = torch.zeros_like(logp) if ref_logp is None else \
        k3_kl(logp, ref_logp, old_logp if args.kl_ratio else None)                     # (b, T-1) D_KL, Eq. 1
    clipped = ((ratio > 1 + eps_hi) & (A > 0)) | ((ratio < 1 - args.epsilon) & (A < 0))
    return -surrogate + args.beta * kl, {"kl": kl, "ratio": ratio.detach(), "clipped": clipped.float()}


def aggregate(per_token, mask, mode, n_rows, n_tokens, max_len):
    """This micro-batch's share of the batch loss, so that micro-batches add up to the docstring's L.
    per_token, mask: (b, T-1); n_rows, n_tokens: rollouts and response tokens in the whole batch."""
    if mode == "seq-mean":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_rows
    if mode == "token-mean":
        return (per_token * mask).sum() / max(n_tokens, 1)
    return (per_token * mask).sum() / (n_rows * max_len)                               # constant


def main(argv=None):
    args = parse_args(Args, argv)
    seed_everything(args.seed)
    if args.reward not in ("sparse", "dense"):
        raise CountdownError(f"--reward must be sparse or dense, not {args.reward!r}")
    if args.loss_agg not in ("seq-mean", "token-mean", "constant"):
        raise CountdownError(f"--loss_agg must be seq-mean, token-mean or constant, not {args.loss_agg!r}")
    if args.group_size < 2:
        raise CountdownError("--group_size must be at least 2: the advantage compares rollouts of one prompt")
    prepare_run(args)  # refuse to write over a run, or point --resume at one
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(args.init, device, torch.float32)  # fp32 master weights; bf16 compute via autocast
    ref = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None  # π_ref: the frozen init
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    tasks, eval_tasks = load_tasks(args.data, "train"), load_tasks(args.eval_data, "val", args.eval_problems)
    sampler = make_sampler(args.backend, model, tok, args.init, args.seed, args.max_prompt_len + args.max_response_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)  # constant lr
    B, G, rng, order = args.batch_size, args.group_size, random.Random(args.seed), []
    # --resume: weights, optimizer, RNGs, the moving reference and the data order: step start+1 as if never stopped
    start, extra = load_state(args.output_dir, model, opt, rng=rng, ref=ref) if args.resume else (0, {})
    order, skipped = extra.get("order", []), extra.get("skipped", 0)
    log = Logger(args.output_dir, args.max_steps, args, args.wandb_project, start)
    if not start:
        log.log(0, eval_metrics(model, tok, eval_tasks, args, sampler))  # where the init starts
    for step in range(start + 1, args.max_steps + 1):
        t0 = time.time()
        lr = warmup_lr(opt, args.lr, step, args.warmup_steps)
        # ---- sample: B prompts x G rollouts from the snapshot π_old ----
        if len(order) < B:
            order = rng.sample(range(len(tasks)), len(tasks))
        batch, order = [tasks[i] for i in order[:B]], order[B:]
        ro = rollouts(sampler, model, tok, batch, G, args, seed=args.seed * 100_003 + step)
        t_sample = time.time() - t0
        # ---- score and advantage ----
        exact, reward = score_rollouts(ro, batch, args.reward, args.wrong_reward)  # (B*G,), (B, G)
        adv = grpo_advantages(reward, args.scale_rewards).flatten()                    # (B*G,)
        keep = torch.tensor(ro.finished, dtype=torch.float32) if args.mask_truncated else torch.ones(B * G)
        n_tok = sum(len(c) for c, k in zip(ro.completion_ids, keep.tolist()) if k)     # tokens in the loss
        # ---- num_iterations passes over the batch, forward / backward per micro-batch ----
        by_len = sorted(range(B * G), key=lambda r: len(ro.completion_ids[r]))  # micro-batches of like lengths: little padding
        sums = {k: 0.0 for k in ("loss", "entropy", "kl", "ratio", "clip_frac")}
        gap, w_max, ref_cache, grad_norms = 0.0, 0.0, {}, []
        for it in range(args.num_iterations):
            for s in range(0, B * G, args.micro_batch):
                rows = by_len[s:s + args.micro_batch]
                ids, attn, mask, old_logp = (x.to(device) for x in rollout_batch(ro, rows, tok.pad_token_id))
                m = mask[:, 1:].float() * keep[rows, None].to(device)                  # (b, T-1)
                with autocast(device, model, ref):
                    st = token_stats(model, ids, attn, mask, temperature=args.temperature, entropy=True)  # logits / T
                    if ref is not None and s not in ref_cache:  # π_ref does not move within a batch
                        with torch.no_grad():
                            ref_cache[s] = token_stats(ref, ids, attn, mask, temperature=args.temperature)["logp"]
                per_token, parts = grpo_loss(st["logp"], old_logp, ref_cache.get(s), adv[rows].to(device), args)
                loss = aggregate(per_token, m, args.loss_agg, B * G, n_tok, args.max_response_len)
                loss.backward()
                sums["loss"] += loss.item()
                for k, v in (("entropy", st["entropy"]), ("kl", parts["kl"]), ("ratio", parts["ratio"]),
                             ("clip_frac", parts["clipped"])):
                    sums[k] += (v.detach() * m).sum().item() / max(n_tok, 1)  # token means over the batch
                if it == 0:
                    gap += ((st["logp"].detach() - old_logp).abs() * m).sum().item()  # the weight-sync canary
                w_max = max(w_max, (parts["ratio"] * m).max().item())
            grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item())
            if step_is_finite(step, sums["loss"], grad_norms[-1], args):  # else stop, or --skip_nonfinite drops it
                opt.step()
            else:
                skipped += 1
            opt.zero_grad(set_to_none=True)
        if ref is not None and args.ref_sync_every and step % args.ref_sync_every == 0:
            with torch.no_grad():  # 004: a slowly moving reference instead of a frozen one
                for p_ref, p in zip(ref.parameters(), model.parameters()):
                    p_ref.mul_(1 - args.ref_sync_mix).add_(p, alpha=args.ref_sync_mix)
        # ---- log (001's flatline diagnostics), evaluate, checkpoint ----
        group_std = reward.std(1)                                                      # (B,) within-group spread
        metrics = {f"train/{k}": v / args.num_iterations for k, v in sums.items()}
        metrics.update({"train/reward": reward.mean(), "train/accuracy": (exact == 1).float().mean(),
                        "train/reward_std": group_std.mean(), "train/adv_std": adv.std(),
                        "train/zero_adv_groups": (group_std == 0).float().mean(),
                        "train/resp_len": sum(map(len, ro.completion_ids)) / (B * G),
                        "train/truncated": 1 - sum(ro.finished) / (B * G), "train/format": (exact > 0).float().mean(),
                        "train/ratio_max": w_max, "train/sampler_gap": gap / max(n_tok, 1), "train/lr": lr,
                        "train/grad_norm": sum(grad_norms) / len(grad_norms), "train/skipped_steps": skipped,
                        "time/sample": t_sample, "time/update": time.time() - t0 - t_sample, "time/step": time.time() - t0})
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            metrics.update(eval_metrics(model, tok, eval_tasks, args, sampler))
            save_checkpoint(model, tok, args.output_dir)
        log.log(step, metrics)
        if step == args.max_steps or step % args.save_every == 0:
            save_state(args.output_dir, step, model, opt, rng=rng, ref=ref, order=order, skipped=skipped)
    log.close()
    print(f"saved {args.output_dir}")
    return model, ref


if __name__ == "__main__":
    cli(main)
