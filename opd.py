"""OPD: on-policy distillation from a frozen teacher, hybrid with RLOO (paper 000 §3.3, Algorithm
1).

    L = λ_KL · mean_t KL(softmax(z_T/T) ‖ softmax(z_S/T)) + λ_RL · L_PG − λ_H · mean_t H(π_θ)  (4)
    L_PG = −w_i A_i log π_θ(y_i|x),  A_i = R_i − mean_{j≠i} R_j,  w_i = clip(π_θ/μ, max 10)    (3)
 The student samples; the teacher only scores the student's own tokens, so its guidance lands where
the student actually goes. Forward KL (teacher first) is mode-covering: the student pays for giving
low mass to any token the teacher finds plausible; --kd_loss reverse is KL(student ‖ teacher), the
mode-seeking one of GKD (Agarwal et al., 2024) and Thinking Machines' write-up (Lu et al., 2025).
λ_KL = λ_RL = 0.5 lets the verifier overrule an imperfect teacher. Anti-collapse (000 §3.3, Table
5) is two flags: --entropy_coef 1e-2 --kd_temperature 1.3; --positive_weight 0.1 is W-REINFORCE
in the RL half (rloo.py). L_PG and H use the rollout distribution softmax(z_S / --temperature), the
one μ sampled from; the KL has its own T. `train/is_weight_raw` is w before its clip (000 App. B:
~12.4; --mu trainer takes μ from the trainer's own forward: w = 1). Departures from the paper:
  1. The KL and the entropy are means over each rollout's tokens, L_PG a sum over ~100: λ_KL's KL
     pulled 0.005 as hard as L_PG (grad/<term>; docs/studies/loss_terms.md). --pg_norm mean divides L_PG
     by the token count, so both are on one scale (where 0.5 / 0.5 makes the KL the stronger pull).
  2. No T² rescaling of the KL (as in the paper): raising T also shrinks the KL's gradient.
  3. Embedded setting: a tiny teacher written by sft.py, 32 prompts x 8, lr 6.7e-5, 75 steps, a wrong
     answer rewarded 0 in the RL half (README; docs/studies/strategies.md); λ_KL 0.03: under --pg_norm mean the
     KL at 0.5 pulls 2.5-7x as hard as L_PG (the paper's summed L_PG outweighs its KL) toward a
     skill a 0.84M student cannot learn in 50 steps (docs/studies/teachers.md).

Real (1×H100, the paper's recipe = the defaults):
  python opd.py --init out/sft --teacher out/teacher --backend vllm
  anti-collapse: python opd.py --init out/opd --entropy_coef 1e-2 --kd_temperature 1.3 \\
                 --max_steps 150
CPU (embedded): the `opd` and `opd_anticollapse` stages of run_cpu.sh, which prints their exact
commands.
"""
from dataclasses import dataclass
from functools import partial

import torch

from common import (autocast, behavior_logp, data_parallel, make_sampler, micro_batches,
                    rollout_metrics, rollouts, score_rollouts, token_stats)
from evaluate import eval_metrics
from plumbing.flags import (CountdownError, RLArgs, arg, check_async, check_choice, check_rl_args,
                            cli, parse_args, seed_everything)
from plumbing.harness import (AheadSampler, Run, held_out, load_frozen, load_policy, prepare_run,
                              step_seed, warmup_lr)
from plumbing.tasks import load_tasks


