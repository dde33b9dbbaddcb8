"""RLOO: REINFORCE with a leave-one-out baseline on the verifier's reward (paper 000 §3.2, Eq. 3; Table 5).

    A_i = R_i − 1/(G−1) Σ_{j≠i} R_j          L_PG = −(1/G) Σ_i w_i A_i log π_θ(y_i|x)           (Eq. 3)
    w_i = clip(exp(log π_θ(y_i) − log μ(y_i)), max 10), detached;    L = L_PG − λ_H H(π_θ) + λ_KL KL(π_θ‖μ)

The other G−1 rollouts of the same prompt are the baseline: no critic, and a group the policy always
or never solves gives A = 0 (paper 001's "flatline"; `--reward dense` gives near misses partial credit).
log π_θ and log μ are both of the distribution that sampled, softmax(logits / T) (as TRL does), so at
T ≠ 1 the update trains the policy that drew the rollouts. `train/is_weight_raw` is w before its clip:
the number paper 000 (App. B) watches drift to ~12.4 in its anti-collapse run.
Departures from the paper:
  1. The paper names no estimator or direction for the KL to the sampler μ. We use k3 (001 §3.1.4) times
     the differentiable ratio π_θ/μ: on μ's tokens its gradient is exactly KL(π_θ‖μ)'s (--no-kl_ratio:
     plain k3, whose gradient is neither KL's once μ lags). With the HF sampler μ *is* the policy, so
     w = 1 and the term is ~0 (bf16 rounding aside); it acts with vLLM's snapshot or a slower sync.
  2. The entropy bonus is the full-vocabulary entropy, averaged over each response's tokens.
  3. Embedded setting: generated tasks, a tiny model, 64 prompts x 8, lr 1e-4, 20 steps, and a wrong answer
     rewarded -0.5, not 0.1: with 160 tokens the 0.1 pays for claiming "found" falsely (docs/arithmetic.md).

Real (1×H100, the paper's recipe = the defaults):  python rloo.py --init out/sft --backend vllm --output_dir out/rloo
CPU (embedded): the `rloo` stage of run_cpu.sh, which prints its exact command.
"""
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
    init: str = arg("out/sft", "checkpoint to start from (the SFT model)")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks whose prompts are rolled out (its train split)")
    eval_data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks for periodic pass@k (its `val` split)")
    output_dir: str = arg("out/rloo", "where the checkpoint, args.json and metrics.jsonl go")
    seed: int = arg(0, "seed for task order and sampling")
    template: str = arg("base", "prompt template: base | compact")
    lr: float = arg(1e-5, "constant learning rate (000 Table 5)")
    warmup_steps: int = arg(0, "linear lr warm-up over this many steps, then constant (0: none, as the paper)")
    batch_size: int = arg(128, "prompts per step; each gets --group_size rollouts (000 Table 5: 128 x 8)")
    micro_batch: int = arg(8, "rollouts per forward/backward (001: one group; bounds memory)")
    weight_decay: float = arg(1e-4, "AdamW weight decay (000 Table 5)")
    grad_clip: float = arg(1.0, "global grad-norm clip (000 Table 5)")
    max_prompt_len: int = arg(512, "prompts longer than this are an error")
    max_response_len: int = arg(1024, "rollout budget in new tokens (000 Table 5)")
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
    max_steps: int = arg(200, "optimizer steps, one rollout batch each (000 Table 5)")
    group_size: int = arg(8, "G rollouts per prompt (000 Table 5)")
    temperature: float = arg(1.0, "rollout temperature; log-probs are of logits / T (000 Table 5: 1.0; top_p 1, no top_k)")
    reward: str = arg("sparse", "sparse: verifier.score 1/0.1/0 (000) | dense: partial credit for near misses (001)")
    wrong_reward: float = arg(0.1, "sparse reward of a wrong answer (000: 0.1); 0 or below when the budget cuts many "
                                   "searches short, or the 0.1 pays for claiming success falsely (docs/arithmetic.md)")
    backend: str = arg("hf", "sampler: hf (plain PyTorch, CPU ok) | vllm (GPU; pinned in sampler.py)")
    # RLOO specific
    entropy_coef: float = arg(1e-3, "λ_H, entropy bonus (000: 1e-3; anti-collapse 1e-2; it acts near 1 here: README)")
    kl_coef: float = arg(1e-3, "λ_KL, KL penalty to the sampling policy μ (000 Table 5)")
    is_clip: float = arg(10.0, "w_max, clip of the sequence importance weight π_θ/μ (000 Table 5)")
    kl_ratio: bool = arg(True, "k3 times the ratio π_θ/μ: the gradient of KL(π_θ‖μ) (--no-kl_ratio: plain k3)")


