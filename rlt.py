"""RLT: a Reinforcement-Learned Teacher that explains a given solution to a frozen student (paper
004 §3).

    r_SS = avg_t log π_s(s_t | q, e) + α · min_t log π_s(s_t | q, e)                     (Eq. 3)
    r_KL = avg_t KL_t + α · max_t KL_t over e, of π_θ(·| q, s, e_<t) ‖ π_s(·| q, e_<t)     (Eq. 4)
    r = r_SS − λ r_KL (+ −1 if e never closes </think>)                                   (Eq. 5)
    A = GRPO's Eq. 2 on r                                                                 (Eq. 6)

The teacher sees the question *and* the solution and writes the explanation e; the reward asks the
frozen student two things: does e make the solution likely (r_SS), and is every step of e a likely
step from the student's side, without the solution in view (r_KL)? A dense reward: no exploration
wall. The −1 is *added*, so dropping </think> never pays. As the authors run it (SakanaAI/RLT):
KL_t is the written token's log π_θ − log π_s (--kl_estimator exact: Eq. 4's KL over the
vocabulary), both models at the sampling temperature, and λ, α by §A.1's rule (each term of about
the same magnitude over the initial explanations; their 7B: λ 3, α 0.01; the embedded teacher:
λ 13.4, α 0.085, whose student did worse on val than λ 3's, so run_cpu.sh keeps 3 and 0.01) on
B x G explanations at the start (--no-balance: the flags). Departures:
  1. Prompt formats (004 Fig. 6-7) are the Countdown ones: the teacher's assistant turn opens with
     `<answer>solution</answer>` then `<think>`; the student's is the plain prompt, e,
     `</think>\\n<answer>s</answer>`.
  2. r_SS scores the expression and `</answer>`; the explanation is retokenized from its text. One
     that never closes </think> (cut at --max_response_len, or ended without it) is scored as all
     of its text.
  3. The GRPO update is grpo.py's with 004's choices fixed: seq-mean loss, one pass (ρ = 1: π_old is
     the trainer's forward), KL to a synced reference, log-probs of logits / T (T = 0.7) in ρ.
  4. Embedded setting (run_cpu.sh): the teacher starts from the SFT model after a format SFT on
     the baseline's own data, as 004's (sft.py --data rlt:FILE: the verified teacher's accepted
     samples); the student is the baseline's (teacher_student, as 004 scores with its baseline's),
     16 prompts x 8; solutions from the restricted solver, whose steps the traces can write
     (plumbing/explanations.py: solved); the export's budget twice the training one (004 Table 4).

Real (1×H100):
  python rlt.py --init out/sft --student out/sft --backend vllm --export out/rlt/traces.jsonl
CPU (embedded): the `rlt` stage of run_cpu.sh, which prints its exact command.
"""
from dataclasses import dataclass
from functools import partial

import torch

from common import (autocast, data_parallel, k3_kl, make_sampler, micro_batches, mix_reference,
                    token_stats)
from plumbing.explanations import (balanced, export_traces, measure_balance, next_solved,
                                   rlt_tasks, solved)
from plumbing.flags import (CountdownError, RLArgs, arg, check_choice, check_rl_args, cli,
                            parse_args, seed_everything)
from plumbing.harness import (Run, frozen_copy, load_frozen, load_policy, prepare_run, step_seed,
                              warmup_lr)
from plumbing.tasks import student_prompt, student_row, teacher_prompt


