"""GRPO: group-normalized advantages, a PPO-clipped ratio and a KL to a frozen reference (paper 004
§2 Eq. 1-2; paper 002 §3 Eq. 1 and its Countdown recipe), and the variants of 2025-26, a flag each.

    A_i = (r_i − mean_j r_j) / (std_j r_j + ε)               (004 Eq. 2; Dr. GRPO: no std)
    l_it = min(ρ_it A_i, clip(ρ_it, 1−ε_lo, 1+ε_hi) A_i) − β D_KL(π_θ ‖ π_ref)
    ρ_it = π_θ(o_it) / π_old(o_it)    GSPO: s_i = exp(1/|o_i| Σ_t log ρ_it) in place of every ρ_it
    CISPO: l_it = sg(min(ρ_it, 1+ε_hi)) A_i log π_θ(o_it) − β D_KL   (a capped token has a gradient)
    DAPO: r_i += min(0, (L_max − L_buf − |o_i|) / L_buf) · p; groups all right or wrong resampled
    L = −agg(l):  seq-mean 1/G Σ_i 1/|o_i| Σ_t (DeepSeekMath, 004)  |  token-mean 1/Σ|o_i| Σ_i Σ_t
                  (DAPO; 002 Eq. 1)  |  constant 1/(G·L_max) Σ_i Σ_t (Dr. GRPO)
GSPO: Zheng et al. 2025, arXiv 2507.18071. CISPO: MiniMax-M1, arXiv 2506.13585, Eq. 4. DAPO: Yu et
al. 2025, arXiv 2503.14476: clip-higher, token-mean, Eq. 13's overlong shaping and Alg. 1's dynamic
sampling; docs/studies/grpo_family.md measures them. seq-mean gives each rollout the same weight,
so a token of a long wrong answer is pushed down less than one of a short one: it prefers long
failures. π_θ and π_old in ρ are both softmax(logits / T) at the rollout temperature (as TRL). D_KL
is k3 times ρ (TRL's use_bias_correction_kl), whose gradient is that of KL(π_θ ‖ π_ref) as Eq. 1
writes it; --no-kl_ratio is DeepSeekMath's plain k3, whose gradient is that of KL(π_ref ‖ π_θ).
Defaults: 002's Countdown recipe (16 x 16, lr 5e-6, β 0.001, T 1.5), 004's in --help. Departures:
  1. π_old is the trainer's own forward of the batch before its first update (TRL, verl), not the
     sampler's: at `--num_iterations 1` (DeepSeekMath's μ = 1) ρ = 1, clipping acts from the second
     pass on, and GSPO's and CISPO's gradients are GRPO's. The sampler's log-probs are the canary
     (train/sampler_gap, train/mismatch); --is_correction weighs the surrogate by ρ = π_old/μ.
  2. Full fine-tuning unless --lora_rank (002 trains rank 8). 002's exploration knobs are flags:
     --bottom_p and --adaptive_temperature (§5.2); its filter and 001's tiers are --curriculum.
     Bottom-p samples off-policy: π_old in ρ stays softmax(logits / T), as 002 computes it.
  3. Embedded setting: generated tasks, a tiny model, 32 prompts x 8, lr 6.7e-5, β 0.04, 75 steps,
     and a wrong answer rewarded 0, not 0.1: with 160 tokens the 0.1 pays for a false "found".

Real (1×H100, the defaults):  python grpo.py --init out/sft --backend vllm --output_dir out/grpo
CPU (embedded): the `grpo` stage of run_cpu.sh, which prints its exact command.
"""
from dataclasses import dataclass
from functools import partial

import torch

from common import (autocast, curriculum_tasks, data_parallel, k3_kl, make_sampler, micro_batches,
                    mix_reference, rollout_metrics, rollouts, score_rollouts, take_groups,
                    token_stats)
from evaluate import eval_metrics
from plumbing.flags import RLArgs, arg, check_grpo, cli, parse_args, seed_everything
from plumbing.harness import (AheadSampler, Run, frozen_copy, grpo_stats, held_out, load_policy,
                              prepare_run, step_seed, warmup_lr)


