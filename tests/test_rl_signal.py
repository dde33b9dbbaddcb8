"""RL with a reward that is not zero: each RL script's update must move the log-probs of rewarded
rollouts up and of punished ones down, and the per-term gradient norms must say what each knob
pulls. An untrained tiny model never solves a problem, so every test here scripts the reward: a
rollout earns 1 when its first token id is odd, else 0 (a property of the text the model can
learn in one step). Each check was run against a broken copy (README, Tests)."""
import copy
import json

import pytest
import torch
from conftest import GEN, gap_bound

import grpo
import common as LP
from plumbing import models as M
import opd
import rloo
import rlt
import common as S
from plumbing.harness import StepStats

ONE_STEP = ["--term_grads", "--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "2",
            "--eval_samples", "1", "--eval_max_new_tokens", "4", "--batch_size", "4", "--group_size", "4",
            "--micro_batch", "8", "--max_response_len", "8", "--max_steps", "1", "--lr", "1e-3",
            "--temperature", "1.0", "--weight_decay", "0"]


def scripted(texts):
    """(n,) 1 for a text whose first character has an odd code point, else 0."""
    return torch.tensor([float(bool(x) and ord(x[0]) % 2) for x in texts])


def fake_score_rollouts(ro, tasks, reward="sparse", wrong_reward=0.1, no_answer_reward=0.0):
    r = scripted(ro.texts)
    return r, r.view(len(tasks), -1)


def fake_score_explanations(teacher, student, tok, tasks, sols, explanations, **kw):
    r = scripted(explanations)  # as reward_parts: r_SS's mean, nothing else (no --balance)
    return torch.stack([r, torch.zeros_like(r), torch.zeros_like(r), torch.zeros_like(r)], -1)