@dataclass
class Args(RLArgs):
    # shared, with this script's defaults (004 Table 3)
    init: str = arg("out/sft",
                    "checkpoint the teacher starts from (004: after a short SFT in its format)")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4",
                    "tasks to explain (its train split; unsolvable ones "
                    "are skipped)")
    eval_data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4",
                         "tasks for periodic held-out reward (its `val` split)")
    output_dir: str = arg("out/rlt", "where the checkpoint, args.json and metrics.jsonl go")
    template: str = arg("base", "prompt template of the student format: base | compact")
    lr: float = arg(1e-6, "constant learning rate (004 Table 3)")
    batch_size: int = arg(16, "prompts per step; each gets --group_size explanations (004 Table 3: "
                              "1024 = 16 x 64)")
    micro_batch: int = arg(8, "rows per backward (bounds memory; shared forward: whole groups)")
    weight_decay: float = arg(0.0, "AdamW weight decay (004 Table 3)")
    grad_clip: float = arg(1.0, "global grad-norm clip (004 Table 3)")
    max_response_len: int = arg(1024, "explanation budget in new tokens; one cut before </think> "
                                      "gets --penalty")
    eval_every: int = arg(25, "steps between held-out evaluations (0: only at start and end)")
    eval_samples: int = arg(4, "explanations per held-out problem")
    max_steps: int = arg(125, "rollout batches, one optimizer step each (004 Table 3; 0: only "
                              "--export)")
    group_size: int = arg(64, "G explanations per prompt (004 Table 3: 64)")
    temperature: float = arg(0.7, "sampling temperature; log-probs are of logits / T (004 Table "
                                  "3: 0.7)")
    # RLT specific
    student: str = arg("out/sft",
                       "the frozen student whose log-probs make the reward; shares the tokenizer")
    lam: float = arg(3.0, "λ, weight of r_KL (004 Table 3: 3), with --no-balance")
    alpha: float = arg(0.01, "α, weight of the min / max terms in r_SS / r_KL (004 Table 3: 0.01), "
                             "with --no-balance")
    balance: bool = arg(True, "λ and α by 004 §A.1's rule: each of the reward's four terms of "
                              "about the same magnitude over the initial explanations (saved in "
                              "OUTPUT_DIR/balance.json)")
    kl_estimator: str = arg("sampled", "KL_t of Eq. 4: sampled = log π_θ(e_t) − log π_s(e_t) "
                                       "(the authors' code) | exact: over the vocabulary")
    reward_temperature: float = arg(0.0, "T of both models' log-probs in the reward (0: "
                                         "--temperature, as the authors' code; 1: raw logits)")
    penalty: float = arg(-1.0, "added to the reward of an explanation that never closes </think> "
                               "(004 §A.1, Table 3: −1)")
    beta: float = arg(0.04, "β, weight of the KL to the reference teacher (004 Table 3)")
    kl_ratio: bool = arg(True, "k3 times ρ: the gradient of KL(π_θ‖π_ref) (--no-kl_ratio: "
                               "DeepSeekMath's k3, KL(π_ref‖π_θ)'s)")
    epsilon: float = arg(0.2, "PPO clip ε (DeepSeekMath and TRL: 0.2)")
    ref_sync_every: int = arg(32, "every N steps π_ref ← mix · π_θ + (1 − mix) · π_ref (004 Table "
                                  "3: 32; 0: never)")
    ref_sync_mix: float = arg(0.9, "the mixup of a reference sync (004 Table 3: 0.9)")
    export: str = arg("", "after training, write student-format traces (query/completion JSONL) "
                          "for sft.py --data")
    export_problems: int = arg(2000, "train problems to export, from the first")
    export_max_new_tokens: int = arg(0, "explanation budget of the export (0: 2 x "
                                        "--max_response_len, 004 Table 4's ratio: a cut "
                                        "explanation is no trace)")
    export_best_of: int = arg(1,
                              "explanations drawn per exported problem; the best r_SS one is kept")
    export_redraws: int = arg(0, "draws again, up to this many times, for a problem none of whose "
                                 "explanations closed </think> (004 §B: up to 16 draws)")
    export_verified: bool = arg(False, "export only explanations whose every written step is right "
                                       "and that say `found` only at the target (not in 004)")


