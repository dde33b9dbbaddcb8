"""OPD: on-policy distillation from a frozen teacher, hybrid with RLOO (paper 000 §3.3, Eq. 4, Algorithm 1).

    L = λ_KL · mean_t KL(softmax(z_T/T) ‖ softmax(z_S/T))  +  λ_RL · L_PG  −  λ_H · mean_t H(softmax(z_S))   (Eq. 4)
    L_PG = −w_i A_i log π_θ(y_i|x),  A_i = R_i − mean_{j≠i} R_j,  w_i = clip(π_θ/μ, max 10)           (Eq. 3)

The student samples; the teacher only scores the student's own tokens, so its guidance lands where the
student actually goes. Forward KL (teacher first) is mode-covering: the student pays for giving low mass
to any token the teacher finds plausible. λ_KL = λ_RL = 0.5 lets the verifier overrule an imperfect teacher.
Anti-collapse (000 §3.3, Table 5) is two flags: --entropy_coef 1e-2 --kd_temperature 1.3. L_PG and H use
the rollout distribution softmax(z_S / --temperature), the one μ sampled from (1.0 in the paper); the KL
has its own T. Watch `train/is_weight_raw`, w before its clip: the paper's rises to ~12.4 (App. B).
Departures from the paper:
  1. The KL and the entropy are means over each rollout's tokens, then averaged over rollouts like L_PG.
  2. No T² rescaling of the KL (as in the paper): raising T also shrinks the KL's gradient.
  3. Embedded setting: a stronger tiny teacher written by sft.py, 64 prompts x 8, lr 1e-4, a wrong answer
     rewarded -0.5 in the RL half (README, "OPD"; docs/arithmetic.md).

Real (1×H100, the paper's recipe = the defaults):  python opd.py --init out/sft --teacher out/teacher --backend vllm
  anti-collapse: python opd.py --init out/opd --entropy_coef 1e-2 --kd_temperature 1.3 --max_steps 150 --output_dir out/opd_ac
CPU (embedded): the `opd` and `opd_anticollapse` stages of run_cpu.sh, which prints their exact commands.
"""
import random
import time
from dataclasses import dataclass

import torch

from checkpoints import load_state, prepare_run, save_checkpoint, save_state, step_is_finite
from common import CountdownError, Logger, arg, autocast, check_same_tokenizer, cli, load_model, load_tasks, \
    parse_args, seed_everything, token_stats, warmup_lr
from evaluate import eval_metrics
from sampler import make_sampler, rollout_batch, rollouts, score_rollouts


@dataclass
class Args:
    # shared by every script, in this order
    init: str = arg("out/sft", "checkpoint to start from (the student: SFT model, or OPD for anti-collapse)")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks whose prompts are rolled out (its train split)")
    eval_data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4", "tasks for periodic pass@k (its `val` split)")
    output_dir: str = arg("out/opd", "where the checkpoint, args.json and metrics.jsonl go")
    seed: int = arg(0, "seed for task order and sampling")
    template: str = arg("base", "prompt template: base | compact")
    lr: float = arg(1e-5, "constant learning rate (000 Table 5)")
    warmup_steps: int = arg(0, "linear lr warm-up over this many steps, then constant (0: none, as the paper)")
    batch_size: int = arg(128, "prompts per step; each gets --group_size rollouts (000 Table 5: 128 x 8)")
    micro_batch: int = arg(8, "rollouts per forward/backward (bounds memory: student + teacher activations)")
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
    max_steps: int = arg(100, "optimizer steps, one rollout batch each (000 Table 5: 100; anti-collapse 150)")
    group_size: int = arg(8, "G rollouts per prompt (000 Table 5)")
    temperature: float = arg(1.0, "rollout temperature; log-probs are of logits / T (000 Table 5: 1.0; top_p 1, no top_k)")
    reward: str = arg("sparse", "sparse: verifier.score 1/0.1/0 (000) | dense: partial credit for near misses (001)")
    wrong_reward: float = arg(0.1, "sparse reward of a wrong answer (000: 0.1); 0 or below when the budget cuts many "
                                   "searches short, or the 0.1 pays for claiming success falsely (docs/arithmetic.md)")
    backend: str = arg("hf", "sampler: hf (plain PyTorch, CPU ok) | vllm (GPU; pinned in sampler.py)")
    # OPD specific
    teacher: str = arg("out/teacher", "frozen teacher checkpoint; must share the student's tokenizer")
    kl_coef: float = arg(0.5, "λ_KL, weight of the forward KL to the teacher (000 Algorithm 1)")
    rl_coef: float = arg(0.5, "λ_RL, weight of the RLOO policy gradient (000 Algorithm 1; 0: pure distillation)")
    entropy_coef: float = arg(1e-3, "λ_H, entropy bonus (000: 1e-3; anti-collapse 1e-2)")
    kd_temperature: float = arg(1.0, "T of the distillation KL (000: 1.0; anti-collapse 1.3)")
    is_clip: float = arg(10.0, "w_max, clip of the sequence importance weight π_θ/μ (000 Table 5)")