def rloo_advantages(reward):
    """Eq. 3's leave-one-out baseline. reward (B, G) -> A (B, G): each rollout minus the mean of the
    other G−1 of its prompt. Equal to G/(G−1) · (R_i − mean_j R_j), so every group sums to zero."""
    G = reward.shape[1]
    baseline = (reward.sum(1, keepdim=True) - reward) / (G - 1)                       # (B, G)
    return reward - baseline


def importance_weights(logp_seq, old_seq, clip):
    """w_i = clip(π_θ(y_i)/μ(y_i), max `clip`) on whole sequences, detached: it rescales the gradient
    of a rollout the snapshot μ sampled, it is not itself optimized. (b,), (b,) -> clipped w, raw w (b,)"""
    raw = (logp_seq - old_seq).detach().exp()
    return raw.clamp(max=clip), raw


def k3_kl(logp, other_logp, sample_logp=None):
    """Schulman's k3 = r − 1 − log r, r = other/π_θ, per token (b, T-1) -> (b, T-1); never negative.
    On tokens from π_θ its value estimates KL(π_θ ‖ other), but as a loss its gradient is KL(other ‖ π_θ)'s.
    With `sample_logp`, the log-probs of the policy μ that drew the tokens, k3 is multiplied by the
    differentiable ratio π_θ/μ (TRL's use_bias_correction_kl): over μ's tokens its expectation is then
    KL(π_θ ‖ other) and its gradient that KL's, exactly (tests/test_rl.py checks both on a categorical)."""
    log_r = other_logp - logp
    k3 = log_r.exp() - 1 - log_r
    return k3 if sample_logp is None else (logp - sample_logp).exp() * k3


def rloo_loss(logp, old_logp, entropy, mask, adv, args):
    """Eq. 3 plus the entropy bonus and the KL to μ, per rollout (b,). logp, old_logp (sampler μ),
    entropy, mask: (b, T-1); adv: (b,). The caller sums and divides by B·G: −(1/G) Σ_i, mean over prompts."""
    n_tok = mask.sum(-1).clamp(min=1)                                                  # (b,)
    logp_seq, old_seq = (logp * mask).sum(-1), (old_logp * mask).sum(-1)               # (b,) log π(y_i|x)
    w, w_raw = importance_weights(logp_seq, old_seq, args.is_clip)
    pg = -w * adv * logp_seq                                                           # (b,) Eq. 3
    ent = (entropy * mask).sum(-1) / n_tok                                             # (b,) mean token entropy
    kl_tok = k3_kl(logp, old_logp, old_logp if args.kl_ratio else None)                # (b, T-1) KL(π_θ‖μ)
    kl = (kl_tok * mask).sum(-1) / n_tok                                               # (b,)
    loss = pg - args.entropy_coef * ent + args.kl_coef * kl
    return loss, {"entropy": entropy.detach(), "kl": kl_tok.detach(), "is_weight": w, "is_weight_raw": w_raw}