@dataclass
class Args(RLArgs):
    # shared, with this script's defaults (002 §5.1's Countdown recipe; 004 Table 6 in the help)
    init: str = arg("out/sft",
                    "checkpoint to start from (the SFT model); also the frozen reference")
    output_dir: str = arg("out/grpo", "where the checkpoint, args.json and metrics.jsonl go")
    lr: float = arg(5e-6,
                    "constant learning rate (002 §5.1: higher was unstable; 004 Table 6: 1e-6)")
    batch_size: int = arg(16, "prompts per step; each gets --group_size rollouts (002 §5.1: 16 x "
                              "16; 004 Table 6: 4 x 64)")
    micro_batch: int = arg(16, "rollouts per backward (bounds memory; shared forward: whole "
                                "groups, at least one)")
    weight_decay: float = arg(0.0, "AdamW weight decay (002 gives none; 004 Table 6: 0)")
    grad_clip: float = arg(1.0, "global grad-norm clip (004 Table 6)")
    max_response_len: int = arg(1024, "rollout budget in new tokens (002 §4-5.1: 1024; shorter "
                                      "truncates good answers)")
    max_steps: int = arg(200, "rollout batches, --num_iterations optimizer steps each (002 §5.1: "
                              "its best within 200; 004 Table 6: 250)")
    group_size: int = arg(16, "G rollouts per prompt (002 §5.1: 16; 004 Table 6: 64)")
    temperature: float = arg(1.5, "rollout temperature; log-probs are of logits / T (002 Table 1: "
                                  "1.5 its best, 0.6 its default before; 004 Table 6: 0.7); top_p "
                                  "1, no top_k")
    # GRPO specific
    beta: float = arg(0.001, "β, weight of the KL to the frozen reference (002 §5.2: 0.001; 004 "
                             "Table 6: 0.04; 0: no reference)")
    kl_ratio: bool = arg(True, "k3 times ρ: the gradient of KL(π_θ‖π_ref) (--no-kl_ratio: "
                               "DeepSeekMath's k3, KL(π_ref‖π_θ)'s)")
    epsilon: float = arg(0.2, "PPO clip ε: ρ is kept within [1−ε, 1+ε_high] (DeepSeekMath, TRL)")
    epsilon_high: float = arg(0.0, "upper clip ε_high (DAPO's clip-higher: 0.28); 0: --epsilon")
    num_iterations: int = arg(1, "optimizer steps on each rollout batch (DeepSeekMath's μ)")
    scale_rewards: bool = arg(True,
                              "divide by the group's reward std (--no-scale_rewards: Dr. GRPO)")
    loss_agg: str = arg("token-mean", "seq-mean (DeepSeekMath) | token-mean (DAPO, 002 Eq. 1) | "
                                      "constant (Dr. GRPO)")
    mask_truncated: bool = arg(False,
                               "leave rollouts cut at --max_response_len out of the loss (002 §3)")
    ref_sync_every: int = arg(0, "every N steps move π_ref toward π_θ (002: 0, never; 004: 32)")
    ref_sync_mix: float = arg(0.9,
                              "π_ref ← mix · π_θ + (1 − mix) · π_ref at a sync (004 Table 6: 0.9)")
    # exploration (002 §5.2)
    bottom_p: float = arg(1.0, "sample from the bottom p of the mass: drop the most likely tokens "
                               "holding 1 − p, after T (002 Table 2: 0.9; 1: off; --backend hf)")
    bottom_p_freq: float = arg(1.0, "chance that bottom-p cuts a given token (002: 'with some "
                                    "frequency', not given)")
    adaptive_temperature: str = arg("", "EASY,HARD: per-problem T by a probe of the init, EASY "
                                        "where it solves half its samples (002 §5.2: 0.6,1.5); "
                                        "empty: --temperature for all")
    ratio_level: str = arg("token", "token: ρ_it (PPO) | sequence: GSPO's s_i, a ratio a rollout "
                                    "(GSPO clips at --epsilon 3e-4 --epsilon_high 4e-4)")
    loss_type: str = arg("clip", "clip: PPO's min (Eq. 1) | cispo: −sg(min(ρ, 1 + ε_high))·A·log π "
                                 "(verl's offset; TRL's epsilon_high is the cap 1 + ε_high)")
    dynamic_sampling: bool = arg(False, "DAPO Alg. 1: drop groups the verifier scores all right or "
                                        "all wrong and sample again until the batch is full")
    max_sample_batches: int = arg(10, "dynamic sampling: batches a step samples at most (verl's "
                                      "max_num_gen_batches, DAPO recipe); then flat groups fill")
    overlong_buffer: int = arg(0, "DAPO Eq. 13: L_buf, the budget's last tokens, where the reward "
                                  "falls linearly to −factor (DAPO: 4096 of 20480; 0: off)")
    overlong_factor: float = arg(1.0, "DAPO Eq. 13: the penalty at the budget (verl's default 1)")
    is_correction: str = arg("auto", "ρ = π_old/μ's weight (off_policy_weight): none | "
                                     "token_truncate | token_mask | sequence_truncate | "
                                     "sequence_mask | auto: sequence_mask at --async_steps ≥ 1 "
                                     "(none collapsed: docs/studies/off_policy.md), else none")
    is_cap: float = arg(2.0, "C of --is_correction: truncate at C, mask outside [1/C, C] (TRL: 2)")

    # the reward and the curriculum (common.py), as in rloo.py
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
    probe_problems: int = arg(1024, "filter and --adaptive_temperature: the first N train problems "
                                    "the init is probed on")
    probe_samples: int = arg(4, "filter: samples of the init per probed problem, at --temperature")