def record(monkeypatch, module, name):
    """Wrap module.name so that every call's result is kept, in order."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]
    monkeypatch.setattr(module, name, wrapper)
    return calls


@torch.no_grad()
def seq_logp(model, tok, ro, temperature=1.0):
    """Mean log-prob per token of each rollout (n,) under `model`, in fp32."""
    rows = list(range(len(ro.completion_ids)))
    ids, attn, mask, _ = LP.rollout_batch(ro, rows, tok.pad_token_id)[:4]
    logp = LP.token_stats(model, ids, attn, mask, temperature)["logp"]
    m = mask[:, 1:].float()
    return (logp * m).sum(-1) / m.sum(-1)


def moved_by_reward(init, model, tok, ro, reward):
    """(mean Δ log-prob of rewarded rollouts, of punished ones) after the update."""
    before, _ = M.load_model(init)
    delta = seq_logp(model, tok, ro) - seq_logp(before, tok, ro)
    return delta[reward == 1].mean().item(), delta[reward == 0].mean().item()


def run_one_step(module, argv, monkeypatch):
    """The script for one step, fp32, with the scripted reward; (model, the step's rollouts, their
    reward)."""
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")
    if module is rlt:  # the reward is of the explanation, which the rollout begins with
        monkeypatch.setattr(rlt, "score_explanations", fake_score_explanations)
        calls = record(monkeypatch, rlt, "explain")
    else:
        monkeypatch.setattr(module, "score_rollouts", fake_score_rollouts)
        calls = record(monkeypatch, module, "rollouts")
    out = module.main(argv)
    model = out[0] if isinstance(out, tuple) else out
    if module is rlt:  # the training batch, not the held-out evaluation's explanations
        ro, explanations, _ = next(c for c in calls if len(c[1]) == 16)
        return model, ro, scripted(explanations)
    return model, calls[0], scripted(calls[0].texts)


@pytest.mark.parametrize("module,extra", [
    (rloo, []),
    (rloo, ["--pg_norm", "mean"]),
    (grpo, ["--beta", "0.04", "--num_iterations", "2"]),
    (opd, ["--pg_norm", "mean"]),
    (rlt, ["--eval_every", "0", "--no-balance", "--penalty", "0"]),
])
def test_the_update_raises_rewarded_rollouts_and_lowers_punished_ones(module, extra, tiny_ckpt, tmp_path,
                                                                    monkeypatch):
    argv = ["--init", tiny_ckpt, *ONE_STEP, *extra, "--output_dir", str(tmp_path)]
    if module is opd:
        argv += ["--teacher", tiny_ckpt]  # teacher = student: the KL starts at 0 and pulls nowhere
    if module is rlt:
        argv += ["--student", tiny_ckpt]
    model, ro, reward = run_one_step(module, argv, monkeypatch)
    tok = M.load_model(tiny_ckpt)[1]
    assert 0 < reward.mean() < 1  # mixed groups: the advantage is not zero
    up, down = moved_by_reward(tiny_ckpt, model, tok, ro, reward)
    assert up > 0.02 and down < -0.02, (up, down)
    row = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")][-1]
    assert row["train/adv_std" if module is not rlt else "train/reward_std"] > 0
    assert row["grad/pg"] > 0 and row["train/grad_norm"] > 0
    if "--num_iterations" in extra:  # the second pass meets live tokens, under moved weights
        assert row["train/ratio_max"] > 1


@pytest.mark.parametrize("module", [rloo, opd])
def test_term_gradient_norms_scale_with_their_knobs_and_pg_norm_mean_levels_them(module, tiny_ckpt, tmp_path,
                                                                                 monkeypatch):
    """grad/entropy is λ_H times a fixed gradient, so it scales with the knob; --pg_norm mean divides
    the policy gradient by the rollouts' lengths, so entropy's share of it grows."""
    rows = {}
    for name, flags in (("sum", ["--entropy_coef", "1e-3"]), ("sum10", ["--entropy_coef", "1e-2"]),
                        ("mean", ["--entropy_coef", "1e-3", "--pg_norm", "mean"])):
        argv = ["--init", tiny_ckpt, *ONE_STEP, *flags, "--output_dir", str(tmp_path / name)]
        argv += ["--teacher", tiny_ckpt] if module is opd else []
        run_one_step(module, argv, monkeypatch)
        rows[name] = [json.loads(x) for x in open(tmp_path / name / "metrics.jsonl")][1]
    assert {"grad/pg", "grad/entropy", "grad/kl"} <= set(rows["sum"])
    assert rows["sum10"]["grad/entropy"] == pytest.approx(10 * rows["sum"]["grad/entropy"], rel=1e-3)
    assert rows["sum10"]["grad/pg"] == pytest.approx(rows["sum"]["grad/pg"], rel=1e-5)
    share = {k: rows[k]["grad/entropy"] / rows[k]["grad/pg"] for k in ("sum", "mean")}
    assert share["mean"] > 3 * share["sum"], share  # the rollouts are up to 8 tokens long


def test_step_stats_term_grads_are_norms_of_the_summed_gradient():
    """Over two micro-batches the norm of the summed gradient, not the sum of the norms: two halves
    that pull opposite ways cancel."""
    w = torch.nn.Linear(2, 1, bias=False)
    stats = StepStats(2, 2, w)
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    for i in range(2):
        stats.term_grads({"pg": w(x[i:i + 1])[:, 0]}, 1)
    assert stats.metrics()["grad/pg"] == 0.0
    stats = StepStats(2, 2, w)
    stats.term_grads({"pg": w(x[:1])[:, 0] * 3, "kl": w(x[1:])[:, 0]}, 2)
    m = stats.metrics()
    assert m["grad/pg"] == pytest.approx(1.5) and m["grad/kl"] == pytest.approx(0.5)
    assert w.weight.grad is None  # measuring leaves the real gradient alone
    assert "grad/pg" not in StepStats(2, 2).metrics()  # not a diagnose step: nothing measured


@pytest.mark.parametrize("bf16", ["0", "1"])
def test_the_canary_passes_a_synced_sampler_and_catches_a_stale_one(bf16, tiny_ckpt, tmp_path, monkeypatch):
    """train/sampler_gap under either training precision (COUNTDOWN_CPU_BF16 forces the bf16 path on
    any CPU): within gap_bound when the sampler is the policy, far beyond it from step 2 when the
    sampler keeps the init's weights (TRL issue 5312's bug)."""
    monkeypatch.setattr(rloo, "score_rollouts", fake_score_rollouts)
    real = rloo.make_sampler
    for stale in (False, True):
        def make_sampler(backend, model, tok, *args):
            if not stale:
                return real(backend, model, tok, *args)
            frozen = S.HFSampler(copy.deepcopy(model), tok)
            frozen.sync = lambda model: None  # the bug: the trainer's weights never arrive
            return frozen
        monkeypatch.setattr(rloo, "make_sampler", make_sampler)
        monkeypatch.setenv("COUNTDOWN_CPU_BF16", bf16)
        out = tmp_path / str(stale)
        rloo.main(["--init", tiny_ckpt, *ONE_STEP, "--max_steps", "2", "--output_dir", str(out)])
        gaps = [json.loads(x).get("train/sampler_gap") for x in open(out / "metrics.jsonl")][1:]
        assert gaps[0] < gap_bound(bf16 == "1")  # step 1: nothing has moved yet
        assert (gaps[1] > 10 * gap_bound(True)) if stale else (gaps[1] < gap_bound(bf16 == "1")), gaps


def test_grpo_mask_truncated_drops_cut_rollouts_from_the_loss(tiny_ckpt, tmp_path, monkeypatch):
    """--mask_truncated (002 §3): rollouts cut at the budget leave the loss. Every rollout marked cut:
    no gradient and no step (no weight decay, no reference); half of them: the rest still learn."""
    init, _ = M.load_model(tiny_ckpt)
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")
    monkeypatch.setattr(grpo, "score_rollouts", fake_score_rollouts)
    real = grpo.rollouts
    for cut_every in (1, 2):
        def rollouts(*args, **kwargs):
            ro = real(*args, **kwargs)
            ro.finished = [i % cut_every != 0 for i in range(len(ro.finished))]
            return ro
        monkeypatch.setattr(grpo, "rollouts", rollouts)
        out = tmp_path / str(cut_every)
        model, _ = grpo.main(["--init", tiny_ckpt, *ONE_STEP, "--beta", "0", "--mask_truncated",
                              "--output_dir", str(out)])
        row = [json.loads(x) for x in open(out / "metrics.jsonl")][1]
        moved = any(not torch.equal(p0, p) for p0, p in zip(init.parameters(), model.parameters()))
        assert (row["grad/pg"] == 0 and not moved) if cut_every == 1 else (row["grad/pg"] > 0 and moved)
