"""RLOO: REINFORCE with a leave-one-out baseline on the verifier's reward (paper 000 §3.2, Eq. 3).

    A_i = R_i − 1/(G−1) Σ_{j≠i} R_j        L_PG = −(1/G) Σ_i w_i A_i log π_θ(y_i|x)         (Eq. 3)
    w_i = clip(π_θ(y_i)/μ(y_i), max 10), detached;   L = L_PG − λ_H H(π_θ) + λ_KL KL(π_θ‖μ)
 The other G−1 rollouts of the prompt are the baseline: no critic, and a group the policy always or
never solves gives A = 0 (paper 001's "flatline"; `--reward dense` gives near misses partial
credit). log π_θ and log μ are both of softmax(logits / T), the distribution that sampled (as TRL
does). `train/is_weight_raw` is w before its clip: paper 000 (App. B) watches it drift to ~12.4.
Departures from the paper:
  1. The paper names no estimator or direction for the KL to the sampler μ. We use k3 (001 §3.1.4)
     times the differentiable ratio π_θ/μ: on μ's tokens its gradient is KL(π_θ‖μ)'s (--no-kl_ratio:
     plain k3). With the HF sampler μ *is* the policy, so w = 1 and the term is ~0; it acts with
     vLLM or a sampler --async_steps ahead. --mu trainer takes μ from the trainer's forward instead
     (w = 1, KL 0): a bf16 engine's rounding then moves nothing (docs/vllm.md).
  2. The entropy and KL are token means, Eq. 3 a sum over ~100 tokens: λ_H's term pulled 3e-5 as
     hard (grad/<term>; docs/studies/loss_terms.md). --pg_norm mean divides Eq. 3 by the token count.
  3. Embedded setting: generated tasks, a tiny model, 32 prompts x 8, lr 6.7e-5, 75 steps, and a
     wrong answer rewarded 0, not 0.1: with 160 tokens the 0.1 pays for a false "found"
     (docs/studies/arithmetic.md).

Real (1×H100, the paper's recipe = the defaults):
  python rloo.py --init out/sft --backend vllm --output_dir out/rloo
CPU (embedded): the `rloo` stage of run_cpu.sh, which prints its exact command.
"""
from dataclasses import dataclass
from functools import partial

import torch

from common import (autocast, behavior_logp, curriculum_tasks, data_parallel, k3_kl, make_sampler,
                    micro_batches, rollout_metrics, rollouts, score_rollouts, token_stats)
from evaluate import eval_metrics
from plumbing.flags import RLArgs, arg, check_async, check_rl_args, cli, parse_args, seed_everything
from plumbing.harness import (AheadSampler, Run, held_out, load_policy, prepare_run, step_seed,
                              warmup_lr)


@dataclass
class Args(RLArgs):
    # shared, with this script's defaults (000 Table 5)
    init: str = arg("out/sft", "checkpoint to start from (the SFT model)")
    output_dir: str = arg("out/rloo", "where the checkpoint, args.json and metrics.jsonl go")
    lr: float = arg(1e-5, "constant learning rate (000 Table 5)")
    batch_size: int = arg(128, "prompts per step; each gets --group_size rollouts (000 Table 5: "
                               "128 x 8)")
    micro_batch: int = arg(8, "rollouts per backward (001: one group; bounds memory; shared "
                               "forward: whole groups)")
    weight_decay: float = arg(1e-4, "AdamW weight decay (000 Table 5)")
    grad_clip: float = arg(1.0, "global grad-norm clip (000 Table 5)")
    max_response_len: int = arg(1024, "rollout budget in new tokens (000 Table 5)")
    # RLOO specific
    entropy_coef: float = arg(1e-3, "λ_H, entropy bonus (000: 1e-3; anti-collapse 1e-2)")
    kl_coef: float = arg(1e-3, "λ_KL, KL penalty to the sampling policy μ (000 Table 5)")
    is_clip: float = arg(10.0, "w_max, clip of the sequence importance weight π_θ/μ (000 Table 5)")
    kl_ratio: bool = arg(True, "k3 times the ratio π_θ/μ: the gradient of KL(π_θ‖μ) "
                               "(--no-kl_ratio: plain k3)")
    pg_norm: str = arg("sum", "sum: Eq. 3's log π(y|x), a sum over the rollout's tokens (000) | "
                              "mean: divided by its token count, the scale of the entropy and KL")
    positive_weight: float = arg(1.0, "λ of W-REINFORCE: positive advantages x λ (Zhu et al.: 0.1; "
                                      "1: Eq. 3)")
    mu: str = arg("sampler", "μ of w and the KL: sampler (its log-probs, Eq. 3) | trainer (this "
                             "forward's, detached: w = 1, a bf16 engine's rounding left out)")
    # the reward and the curriculum (common.py), as in grpo.py
    reward: str = arg("sparse", "sparse: verifier.score 1/0.1/0 (000) | dense: partial credit for "
                                "near misses (001)")
    wrong_reward: float = arg(0.1, "sparse reward of a wrong answer (000: 0.1); 0 or below when "
                                   "the budget cuts many searches short, or the 0.1 pays for "
                                   "claiming success falsely (docs/studies/arithmetic.md)")
    no_answer_reward: float = arg(0.0, "sparse reward of a rollout without a complete answer (000: "
                                       "0); at 0 with a negative --wrong_reward, a search cut "
                                       "short beats a wrong answer, so the policy learns not to "
                                       "answer (docs/studies/strategies.md)")
    curriculum: str = arg("none", "none | tiers (001 Alg. 1: success-gated tiers by operand count, "
                                  "then target) | filter (002 §5.2: problems the init solves "
                                  "sometimes)")
    curriculum_bins: int = arg(3, "tiers: target bins per operand count")
    curriculum_window: int = arg(10, "tiers: W, steps of rollout accuracy averaged (001: none)")
    curriculum_threshold: float = arg(0.6, "tiers: τ, the mean accuracy that unlocks the next tier "
                                           "(001: none)")
    probe_problems: int = arg(1024, "filter: the first N train problems the init is probed on")
    probe_samples: int = arg(4, "filter: samples of the init per probed problem, at --temperature")