def grpo_advantages(reward, scale=True, eps=1e-4):
    """004 Eq. 2. reward (B, G) -> A (B, G): centered within each group, and divided by the group's
    (unbiased) std unless `scale` is off; a group of equal rewards gets A = 0 either way."""
    centered = reward - reward.mean(1, keepdim=True)                                  # (B, G)
    return centered / (reward.std(1, keepdim=True) + eps) if scale else centered


def off_policy_weight(old_logp, sampler_logp, mask, mode="none", cap=2.0):
    """The correction for rollouts a sampler --async_steps behind (or bf16 vLLM) drew: ρ = π_old/μ,
    π_old the trainer's π before the update (AReaL's π_prox, Fu et al. 2025, arXiv 2505.24298:
    clip around the trainer's own π, weigh for the sampler's μ), μ the sampler's log-probs:
      token_truncate     w_t = min(ρ_t, C)               TIS (Yao et al. 2025; TRL, verl)
      token_mask         w_t = ρ_t · 1[1/C ≤ ρ_t ≤ C]    MIS (Liu, Li et al. 2025, "When Speed
      sequence_truncate  w_t = min(ρ, C)                      Kills Stability")
      sequence_mask      w_t = ρ · 1[1/C ≤ ρ ≤ C]        ρ = Π_t ρ_t, the rollout's, on its tokens
    none: w = 1 (TRL's masks drop only ρ > C). old_logp, sampler_logp, mask: (b, T-1) -> w, and
    where it was truncated or masked (b, T-1), the same on a rollout's tokens at sequence level."""
    if mode == "none":
        return torch.ones_like(old_logp), torch.zeros_like(old_logp, dtype=torch.bool)
    log_rho = old_logp - sampler_logp                                                  # (b, T-1)
    if mode.startswith("sequence"):
        log_rho = (log_rho * mask).sum(-1, keepdim=True).expand_as(log_rho)     # log Π_t ρ_t
    rho = log_rho.clamp(max=30).exp()  # beyond C either way
    if mode.endswith("truncate"):
        return rho.clamp(max=cap), rho > cap
    out = (rho < 1 / cap) | (rho > cap)
    return rho.masked_fill(out, 0.0), out