def explanation_of(text):
    """(explanation, penalized) of a teacher completion: the text before </think>, and whether the
    tag is missing (004 §A.1: the explanation ran past the budget, or ended untagged). What
    follows a closed </think> does not count: a completion cut there still has a whole
    explanation."""
    return text.split("</think>")[0], "</think>" not in text


# ---- the reward (004 Eq. 3-5) --------------------------------------------------------------------
def reward_parts(logp, kl, sol_mask, expl_mask):
    """Eq. 3-4's four reductions per row (b, 4): avg and min of the student's log-probs over the
    solution, avg and max of KL_t over the explanation. logp, kl, sol_mask, expl_mask: (b, T-1).
    An empty explanation has 0 for both KL terms."""
    n_sol, n_expl = sol_mask.sum(-1).clamp(min=1), expl_mask.sum(-1)                    # (b,)
    avg_logp = (logp * sol_mask).sum(-1) / n_sol
    min_logp = logp.masked_fill(sol_mask == 0, float("inf")).min(-1).values
    avg_kl = (kl * expl_mask).sum(-1) / n_expl.clamp(min=1)
    # the sampled KL_t can be negative: the max is over the explanation's tokens only
    max_kl = kl.masked_fill(expl_mask == 0, float("-inf")).max(-1).values.where(n_expl > 0, 0.0)
    return torch.stack([avg_logp, min_logp, avg_kl, max_kl], -1)                       # (b, 4)


def rlt_reward(parts, penalized, alpha, lam, penalty):
    """(N,) each: r = r_SS − λ r_KL, plus `penalty` where the explanation never closed </think>
    (004 §A.1: added, so dropping the tag never pays), r_SS (Eq. 3), r_KL (Eq. 4)."""
    r_ss = parts[:, 0] + alpha * parts[:, 1]
    r_kl = parts[:, 2] + alpha * parts[:, 3]
    return r_ss - lam * r_kl + penalty * torch.tensor(penalized, dtype=torch.float32), r_ss, r_kl


@torch.no_grad()
def score_explanations(teacher, student, tok, tasks, sols, explanations, template, temperature,
                       kl_estimator, micro_batch, device):
    """reward_parts (N, 4) of N explanations, both models' log-probs of logits / temperature. Each
    row is run twice, aligned token for token: the student reads q + e + s, the teacher q + s + e
    (its own format). The student's copy is left-padded so both prompts end at the same position
    (RoPE sees only relative positions). KL_t: `exact`, KL(π_θ ‖ π_s) over the vocabulary (Eq. 4
    as written); `sampled`, log π_θ(e_t) − log π_s(e_t) of the token the teacher wrote (the
    authors' code): a step the student would not take costs there even when the two
    distributions are close elsewhere."""
    parts = torch.zeros(len(tasks), 4)
    enc = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    for s in range(0, len(tasks), micro_batch):
        rows = list(range(s, min(s + micro_batch, len(tasks))))
        P_t = enc([teacher_prompt(tasks[i], sols[i], template) for i in rows])
        P_s = enc([student_prompt(tasks[i], template) for i in rows])
        E = enc([explanations[i] for i in rows])
        S = enc([f"{sols[i]}</answer>" for i in rows])
        tail = enc(["</think>\n<answer>"])[0]
        P = max(map(len, P_t + P_s))
        T = P + max(len(e) + len(tail) + len(x) for e, x in zip(E, S))
        ids_t, ids_s = torch.full((2, len(rows), T), tok.pad_token_id)                 # (b, T) each
        attn_t, attn_s, expl_mask, sol_mask = torch.zeros(4, len(rows), T, dtype=torch.long)
        for r, (pt, ps, e, x) in enumerate(zip(P_t, P_s, E, S)):  # both prompts right-aligned at P
            end = P + len(e) + len(tail) + len(x)
            for ids, attn, p in ((ids_t, attn_t, pt), (ids_s, attn_s, ps)):
                ids[r, P - len(p):end] = torch.tensor(p + e + tail + x)
                attn[r, P - len(p):end] = 1
            expl_mask[r, P:P + len(e)] = 1
            sol_mask[r, end - len(x):end] = 1
        teacher_in = (ids_t.to(device), attn_t.to(device))
        exact = kl_estimator == "exact"
        with autocast(device, student, teacher):  # log-probs (and the exact KL) in vocab chunks
            st = token_stats(student, ids_s.to(device), attn_s.to(device),
                             (expl_mask + sol_mask).to(device), temperature,
                             teacher=teacher if exact else None, kd_temperature=temperature,
                             teacher_inputs=teacher_in if exact else None)
            kl = st["kl"] if exact else token_stats(  # (b, T-1); masked to e by reward_parts
                teacher, *teacher_in, expl_mask.to(device), temperature)["logp"] - st["logp"]
        parts[rows] = reward_parts(st["logp"], kl, sol_mask[:, 1:].to(device).float(),
                                   expl_mask[:, 1:].to(device).float()).float().cpu()
    return parts