def rloo_advantages(reward, positive_weight=1.0):
    """Eq. 3's leave-one-out baseline. reward (B, G) -> A (B, G): each rollout minus the mean of the
    other G−1 of its prompt. Equal to G/(G−1) · (R_i − mean_j R_j), so every group sums to zero.
    positive_weight λ < 1 is W-REINFORCE (Zhu et al., 2025, "The Surprising Effectiveness of
    Negative Reinforcement in LLM Reasoning"): positive advantages x λ, so the update mostly pushes
    mass off wrong rollouts, which the model's prior spreads over other tries, instead of piling it
    on the right ones: the paper keeps pass@k at large k (here it did not: docs/studies/teachers.md). The
    paper weighs rewards ±1 with no baseline; we scale A."""
    G = reward.shape[1]
    baseline = (reward.sum(1, keepdim=True) - reward) / (G - 1)                       # (B, G)
    adv = reward - baseline
    return torch.where(adv > 0, positive_weight * adv, adv)


def importance_weights(logp_seq, old_seq, clip):
    """w_i = clip(π_θ(y_i)/μ(y_i), max `clip`) on whole sequences, detached: it rescales the
    gradient of a rollout the snapshot μ sampled; it is not itself optimized. (b,), (b,) ->
    clipped w, raw w"""
    raw = (logp_seq - old_seq).detach().exp()
    return raw.clamp(max=clip), raw


def rloo_loss(logp, old_logp, entropy, mask, adv, entropy_coef, kl_coef, is_clip, kl_ratio=True,
              pg_norm="sum"):
    """Eq. 3 plus the entropy bonus and the KL to μ, per rollout (b,). logp, old_logp (the sampler
    μ), entropy, mask: (b, T-1); adv: (b,). The caller sums over rollouts and divides by B·G.
    Returns (loss (b,), parts): parts["kl"] the per-token k3 (b, T-1), parts["is_weight"] w and
    parts["is_weight_raw"] w before its clip (b,), parts["terms"] {"pg", "entropy", "kl"}: the
    loss's three parts (b,) as it weights them (StepStats.term_grads: grad/pg, ...)."""
    n_tok = mask.sum(-1).clamp(min=1)                                                  # (b,)
    logp_seq, old_seq = (logp * mask).sum(-1), (old_logp * mask).sum(-1)  # (b,) log π(y_i|x)
    w, w_raw = importance_weights(logp_seq, old_seq, is_clip)
    pg = -w * adv * logp_seq                                                           # (b,) Eq. 3
    if pg_norm == "mean":  # departure 2: per token, as the entropy and KL below
        pg = pg / n_tok
    ent = (entropy * mask).sum(-1) / n_tok  # (b,) mean token entropy
    kl_tok = k3_kl(logp, old_logp, old_logp if kl_ratio else None)  # (b, T-1) KL(π_θ‖μ)
    kl = (kl_tok * mask).sum(-1) / n_tok                                               # (b,)
    terms = {"pg": pg, "entropy": -entropy_coef * ent, "kl": kl_coef * kl}
    return sum(terms.values()), {"kl": kl_tok.detach(), "is_weight": w, "is_weight_raw": w_raw,
                                 "terms": terms}