def sequence_log_ratio(logp, old_logp, mask):
    """GSPO's log s_i = 1/|y_i| Σ_t log(π_θ(y_it)/π_old(y_it)), s_i the geometric mean of the token
    ratios, on every token (b, T-1) with that token's own gradient (GSPO-token's form, verl's):
    Σ_t s_i ∇log π_θ(y_it) = |y_i| ∇s_i, so seq-mean is GSPO's sequence objective. (b, T-1) each."""
    seq = ((logp - old_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return seq.detach() + logp - logp.detach()                   # (b, T-1): log s_i, s_i ∇log π


def cispo_surrogate(ratio, logp, A, eps_hi):
    """CISPO's per-token objective (MiniMax-M1 Eq. 4-5): sg(min(ρ, 1 + ε_hi))·A·log π_θ, REINFORCE
    weighted by the capped, detached ratio (no lower cap: the paper's ε_low is large), so a capped
    token keeps its gradient. ratio, logp: (b, T-1); A: (b, 1). Returns it, and where the cap binds
    (b, T-1)."""
    return ratio.clamp(max=1 + eps_hi).detach() * A * logp, ratio > 1 + eps_hi


def grpo_loss(logp, old_logp, ref_logp, adv, beta, epsilon, epsilon_high=0.0, kl_ratio=True,
              is_weight=1.0, mask=None, ratio_level="token", loss_type="clip"):
    """Per-token −l_it (b, T-1). logp, old_logp (π_old: the trainer's forward before the update),
    ref_logp (None if β = 0), mask (GSPO's mean): (b, T-1); adv: (b,); is_weight:
    off_policy_weight's.
    Where PPO's clipped term wins the min the token has no gradient (`clipped`); CISPO's capped
    tokens keep −(1 + ε_hi)·A·∇log π. Returns (loss (b, T-1), parts), parts' (b, T-1) each: "kl"
    (k3), "ratio" (ρ or s_i, detached), "clipped" (1.0 or 0.0), and "terms" {"pg", "kl"}."""
    eps_hi = epsilon_high or epsilon
    log_ratio = sequence_log_ratio(logp, old_logp, mask) if ratio_level == "sequence" else \
        logp - old_logp                                                                # (b, T-1)
    ratio = log_ratio.exp()  # (b, T-1) ρ_it, or GSPO's s_i on each of rollout i's tokens
    A = adv[:, None]                                                                   # (b, 1)
    if loss_type == "cispo":  # a capped token keeps its gradient (Eq. 4)
        surrogate, clipped = cispo_surrogate(ratio, logp, A, eps_hi)
        surrogate = surrogate * is_weight
    else:
        surrogate = torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + eps_hi) * A) * is_weight
        clipped = ((ratio > 1 + eps_hi) & (A > 0)) | ((ratio < 1 - epsilon) & (A < 0))
    kl = torch.zeros_like(logp) if ref_logp is None else \
        k3_kl(logp, ref_logp, old_logp if kl_ratio else None)  # (b, T-1) D_KL, Eq. 1
    terms = {"pg": -surrogate, "kl": beta * kl}  # as Eq. 1 weighs them (StepStats.term_grads)
    return -surrogate + beta * kl, {"kl": kl, "ratio": ratio.detach(), "clipped": clipped.float(),
                                    "terms": terms}


def aggregate(per_token, mask, mode, n_rows, n_tokens, max_len):
    """This micro-batch's share of the batch loss, so that micro-batches add up to the docstring's
    L. per_token, mask: (b, T-1); n_rows, n_tokens: rollouts and response tokens in the batch."""
    if mode == "seq-mean":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_rows
    if mode == "token-mean":
        return (per_token * mask).sum() / max(n_tokens, 1)
    return (per_token * mask).sum() / (n_rows * max_len)                               # constant


def row_temperatures(batch, G, T, T_easy_hard):
    """002 §5.2's adaptive temperature: explore what the init fails, exploit what it solves. The
    sampler's T (one per prompt, or T) and the trainer's (one per rollout (B*G,), or T)."""
    if not T_easy_hard:
        return T, T
    per_prompt = [T_easy_hard[t["solve_rate"] < 0.5] for t in batch]
    return per_prompt, torch.tensor(per_prompt).repeat_interleave(G)


def loss_rows(samples, mask_truncated):
    """Which rollouts the loss keeps (B*G,) and their response tokens: all, or with 002 §3's
    --mask_truncated only those that ended (EOS) within the budget."""
    keep = torch.tensor(samples.finished, dtype=torch.float32) if mask_truncated else \
        torch.ones(len(samples.completion_ids))
    return keep, sum(len(c) for c, k in zip(samples.completion_ids, keep.tolist()) if k)


def flat_groups(scores, G):
    """DAPO §3.2: the groups the verifier scores all right or all wrong, (B*G,) -> (B,), whatever
    --reward: dense partial credit spreads an all-wrong group's rewards (verl-recipe#125)."""
    correct = (scores == 1).view(-1, G)                                                 # (B, G)
    return correct.all(1) | ~correct.any(1)