def main(argv=None):
    args = parse_args(Args, argv)
    seed_everything(args.seed)
    if args.reward not in ("sparse", "dense"):
        raise CountdownError(f"--reward must be sparse or dense, not {args.reward!r}")
    if args.group_size < 2:
        raise CountdownError("--group_size must be at least 2: the baseline is the other rollouts of the prompt")
    prepare_run(args)  # refuse to write over a run, or point --resume at one
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(args.init, device, torch.float32)  # fp32 master weights; bf16 compute via autocast
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    tasks, eval_tasks = load_tasks(args.data, "train"), load_tasks(args.eval_data, "val", args.eval_problems)
    sampler = make_sampler(args.backend, model, tok, args.init, args.seed, args.max_prompt_len + args.max_response_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)  # constant lr (000)
    B, G, rng, order = args.batch_size, args.group_size, random.Random(args.seed), []
    # --resume: weights, optimizer, RNGs and the data order: step start+1 as if never stopped
    start, extra = load_state(args.output_dir, model, opt, rng=rng) if args.resume else (0, {})
    order, skipped = extra.get("order", []), extra.get("skipped", 0)
    log = Logger(args.output_dir, args.max_steps, args, args.wandb_project, start)
    if not start:
        log.log(0, eval_metrics(model, tok, eval_tasks, args, sampler))  # where the init starts
    for step in range(start + 1, args.max_steps + 1):
        t0 = time.time()
        lr = warmup_lr(opt, args.lr, step, args.warmup_steps)
        # ---- sample: B prompts x G rollouts from the snapshot μ ----
        if len(order) < B:
            order = rng.sample(range(len(tasks)), len(tasks))
        batch, order = [tasks[i] for i in order[:B]], order[B:]
        ro = rollouts(sampler, model, tok, batch, G, args, seed=args.seed * 100_003 + step)
        t_sample = time.time() - t0
        # ---- score and advantage ----
        exact, reward = score_rollouts(ro, batch, args.reward, args.wrong_reward)  # (B*G,), (B, G)
        adv = rloo_advantages(reward).flatten()                                        # (B*G,)
        # ---- forward / backward per micro-batch of rollouts ----
        by_len = sorted(range(B * G), key=lambda r: len(ro.completion_ids[r]))  # micro-batches of like lengths: little padding
        sums = {k: 0.0 for k in ("loss", "entropy", "kl", "is_weight", "is_weight_raw")}
        gap, w_max, n_tok = 0.0, 0.0, sum(map(len, ro.completion_ids))
        for s in range(0, B * G, args.micro_batch):
            rows = by_len[s:s + args.micro_batch]
            ids, attn, mask, old_logp = (x.to(device) for x in rollout_batch(ro, rows, tok.pad_token_id))
            with autocast(device, model):
                st = token_stats(model, ids, attn, mask, temperature=args.temperature, entropy=True)  # of logits / T
            m = mask[:, 1:].float()                                                    # (b, T-1)
            loss, parts = rloo_loss(st["logp"], old_logp, st["entropy"], m, adv[rows].to(device), args)
            loss = loss.sum() / (B * G)                                                # −(1/G) Σ_i, mean over prompts
            loss.backward()
            sums["loss"] += loss.item()
            for k in ("is_weight", "is_weight_raw"):  # means over rollouts: clipped, and as paper 000 watches it
                sums[k] += parts[k].sum().item() / (B * G)
            for k in ("entropy", "kl"):
                sums[k] += (parts[k] * m).sum().item() / n_tok  # token means over the batch
            gap += ((st["logp"].detach() - old_logp).abs() * m).sum().item()  # the weight-sync canary
            w_max = max(w_max, parts["is_weight_raw"].max().item())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if step_is_finite(step, sums["loss"], grad_norm, args):  # else stop, or with --skip_nonfinite drop the step
            opt.step()
        else:
            skipped += 1
        opt.zero_grad(set_to_none=True)
        # ---- log (001's flatline diagnostics), evaluate, checkpoint ----
        group_std = reward.std(1)                                                      # (B,) within-group spread
        metrics = {f"train/{k}": v for k, v in sums.items()}
        metrics.update({"train/reward": reward.mean(), "train/accuracy": (exact == 1).float().mean(),
                        "train/reward_std": group_std.mean(), "train/adv_std": adv.std(),
                        "train/zero_adv_groups": (group_std == 0).float().mean(),
                        "train/resp_len": n_tok / (B * G),
                        "train/truncated": 1 - sum(ro.finished) / (B * G), "train/format": (exact > 0).float().mean(),
                        "train/is_weight_raw_max": w_max, "train/sampler_gap": gap / n_tok, "train/lr": lr,
                        "train/grad_norm": grad_norm, "train/skipped_steps": skipped,
                        "time/sample": t_sample, "time/update": time.time() - t0 - t_sample, "time/step": time.time() - t0})
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            metrics.update(eval_metrics(model, tok, eval_tasks, args, sampler))
            save_checkpoint(model, tok, args.output_dir)
        log.log(step, metrics)
        if step == args.max_steps or step % args.save_every == 0:
            save_state(args.output_dir, step, model, opt, rng=rng, order=order, skipped=skipped)
    log.close()
    print(f"saved {args.output_dir}")
    return model


if __name__ == "__main__":
    cli(main)