# ---- the GRPO update, with 004's choices ---------------------------------------------------------
def grpo_advantages(reward, scale=True, eps=1e-4):
    """grpo.py's, line for line (a course's handout blanks the two together). 004 Eq. 2: reward
    (B, G) -> A (B, G), centered within each group and divided by the group's (unbiased) std
    unless `scale` is off; a group of equal rewards gets A = 0 either way."""
    centered = reward - reward.mean(1, keepdim=True)                                  # (B, G)
    return centered / (reward.std(1, keepdim=True) + eps) if scale else centered


def rlt_loss(logp, old_logp, ref_logp, mask, adv, beta, epsilon, kl_ratio=True):
    """004 Eq. 6 per rollout (b,): the PPO-clipped surrogate minus β D_KL(π_θ ‖ π_ref), averaged
    over each rollout's tokens (DeepSeekMath's seq-mean). logp, old_logp, ref_logp (or None),
    mask: (b, T-1); adv: (b,). D_KL is k3 (r = π_ref/π_θ), times ρ with kl_ratio so that its
    gradient is KL(π_θ ‖ π_ref)'s (grpo.py). Returns (loss (b,), parts): parts["kl"] the per-token
    k3 (b, T-1), parts["terms"] {"pg", "kl"}: the loss's parts (b,) (StepStats.term_grads)."""
    ratio = (logp - old_logp).exp()                                                    # (b, T-1)
    A = adv[:, None]
    surrogate = torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + epsilon) * A)
    kl = torch.zeros_like(logp) if ref_logp is None else \
        k3_kl(logp, ref_logp, old_logp if kl_ratio else None)                          # (b, T-1)
    seq_mean = lambda x: (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # noqa: E731 (b,)
    terms = {"pg": seq_mean(-surrogate), "kl": seq_mean(beta * kl)}  # StepStats.term_grads
    return seq_mean(-surrogate + beta * kl), {"kl": kl.detach(), "terms": terms}


# ---- which problems, and the teacher's explanations ----------------------------------------------
def explain(sampler, model, tok, tasks, sols, n, template, max_prompt_len, temperature,
            max_new_tokens, seed):
    """n teacher completions per task; returns (Rollouts, explanations, penalized flags)."""
    prompts = [teacher_prompt(t, s, template) for t, s in zip(tasks, sols)]
    if max(map(len, tok(prompts, add_special_tokens=False)["input_ids"])) > max_prompt_len:
        raise CountdownError("a teacher prompt (question + solution) is longer than "
                             f"--max_prompt_len {max_prompt_len}")
    sampler.wake()
    sampler.sync(model)
    samples = sampler.generate(prompts, n, temperature, 1.0, 0, max_new_tokens, seed)
    sampler.sleep()
    expl, penalized = zip(*map(explanation_of, samples.texts))
    return samples, list(expl), list(penalized)


def held_out(explain_fn, score_fn, tasks, sols, n):
    """eval/ metrics: the RLT reward of n fresh explanations per held-out problem (004 §4.5's
    analysis)."""
    samples, expl, pen = explain_fn(tasks, sols, n)
    rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
    r, r_ss, r_kl = score_fn(rep(tasks), rep(sols), expl, pen)
    return {"eval/reward": r.mean(), "eval/r_ss": r_ss.mean(), "eval/r_kl": r_kl.mean(),
            "eval/penalized": sum(pen) / len(pen)}


def rlt_metrics(samples, reward, r_ss, r_kl, penalized, expl_tokens):
    """train/ metrics of an RLT batch. reward (B, G); r_ss, r_kl, penalized (B*G,); expl_tokens: the
    explanations' tokens in all (the rest of each completion is what follows </think>)."""
    n = len(samples.completion_ids)
    return {"train/reward": reward.mean(), "train/r_ss": r_ss.mean(), "train/r_kl": r_kl.mean(),
            "train/penalized": sum(penalized) / n, "train/reward_std": reward.std(1).mean(),
            "train/expl_len": expl_tokens / n,
            "train/resp_len": sum(map(len, samples.completion_ids)) / n,
            "train/cut": 1 - sum(samples.finished) / n}  # stopped by the budget, not EOS


def main(argv=None):
    args = parse_args(Args, argv)
    check_rl_args(args.group_size)
    if args.async_steps or args.log_rollouts:  # said, not ignored
        raise CountdownError("rlt.py samples and trains in turns: --async_steps and --log_rollouts "
                             "are rloo.py's, grpo.py's and opd.py's")
    check_choice("kl_estimator", args.kl_estimator, ("sampled", "exact"))
    output_dir = prepare_run(args.output_dir, args.resume, args.overwrite)  # never over a done run
    seed_everything(args.seed)
    model, tok, device = load_policy(args.init, **args.policy_options())
    share = args.shares_prompts(model)  # each prompt's forward once for its G rollouts
    student = load_frozen(args.student, device, tok, args.init)  # whose view makes the reward
    ref = frozen_copy(model) if args.beta > 0 else None  # π_ref
    world = data_parallel(model, args.fsdp, args.batch_size)  # torchrun's N ranks, else 1
    tasks, eval_tasks = rlt_tasks(args.data, args.eval_data, args.eval_problems,  # eval: solved
                                  args.export_problems if args.max_steps == 0 else None)
    export_len = args.export_max_new_tokens or 2 * args.max_response_len  # 004 Table 4: 2 x
    sampler = make_sampler(args.backend, model, tok, args.init, args.seed, args.max_prompt_len
                           + max(args.max_response_len, export_len if args.export else 0),
                           args.decode)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    explain_fn = partial(explain, sampler, model, tok, template=args.template,
                         max_prompt_len=args.max_prompt_len, temperature=args.temperature,
                         max_new_tokens=args.max_response_len, seed=args.seed)
    parts_of = partial(score_explanations, model, student, tok, template=args.template,
                       temperature=args.reward_temperature or args.temperature,
                       kl_estimator=args.kl_estimator, micro_batch=args.micro_batch, device=device)
    # λ, α by 004 §A.1's rule on the initial teacher's explanations of B training problems
    alpha, lam = balanced(output_dir, args.init, partial(
        measure_balance, explain_fn, parts_of, solved(tasks, args.batch_size), args.group_size)
    ) if args.balance else (args.alpha, args.lam)
    score_fn = lambda t, s, e, p: rlt_reward(parts_of(t, s, e), p, alpha, lam, args.penalty)  # noqa
    eval_explain = partial(explain_fn, max_new_tokens=args.eval_max_new_tokens)
    evaluate = partial(held_out, eval_explain, score_fn, *zip(*eval_tasks), args.eval_samples)
    run = Run(output_dir, args.max_steps, model, tok, opt, ref=ref, **args.run_options(output_dir))
    if run.start == 0:  # where the init starts
        run.log(0, evaluate())
    B, G = args.batch_size // world, args.group_size  # B: this rank's prompts
    for step in run.steps():  # from run.start + 1: a resumed run goes on where its state ends
        warmup_lr(opt, args.lr, step, args.warmup_steps)  # constant after an optional warm-up
        # ---- sample: B (question, solution) prompts x G explanations from the teacher ----
        batch_tasks, sols = zip(*next_solved(run, tasks, B))
        samples, expl, pen = explain_fn(batch_tasks, sols, G, seed=step_seed(args.seed, step))
        run.sampled()
        # ---- score (the frozen student's view) and advantage ----
        rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731  per prompt -> per row
        reward, r_ss, r_kl = score_fn(rep(batch_tasks), rep(sols), expl, pen)          # (B*G,) each
        adv = grpo_advantages(reward.view(B, G)).flatten()                             # (B*G,)
        # ---- log-probs and loss, per micro-batch of rollouts (whole groups: --prompt_forward) ----
        stats = run.stats(B * G, sum(map(len, samples.completion_ids)))
        for rows, ids, attn, mask, sampler_logp, prompts in micro_batches(
                samples, args.micro_batch, tok.pad_token_id, device, share, args.forward_rows):
            m = mask[:, 1:].float()                                                    # (b, T-1)
            with autocast(device, model, ref):  # at the rollouts' T; each prompt's forward once
                out = token_stats(model, ids, attn, mask, args.temperature, entropy="logged",
                                  prompts=prompts)
                with torch.no_grad():
                    ref_logp = None if ref is None else token_stats(
                        ref, ids, attn, mask, args.temperature, prompts=prompts)["logp"]
            old_logp = out["logp"].detach()  # π_old: the trainer's forward (grpo.py, departure 1)
            loss, info = rlt_loss(out["logp"], old_logp, ref_logp, m, adv[rows].to(device),
                                  args.beta, args.epsilon, args.kl_ratio)
            # --term_grads, on diagnose steps only: an extra backward per term (each term's pull)
            stats.term_grads(info["terms"], B * G)
            loss = loss.sum() / (B * G)  # 1/G Σ_i, mean over prompts
            loss.backward()  # whole gradient (prompts too); torchrun: DDP averages over ranks
            stats.add("loss", loss.item())
            stats.token_mean("entropy", out["entropy"], m)
            stats.token_mean("kl", info["kl"], m)
            stats.sampler_gap(out["logp"], sampler_logp, m)
        # ---- the update: clip, the non-finite stop, step; then the reference's sync ----
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if run.finite(step, stats.sums["loss"], grad_norm):  # else stop (or --skip_nonfinite)
            opt.step()
        opt.zero_grad(set_to_none=True)
        mix_reference(ref, model, args.ref_sync_mix, step, args.ref_sync_every)  # 004: slowly moving
        expl_tokens = sum(map(len, tok(expl, add_special_tokens=False)["input_ids"]))
        # ---- log, evaluate, checkpoint ----
        metrics = {**stats.metrics(), **run.mean(rlt_metrics(samples, reward.view(B, G), r_ss, r_kl,
                                                             pen, expl_tokens))}  # every rank's
        if step == args.max_steps or (args.eval_every and step % args.eval_every == 0):
            run.checkpoint()  # first: an evaluation that fails loses nothing
            metrics.update(evaluate())
        run.log(step, metrics)
        if step == args.max_steps or step % args.save_every == 0:  # what --resume restarts from
            run.save(step)
    run.close()
    if args.export:  # by rank 0 under torchrun
        ex = solved(tasks, args.export_problems)
        run.on_rank0(lambda: export_traces(
            args.export, partial(explain_fn, max_new_tokens=export_len), score_fn, *zip(*ex),
            args.export_best_of, partial(student_row, template=args.template), args.seed,
            args.export_verified, args.export_redraws))
    return model


if __name__ == "__main__":
    cli(main)