def main(argv=None):
    args = parse_args(Args, argv)
    check_rl_args(args.group_size, args.reward, args.curriculum, args.pg_norm, args.mu,
                  args.positive_weight)
    check_async(args.async_steps, args.backend, args.lora_rank)
    output_dir = prepare_run(args.output_dir, args.resume, args.overwrite)  # never over a done run
    seed_everything(args.seed)
    model, tok, device = load_policy(args.init, **args.policy_options())
    world = data_parallel(model, args.fsdp, args.batch_size)  # torchrun's N ranks, else 1
    share = args.shares_prompts(model)  # each prompt's forward once for its G rollouts
    sampler = make_sampler(args.backend, model, tok, args.init, args.seed,
                           args.max_prompt_len + args.max_response_len, args.decode)
    evaluate = partial(eval_metrics, model, tok, *held_out(args), sampler)  # pass@k on val
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    run = Run(output_dir, args.max_steps, model, tok, opt, **args.run_options(output_dir))
    tasks, curriculum = curriculum_tasks(args, sampler, model, tok, output_dir,
                                         run.extra)  # 002 §5.2's probe, 001's tiers
    ahead = AheadSampler(args.async_steps, sampler, rollouts, model, tok, args.rollout_options(),
                         args.sampler_threads, run.extra.get("ahead"))  # k ≥ 1: its own process
    if run.start == 0:  # where the init starts
        run.log(0, evaluate())
    B, G = args.batch_size // world, args.group_size  # B: this rank's prompts
    for step in run.steps():  # from run.start + 1: a resumed run goes on where its state ends
        warmup_lr(opt, args.lr, step, args.warmup_steps)  # constant after an optional warm-up
        # ---- sample: B prompts x G rollouts from μ, the weights after step t − 1 − k ----
        for t in ahead.due(step, args.max_steps):  # hand step t + k's prompts over, weights now
            ahead.put(t, run.next_tasks(tasks, B, curriculum.pool()), model, step - 1,
                      args.temperature, step_seed(args.seed, t))
        samples, batch = ahead.take(step)  # step t's, sampled k steps ago (k = 0: now)
        run.sampled()
        # ---- score and advantage ----
        scores, reward = score_rollouts(samples, batch, args.reward, args.wrong_reward,
                                        args.no_answer_reward)                 # (B*G,), (B, G)
        adv = rloo_advantages(reward, args.positive_weight).flatten()                  # (B*G,)
        # ---- log-probs and loss, per micro-batch of rollouts (whole groups: --prompt_forward) ----
        stats = run.stats(B * G, sum(map(len, samples.completion_ids)))
        for rows, ids, attn, mask, sampler_logp, prompts in micro_batches(
                samples, args.micro_batch, tok.pad_token_id, device, share, args.forward_rows):
            with autocast(device, model):  # at T; each prompt's forward once for its group
                out = token_stats(model, ids, attn, mask, args.temperature, entropy=True,
                                  prompts=prompts)
            m = mask[:, 1:].float()                                                    # (b, T-1)
            old_logp = behavior_logp(args.mu, out["logp"], sampler_logp)  # μ: --mu
            loss, info = rloo_loss(out["logp"], old_logp, out["entropy"], m, adv[rows].to(device),
                                   args.entropy_coef, args.kl_coef, args.is_clip, args.kl_ratio,
                                   args.pg_norm)
            # --term_grads, on diagnose steps only: an extra backward per term (each term's pull)
            stats.term_grads(info["terms"], B * G)
            loss = loss.sum() / (B * G)  # −(1/G) Σ_i, mean over prompts
            loss.backward()  # whole gradient (prompts too); torchrun: DDP averages over ranks
            stats.add("loss", loss.item())
            stats.row_mean("is_weight", info["is_weight"])  # clipped, and as 000 watches it
            stats.row_mean("is_weight_raw", info["is_weight_raw"])
            stats.token_mean("entropy", out["entropy"], m)
            stats.token_mean("kl", info["kl"], m)
            stats.max("is_weight_raw_max", info["is_weight_raw"])
            stats.sampler_gap(out["logp"], sampler_logp, m, rows)  # staleness, precision
        # ---- the update: clip, the non-finite stop, step ----
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if run.finite(step, stats.sums["loss"], grad_norm):  # else stop (or --skip_nonfinite)
            opt.step()
        opt.zero_grad(set_to_none=True)
        # ---- log, evaluate, checkpoint ----
        metrics = {**stats.metrics(), **rollout_metrics(samples, scores, reward, adv, batch),
                   **ahead.metrics(step)}
        metrics.update(curriculum.update(metrics["train/accuracy"]))  # 001 Alg. 1, every rank's
        run.log_rollouts(step, args.log_rollouts, samples, batch, scores, reward, adv,
                         stats.log_rho)  # --log_rollouts N: N groups to rollouts.jsonl
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            run.checkpoint()  # first: an evaluation that fails loses nothing
            metrics.update(evaluate())
        run.log(step, metrics)
        if step == args.max_steps or step % args.save_every == 0:  # what --resume restarts from
            run.save(step, curriculum=curriculum.state(), ahead=ahead.state())
    ahead.close()
    run.close()
    return model


if __name__ == "__main__":
    cli(main)