@dataclass
class Args(RLArgs):
    # shared, with this script's defaults (000 Table 5)
    init: str = arg("out/sft",
                    "checkpoint to start from (the student: SFT model, or OPD for anti-collapse)")
    output_dir: str = arg("out/opd", "where the checkpoint, args.json and metrics.jsonl go")
    lr: float = arg(1e-5, "constant learning rate (000 Table 5)")
    batch_size: int = arg(128, "prompts per step; each gets --group_size rollouts (000 Table 5: "
                               "128 x 8)")
    micro_batch: int = arg(8, "rollouts per backward (bounds memory: student + teacher "
                              "activations)")
    weight_decay: float = arg(1e-4, "AdamW weight decay (000 Table 5)")
    grad_clip: float = arg(1.0, "global grad-norm clip (000 Table 5)")
    max_response_len: int = arg(1024, "rollout budget in new tokens (000 Table 5)")
    max_steps: int = arg(100, "optimizer steps, one rollout batch each (000 Table 5: 100; "
                              "anti-collapse 150)")
    # OPD specific
    teacher: str = arg("out/teacher",
                       "frozen teacher checkpoint; must share the student's tokenizer")
    kl_coef: float = arg(0.5, "λ_KL, weight of the KL to the teacher (000 Algorithm 1)")
    kd_loss: str = arg("forward", "forward: KL(teacher ‖ student), 000 Eq. 4 | reverse: "
                                  "KL(student ‖ teacher), GKD's on-policy reverse KL")
    rl_coef: float = arg(0.5, "λ_RL, weight of the RLOO policy gradient (000 Algorithm 1; 0: pure "
                              "distillation)")
    entropy_coef: float = arg(1e-3, "λ_H, entropy bonus (000: 1e-3; anti-collapse 1e-2)")
    kd_temperature: float = arg(1.0, "T of the distillation KL (000: 1.0; anti-collapse 1.3)")
    is_clip: float = arg(10.0, "w_max, clip of the sequence importance weight π_θ/μ (000 Table 5)")
    positive_weight: float = arg(1.0, "λ of W-REINFORCE in the RL half: positive advantages x λ "
                                      "(rloo.py; Zhu et al.: 0.1)")
    pg_norm: str = arg("sum", "sum: Eq. 3's log π(y|x), a sum over the rollout's tokens (000) | "
                              "mean: divided by its token count, the scale of the KL and entropy")
    mu: str = arg("sampler", "μ of w: sampler (its log-probs, Eq. 3) | trainer (this forward's, "
                             "detached: w = 1, a bf16 engine's rounding left out)")

    # the verifier's reward, as in rloo.py and grpo.py
    reward: str = arg("sparse", "sparse: verifier.score 1/0.1/0 (000) | dense: partial credit for "
                                "near misses (001)")
    wrong_reward: float = arg(0.1, "sparse reward of a wrong answer (000: 0.1); 0 or below when "
                                   "the budget cuts many searches short, or the 0.1 pays for "
                                   "claiming success falsely (docs/studies/arithmetic.md)")
    no_answer_reward: float = arg(0.0, "sparse reward of a rollout without a complete answer (000: "
                                       "0); at 0 with a negative --wrong_reward, a search cut "
                                       "short beats a wrong answer, so the policy learns not to "
                                       "answer (docs/studies/strategies.md)")

def rloo_advantages(reward, positive_weight=1.0):
    """rloo.py's, line for line (a course's handout blanks the two together). Eq. 3's leave-one-out
    baseline (Algorithm 1 line 2): reward (B, G) -> A (B, G), each rollout minus the mean of the
    other G−1 of its prompt; every group sums to zero, unless positive advantages are scaled by
    positive_weight λ < 1 (W-REINFORCE, as in rloo.py)."""
    G = reward.shape[1]
    baseline = (reward.sum(1, keepdim=True) - reward) / (G - 1)                       # (B, G)
    adv = reward - baseline
    return torch.where(adv > 0, positive_weight * adv, adv)


def opd_loss(logp, old_logp, teacher_kl, entropy, mask, adv, kl_coef, rl_coef, entropy_coef,
             is_clip, pg_norm="sum"):
    """Algorithm 1 lines 5-9 per rollout (b,). logp, old_logp: the student's and the sampler μ's
    log-probs of the sampled tokens, both at the rollout temperature; teacher_kl: KL(teacher ‖
    student) at kd_temperature per token; entropy: the student's; all (b, T-1); mask (b, T-1);
    adv (b,). The caller averages over rollouts. Returns (loss (b,), parts), parts (b,) each: "pg"
    (line 7, detached), "is_weight" w and "is_weight_raw" w before its clip, and "terms" {"kl", "pg",
    "entropy"}: the three parts as line 9 weights them (StepStats.term_grads)."""
    n_tok = mask.sum(-1).clamp(min=1)                                                  # (b,)
    logp_seq, old_seq = (logp * mask).sum(-1), (old_logp * mask).sum(-1)  # (b,) log π(y_i|x)
    w_raw = (logp_seq - old_seq).detach().exp()  # (b,) line 6, detached
    w = w_raw.clamp(max=is_clip)
    pg = -w * adv * logp_seq                                                           # (b,) line 7
    if pg_norm == "mean":  # departure 1: per token, on the scale of the KL and entropy
        pg = pg / n_tok
    kl = (teacher_kl * mask).sum(-1) / n_tok  # (b,) line 5: mean_t
    ent = (entropy * mask).sum(-1) / n_tok  # (b,) line 8: mean_t
    terms = {"kl": kl_coef * kl, "pg": rl_coef * pg, "entropy": -entropy_coef * ent}
    return sum(terms.values()), {"pg": pg.detach(), "is_weight": w,  # (b,) line 9 (Eq. 4)
                                 "is_weight_raw": w_raw, "terms": terms}