def overlong_penalty(lengths, max_len, buffer, factor):
    """DAPO Eq. 13, the soft overlong punishment added to the reward: 0 up to max_len − buffer
    tokens, then linear to −factor at max_len (a rollout the budget cut). lengths (n,) -> (n,)."""
    lengths = torch.as_tensor(lengths, dtype=torch.float)
    return ((max_len - buffer - lengths) / buffer).clamp(-1, 0) * factor


def split_groups(samples, batch, G, dynamic):
    """A draw's groups (rollouts, prompt k, task): kept, and flat ones apart if DAPO's `dynamic`."""
    is_flat = flat_groups(score_rollouts(samples, batch)[0], G) if dynamic else [False] * len(batch)
    groups = [(samples, k, task) for k, task in enumerate(batch)]
    return [g for g, f in zip(groups, is_flat) if not f], [g for g, f in zip(groups, is_flat) if f]


def fill_batch(kept, flat, B, G):
    """The step's B groups (kept first, flat ones fill at the cap): Rollouts, tasks, n kept."""
    picks = (kept + flat)[:B]
    return take_groups([p[:2] for p in picks], G), [p[2] for p in picks], min(len(kept), B)


def refill_metrics(run, world, n_kept, n_flat, draws, batch_size, G, dynamic):
    """What --dynamic_sampling's full batch cost, over every rank (a mean x world); {} without."""
    if not dynamic:
        return {}
    n = {k: v * world for k, v in run.mean({"kept": n_kept, "flat": n_flat}).items()}
    return {"train/batches_sampled": draws, "train/groups_kept": n["kept"],
            "train/rollouts_sampled": draws * batch_size * G,
            "train/groups_dropped": (draws - 1) * batch_size,
            "train/flat_groups": n["flat"] / (draws * batch_size)}