def rloo_advantages(reward):
    """Eq. 3's leave-one-out baseline (Algorithm 1 line 2). reward (B, G) -> A (B, G): each rollout minus
    the mean of the other G−1 of its prompt; every group sums to zero."""
    G = reward.shape[1]
    baseline = (reward.sum(1, keepdim=True) - reward) / (G - 1)                       # (B, G)
    return reward - baseline


def opd_loss(logp, old_logp, teacher_kl, entropy, mask, adv, args):
    """Algorithm 1 lines 5-9 per rollout (b,). logp, old_logp: the student's and the sampler μ's log-probs
    of the sampled tokens, both at the rollout temperature; teacher_kl: KL(teacher ‖ student) at
    kd_temperature per token; entropy: the student's; all (b, T-1); mask (b, T-1); adv (b,). The caller
    averages over rollouts."""
    n_tok = mask.sum(-1).clamp(min=1)                                                  # (b,)
    logp_seq, old_seq = (logp * mask).sum(-1), (old_logp * mask).sum(-1)               # (b,) log π(y_i|x)
    w_raw = (logp_seq - old_seq).detach().exp()                                        # (b,) line 6, detached
    w = w_raw.clamp(max=args.is_clip)
    pg = -w * adv * logp_seq                                                           # (b,) line 7
    kl = (teacher_kl * mask).sum(-1) / n_tok                                           # (b,) line 5: mean_t
    ent = (entropy * mask).sum(-1) / n_tok                                             # (b,) line 8: mean_t
    loss = args.kl_coef * kl + args.rl_coef * pg - args.entropy_coef * ent             # (b,) line 9 (Eq. 4)
    return loss, {"pg": pg.detach(), "is_weight": w, "is_weight_raw": w_raw}


def main(argv=None):
    args = parse_args(Args, argv)
    seed_everything(args.seed)
    if args.reward not in ("sparse", "dense"):
        raise CountdownError(f"--reward must be sparse or dense, not {args.reward!r}")
    if args.group_size < 2:
        raise CountdownError("--group_size must be at least 2: the baseline is the other rollouts of the prompt")
    if args.kd_temperature <= 0:
        raise CountdownError(f"--kd_temperature must be positive, not {args.kd_temperature}")
    prepare_run(args)  # refuse to write over a run, or point --resume at one
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(args.init, device, torch.float32)  # fp32 master weights; bf16 compute via autocast
    # The teacher never trains: bf16 weights on a GPU halve its memory (000: a 7B teacher beside a 0.5B student).
    teacher, teacher_tok = load_model(args.teacher, device, torch.bfloat16 if device == "cuda" else torch.float32)
    teacher.eval().requires_grad_(False)
    check_same_tokenizer(tok, teacher_tok, args.init, args.teacher)
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
        # ---- sample: B prompts x G rollouts from the student's snapshot μ ----
        if len(order) < B:
            order = rng.sample(range(len(tasks)), len(tasks))
        batch, order = [tasks[i] for i in order[:B]], order[B:]
        ro = rollouts(sampler, model, tok, batch, G, args, seed=args.seed * 100_003 + step)
        t_sample = time.time() - t0
        # ---- score and advantage ----
        exact, reward = score_rollouts(ro, batch, args.reward, args.wrong_reward)  # (B*G,), (B, G)
        adv = rloo_advantages(reward).flatten()                                        # (B*G,)
        # ---- forward / backward per micro-batch: student with grad, teacher without ----
        by_len = sorted(range(B * G), key=lambda r: len(ro.completion_ids[r]))  # micro-batches of like lengths: little padding
        sums = {k: 0.0 for k in ("loss", "kl", "pg", "entropy", "is_weight", "is_weight_raw")}
        gap, w_max, n_tok = 0.0, 0.0, sum(map(len, ro.completion_ids))
        for s in range(0, B * G, args.micro_batch):
            rows = by_len[s:s + args.micro_batch]
            ids, attn, mask, old_logp = (x.to(device) for x in rollout_batch(ro, rows, tok.pad_token_id))
            with autocast(device, model, teacher):  # logp, entropy at the rollout T, the KL at kd_temperature, in vocab chunks
                st = token_stats(model, ids, attn, mask, temperature=args.temperature, entropy=True, teacher=teacher,
                                 kd_temperature=args.kd_temperature)
            m = mask[:, 1:].float()                                                    # (b, T-1)
            loss, parts = opd_loss(st["logp"], old_logp, st["kl"], st["entropy"], m, adv[rows].to(device), args)
            loss = loss.sum() / (B * G)                                                # mean over rollouts
            loss.backward()
            sums["loss"] += loss.item()
            for k in ("pg", "is_weight", "is_weight_raw"):  # means over rollouts
                sums[k] += parts[k].sum().item() / (B * G)
            for k in ("kl", "entropy"):  # token means over the batch, as rloo.py logs them
                sums[k] += (st[k].detach() * m).sum().item() / n_tok
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