def main(argv=None):
    args = parse_args(Args, argv)
    check_rl_args(args.group_size, args.reward, pg_norm=args.pg_norm, mu=args.mu,
                  positive_weight=args.positive_weight)
    if args.kd_temperature <= 0:
        raise CountdownError(f"--kd_temperature must be positive, not {args.kd_temperature}")
    check_choice("kd_loss", args.kd_loss, ("forward", "reverse"))
    check_async(args.async_steps, args.backend, args.lora_rank)
    output_dir = prepare_run(args.output_dir, args.resume, args.overwrite)  # never over a done run
    seed_everything(args.seed)
    model, tok, device = load_policy(args.init, **args.policy_options())
    share = args.shares_prompts(model)  # each prompt's forward once for its G rollouts
    teacher = load_frozen(args.teacher, device, tok, args.init)  # bf16 on a GPU; it never trains
    world = data_parallel(model, args.fsdp, args.batch_size)  # torchrun's N ranks, else 1
    tasks = load_tasks(args.data, "train")
    sampler = make_sampler(args.backend, model, tok, args.init, args.seed,
                           args.max_prompt_len + args.max_response_len, args.decode)
    evaluate = partial(eval_metrics, model, tok, *held_out(args), sampler)  # pass@k on val
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    run = Run(output_dir, args.max_steps, model, tok, opt, **args.run_options(output_dir))
    ahead = AheadSampler(args.async_steps, sampler, rollouts, model, tok, args.rollout_options(),
                         args.sampler_threads, run.extra.get("ahead"))  # k ≥ 1: its own process
    if run.start == 0:  # where the init starts
        run.log(0, evaluate())
    B, G = args.batch_size // world, args.group_size  # B: this rank's prompts
    for step in run.steps():  # from run.start + 1: a resumed run goes on where its state ends
        warmup_lr(opt, args.lr, step, args.warmup_steps)  # constant after an optional warm-up
        # ---- sample: B prompts x G rollouts from the student's weights after step t − 1 − k ----
        for t in ahead.due(step, args.max_steps):  # hand step t + k's prompts over, weights now
            ahead.put(t, run.next_tasks(tasks, B), model, step - 1, args.temperature,
                      step_seed(args.seed, t))
        samples, batch = ahead.take(step)  # step t's, sampled k steps ago (k = 0: now)
        run.sampled()
        # ---- score and advantage ----
        scores, reward = score_rollouts(samples, batch, args.reward, args.wrong_reward,
                                        args.no_answer_reward)                 # (B*G,), (B, G)
        adv = rloo_advantages(reward, args.positive_weight).flatten()                  # (B*G,)
        # ---- log-probs, teacher KL and loss per micro-batch (the teacher without grad) ----
        stats = run.stats(B * G, sum(map(len, samples.completion_ids)))
        for rows, ids, attn, mask, sampler_logp, prompts in micro_batches(
                samples, args.micro_batch, tok.pad_token_id, device, share, args.forward_rows):
            # logp, entropy at the rollout T, the KL at kd_temperature; each prompt's forward once
            with autocast(device, model):  # the teacher keeps its fused attention (common.autocast)
                out = token_stats(model, ids, attn, mask, temperature=args.temperature,
                                  entropy=True, teacher=teacher, kd_temperature=args.kd_temperature,
                                  kd_reverse=args.kd_loss == "reverse", prompts=prompts)
            m = mask[:, 1:].float()                                                    # (b, T-1)
            old_logp = behavior_logp(args.mu, out["logp"], sampler_logp)  # μ: --mu
            loss, info = opd_loss(out["logp"], old_logp, out["kl"], out["entropy"], m,
                                  adv[rows].to(device), args.kl_coef, args.rl_coef,
                                  args.entropy_coef, args.is_clip, args.pg_norm)
            # --term_grads, on diagnose steps only: an extra backward per term (each term's pull)
            stats.term_grads(info["terms"], B * G)
            loss = loss.sum() / (B * G)  # mean over rollouts
            loss.backward()  # whole gradient (prompts too); torchrun: DDP averages over ranks
            stats.add("loss", loss.item())
            for k in ("pg", "is_weight", "is_weight_raw"):
                stats.row_mean(k, info[k])
            stats.token_mean("kl", out["kl"], m)
            stats.token_mean("entropy", out["entropy"], m)
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
        run.log_rollouts(step, args.log_rollouts, samples, batch, scores, reward, adv,
                         stats.log_rho)  # --log_rollouts N: N groups to rollouts.jsonl
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            run.checkpoint()  # first: an evaluation that fails loses nothing
            metrics.update(evaluate())
        run.log(step, metrics)
        if step == args.max_steps or step % args.save_every == 0:  # what --resume restarts from
            run.save(step, ahead=ahead.state())
    ahead.close()
    run.close()
    return model


if __name__ == "__main__":
    cli(main)