def main(argv=None):
    args = parse_args(Args, argv)
    T_easy_hard = check_grpo(args)  # one line for a flag's bad value; 002's (T_easy, T_hard)
    output_dir = prepare_run(args.output_dir, args.resume, args.overwrite)  # never over a done run
    seed_everything(args.seed)
    model, tok, device = load_policy(args.init, **args.policy_options())
    share = args.shares_prompts(model)  # each prompt's forward once for its G rollouts
    ref = frozen_copy(model) if args.beta > 0 else None  # π_ref: the frozen init
    world = data_parallel(model, args.fsdp, args.batch_size)  # torchrun's N ranks, else 1
    sampler = make_sampler(args.backend, model, tok, args.init, args.seed,
                           args.max_prompt_len + args.max_response_len, args.decode)
    evaluate = partial(eval_metrics, model, tok, *held_out(args), sampler)  # pass@k on val
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    run = Run(output_dir, args.max_steps, model, tok, opt, ref=ref, **args.run_options(output_dir))
    tasks, curriculum = curriculum_tasks(args, sampler, model, tok, output_dir, run.extra,
                                         bool(T_easy_hard))  # 002 §5.2's probe, 001's tiers
    ahead = AheadSampler(args.async_steps, sampler, rollouts, model, tok, args.rollout_options(),
                         args.sampler_threads, run.extra.get("ahead"))  # k ≥ 1: its own process
    if run.start == 0:  # where the init starts
        run.log(0, evaluate())
    B, G = args.batch_size // world, args.group_size  # B: this rank's prompts
    for step in run.steps():  # from run.start + 1: a resumed run goes on where its state ends
        warmup_lr(opt, args.lr, step, args.warmup_steps)  # constant after an optional warm-up
        # ---- sample: B x G rollouts of the weights after step t − 1 − k (DAPO: until full) ----
        kept, flat, draws = [], [], 0  # kept, flat: (rollouts, prompt k, task) of sampled groups
        while draws < args.max_sample_batches and run.mean({"short": len(kept) < B})["short"]:
            for t in ahead.due(step, args.max_steps, draws):  # hand step t + k's prompts over
                batch = run.next_tasks(tasks, B, curriculum.pool())  # every rank draws as often
                T, _ = row_temperatures(batch, G, args.temperature, T_easy_hard)
                ahead.put(t, batch, model, step - 1, T, step_seed(args.seed, t, draws))  # θ now
            samples, batch = ahead.take(step)  # step t's, sampled k steps ago (k = 0: now)
            kept_now, flat_now = split_groups(samples, batch, G, args.dynamic_sampling)
            kept, flat, draws = kept + kept_now, flat + flat_now, draws + 1
        samples, batch, n_kept = fill_batch(kept, flat, B, G)  # cap reached: flat groups fill
        _, T_rows = row_temperatures(batch, G, args.temperature, T_easy_hard)  # the trainer's
        run.sampled()
        # ---- score and advantage ----
        scores, reward = score_rollouts(samples, batch, args.reward, args.wrong_reward,
                                        args.no_answer_reward)                 # (B*G,), (B, G)
        if args.overlong_buffer:  # DAPO Eq. 13 on the reward the advantage sees
            reward = reward + overlong_penalty(list(map(len, samples.completion_ids)),
                                               args.max_response_len, args.overlong_buffer,
                                               args.overlong_factor).view(B, G)
        adv = grpo_advantages(reward, args.scale_rewards).flatten()                    # (B*G,)
        keep, n_tok = loss_rows(samples, args.mask_truncated)  # (B*G,), response tokens in the loss
        # ---- log-probs and loss, per micro-batch; num_iterations optimizer steps on one batch ----
        stats, ref_logps, old_logps = run.stats(B * G, n_tok), {}, {}  # n_tokens: every rank's / N
        agg = partial(aggregate, mode=args.loss_agg, n_rows=B * G, n_tokens=stats.n_tokens,
                      max_len=args.max_response_len)  # (b, T-1), (b, T-1) -> share of L
        for it in range(args.num_iterations):
            for i, (rows, ids, attn, mask, sampler_logp, prompts) in enumerate(micro_batches(
                    samples, args.micro_batch, tok.pad_token_id, device, share, args.forward_rows)):
                m = mask[:, 1:].float() * keep[rows, None].to(device)                  # (b, T-1)
                with autocast(device, model, ref):  # each prompt's forward once for its group
                    T_mb = T_rows[rows] if T_easy_hard else T_rows  # the rollouts' temperatures
                    out = token_stats(model, ids, attn, mask, T_mb, entropy="logged",
                                      prompts=prompts)
                    if ref is not None and i not in ref_logps:  # π_ref does not move within a batch
                        ref_logps[i] = torch.no_grad()(token_stats)(ref, ids, attn, mask, T_mb,
                                                                    prompts=prompts)["logp"]
                # π_old: this forward on the first pass, before any update (departure 1)
                old_logp = old_logps.setdefault(i, out["logp"].detach())
                w, cut = off_policy_weight(old_logp, sampler_logp, m, args.is_correction,
                                           args.is_cap)  # ρ = π_old/μ's weight, 1 if none
                per_token, info = grpo_loss(out["logp"], old_logp, ref_logps.get(i),
                                            adv[rows].to(device), args.beta, args.epsilon,
                                            args.epsilon_high, args.kl_ratio, w, m,
                                            args.ratio_level, args.loss_type)
                if it == 0:  # --term_grads on diagnose steps (a backward a term); π_old vs μ
                    stats.term_grads({k: agg(v, m) for k, v in info["terms"].items()}, 1)
                    stats.sampler_gap(out["logp"], sampler_logp, m, rows)  # staleness, precision
                loss = agg(per_token, m)
                loss.backward()  # whole gradient (prompts too); torchrun: DDP averages over ranks
                stats.add("loss", loss.item())
                grpo_stats(stats, out, info, w, cut, m, keep[rows].to(device), args.is_correction,
                           args.ratio_level == "sequence")
            # ---- the update: clip, the non-finite stop, step (num_iterations of them) ----
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            if run.finite(step, stats.sums["loss"], grad_norm):  # else stop (or --skip_nonfinite)
                opt.step()
            opt.zero_grad(set_to_none=True)
        mix_reference(ref, model, args.ref_sync_mix, step, args.ref_sync_every)  # 004, if asked
        # ---- log, evaluate, checkpoint ----
        metrics = {**stats.metrics(args.num_iterations), **ahead.metrics(step),
                   **rollout_metrics(samples, scores, reward, adv, batch), **refill_metrics(
                       run, world, n_kept, len(flat), draws, args.batch_size, G,
                       args.dynamic_sampling)}
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
    return model, ref


if __name__ == "__main__":
    cli(main)
