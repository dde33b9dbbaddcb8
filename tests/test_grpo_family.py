"""grpo.py's family, each flag against its paper: GSPO's sequence ratio (Zheng et al. 2025, arXiv
2507.18071), CISPO's clipped, detached weight (MiniMax-M1, arXiv 2506.13585, Eq. 4), DAPO's
overlong shaping (Eq. 13) and dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Alg. 1). The
losses by hand, values and gradients; dynamic sampling on scripted scores; a 2-step run of each.
Each check was seen failing on a broken copy (docs/studies/grpo_family.md, "Tests")."""
import json
import math

import pytest
import torch
from conftest import GEN, run_cli

import grpo

LOG = torch.log


def _grad(loss, x):
    return torch.autograd.grad(loss.sum(), x)[0]


def test_gspo_ratio_is_the_geometric_mean_of_the_token_ratios_and_clips_whole_rollouts():
    """Row 0: token ratios 2, 0.5, 1 (arithmetic mean 7/6, geometric 1); row 1: 1.5 each, over
    1 + ε with A > 0, so every token of it is clipped and has no gradient; row 2: a masked token's
    ratio (100) stays out of s_i."""
    logp = LOG(torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.5, 1.5], [2.0, 2.0, 100.0]])).requires_grad_()
    old, mask, adv = torch.zeros(3, 3), torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 0]]), torch.ones(3)
    loss, parts = grpo.grpo_loss(logp, old, None, adv, 0.0, 0.2, mask=mask, ratio_level="sequence")
    assert torch.allclose(parts["ratio"][:, 0], torch.tensor([1.0, 1.5, 2.0]))  # s_i: geometric
    assert torch.allclose(parts["ratio"], parts["ratio"][:, :1].expand(3, 3))  # one ratio a rollout
    assert torch.equal(parts["clipped"], torch.tensor([[0.0] * 3, [1.0] * 3, [1.0] * 3]))
    assert torch.allclose(loss, torch.tensor([[-1.0] * 3, [-1.2] * 3, [-1.2] * 3]))
    # each token's gradient: −s_i·A where s_i is not clipped (GSPO-token's form), 0 on a clipped rollout
    assert torch.allclose(_grad(loss, logp), torch.tensor([[-1.0] * 3, [0.0] * 3, [0.0] * 3]))
    token = grpo.grpo_loss(logp, old, None, adv, 0.0, 0.2, mask=mask)[1]["ratio"]
    assert torch.allclose(token[0], torch.tensor([2.0, 0.5, 1.0]))  # the token level: ρ_it itself


def test_gspo_per_token_form_with_seq_mean_is_the_sequence_objective():
    """Σ_t over the per-token form, / |y_i| (seq-mean), has the gradient of GSPO's −s_i·A_i with
    s_i = exp(mean_t log ρ_it): random log-probs, ragged masks, both signs of A, inside the clip."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 6, generator=g)).requires_grad_()
    old = logp.detach() + 0.01 * torch.randn(4, 6, generator=g)
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [5]])).float()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    per_token, _ = grpo.grpo_loss(logp, old, None, adv, 0.0, 0.2, mask=mask, ratio_level="sequence")
    ours = _grad(grpo.aggregate(per_token, mask, "seq-mean", 4, int(mask.sum()), 6), logp)
    s = (((logp - old) * mask).sum(-1) / mask.sum(-1)).exp()  # (b,)
    theirs = _grad(-(s * adv).mean(), logp)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_cispo_keeps_a_gradient_on_capped_tokens_where_ppos_clip_has_none():
    """Ratios 1.5, 1.1, 0.5, 0.9, ε_hi 0.2: CISPO's weight min(ρ, 1.2) = 1.2, 1.1, 0.5, 0.9,
    detached, so each token's gradient is −w·A, the capped one's too (PPO: 0). No lower bound:
    with A < 0 the 0.5 token keeps its gradient (PPO's floor at 0.8 takes it)."""
    ratios = torch.tensor([[1.5, 1.1, 0.5, 0.9]])
    logp, old = LOG(ratios).requires_grad_(), torch.zeros(1, 4)
    for A in (1.0, -1.0):
        adv = torch.tensor([A])
        loss, parts = grpo.grpo_loss(logp, old, None, adv, 0.0, 0.2, loss_type="cispo")
        w = torch.tensor([[1.2, 1.1, 0.5, 0.9]])
        assert torch.allclose(loss, -w * A * logp.detach())  # −sg(min(ρ, 1 + ε_hi))·A·log π
        grad = _grad(loss, logp)
        assert torch.allclose(grad, -w * A)  # detached: no ρ·log π term
        assert torch.equal(parts["clipped"], torch.tensor([[1.0, 0, 0, 0]]))  # capped, either sign
        ppo = _grad(grpo.grpo_loss(logp, old, None, adv, 0.0, 0.2)[0], logp)
        assert ppo[0, 0 if A > 0 else 2] == 0 and grad[0, 0 if A > 0 else 2] != 0
    # epsilon_high is an offset from 1 (verl's convention): 1 + 0.5 caps nothing here
    loss, parts = grpo.grpo_loss(logp, old, None, torch.tensor([1.0]), 0.0, 0.2, 0.5, loss_type="cispo")
    assert torch.allclose(_grad(loss, logp), -ratios) and parts["clipped"].sum() == 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_gspo_and_cispo_take_grpos_step_on_policy(agg):
    """At μ = 1, π_old is this very forward (ρ = 1): GSPO's and CISPO's gradients are GRPO's."""
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 5, generator=g)).requires_grad_()
    mask, adv = (torch.arange(5) < torch.tensor([[5], [2], [4]])).float(), torch.tensor([0.7, -1.2, 0.3])
    grads = []
    for kw in ({}, {"ratio_level": "sequence"}, {"loss_type": "cispo"}):
        per_token, _ = grpo.grpo_loss(logp, logp.detach(), None, adv, 0.0, 3e-4, 4e-4, mask=mask, **kw)
        grads.append(_grad(grpo.aggregate(per_token, mask, agg, 3, int(mask.sum()), 5), logp))
    assert torch.allclose(grads[0], grads[1], atol=1e-7) and torch.allclose(grads[0], grads[2], atol=1e-7)
    assert grads[0].abs().sum() > 0


def test_overlong_penalty_is_zero_before_the_buffer_and_minus_factor_at_the_budget():
    """DAPO Eq. 13 with L_max 160, L_buf 32, factor 0.5: 0 up to 128 tokens, linear after."""
    lengths = torch.tensor([0.0, 100, 128, 136, 144, 160])
    want = torch.tensor([0.0, 0, 0, -0.125, -0.25, -0.5])
    assert torch.allclose(grpo.overlong_penalty(lengths, 160, 32, 0.5), want)


def test_flat_groups_are_the_verifiers_all_right_or_all_wrong_whatever_the_reward():
    """Groups of 4 by score: all 1 (flat), wrong answers and none (flat: no rollout solves it, what
    partial credit a dense reward gives), mixed (kept), all 0 (flat)."""
    scores = torch.tensor([1, 1, 1, 1, 0.1, 0.1, 0, 0.1, 1, 0.1, 0, 0, 0, 0, 0, 0])
    assert grpo.flat_groups(scores, 4).tolist() == [True, True, False, True]


# ---- dynamic sampling, end to end on the tiny model with scripted scores -------------------------
ONE = ["--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "2", "--eval_samples", "1",
       "--eval_max_new_tokens", "4", "--batch_size", "4", "--group_size", "4", "--micro_batch", "8",
       "--max_response_len", "6", "--lr", "1e-3", "--temperature", "1.0"]


def scripted_scores(informative):
    """score_rollouts as the verifier would: a task `informative(task)` picks gets one right answer
    in its group; any other gets only wrong ones, and under --reward dense partial credit that differs
    within the group (0.1, 0.2, ...), as near misses earn."""
    def score_rollouts(ro, tasks, reward="sparse", wrong_reward=0.1, no_answer_reward=0.0):
        G = len(ro.texts) // len(tasks)
        scores, rewards = [], []
        for t in tasks:
            s = [1.0] + [0.1] * (G - 1) if informative(t) else [0.1] * G
            scores += s
            rewards += [x if (x == 1 or reward != "dense") else 0.1 * (j + 1) for j, x in enumerate(s)]
        return torch.tensor(scores), torch.tensor(rewards).view(len(tasks), G)
    return score_rollouts


def _run(ckpt, tmp_path, monkeypatch, informative, *flags):
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")
    monkeypatch.setattr(grpo, "score_rollouts", scripted_scores(informative))
    seen = []  # each step's rewards as the advantage sees them, and its tasks

    def advantages(reward, scale=True, eps=1e-4):
        seen.append(reward.clone())
        return real(reward, scale, eps)
    real = grpo.grpo_advantages
    monkeypatch.setattr(grpo, "grpo_advantages", advantages)
    grpo.main(["--init", ckpt, *ONE, *flags, "--output_dir", str(tmp_path / "run")])
    return [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")][1:], seen


def test_dynamic_sampling_fills_the_batch_with_groups_the_verifier_splits(tiny_ckpt, tmp_path, monkeypatch):
    """Half the targets odd, half even; only odd targets' groups are informative. Under a dense
    reward, the even ones' all-wrong groups have a reward spread (an advantage), yet the verifier's
    accuracy leaves them out: every group trained on has a right and a wrong answer, the step holds
    --batch_size of them, and the log counts what filling it cost."""
    rows, seen = _run(tiny_ckpt, tmp_path, monkeypatch, lambda t: t["target"] % 2 == 1, "--reward", "dense",
                      "--dynamic_sampling", "--max_steps", "2", "--max_sample_batches", "10")
    for row, reward in zip(rows, seen):
        assert reward.shape == (4, 4) and (reward == 1).sum(1).tolist() == [1, 1, 1, 1]
        assert row["train/zero_adv_groups"] == 0 and row["train/groups_kept"] == 4
        n = row["train/batches_sampled"]
        assert row["train/rollouts_sampled"] == n * 16 and row["train/groups_dropped"] == (n - 1) * 4
        assert 0 < row["train/flat_groups"] < 1
    assert max(r["train/batches_sampled"] for r in rows) > 1  # a refill happened
    # without the flag: one batch, flat groups and all, and none of the counts
    rows, seen = _run(tiny_ckpt, tmp_path / "off", monkeypatch, lambda t: t["target"] % 2 == 1, "--reward", "dense",
                      "--max_steps", "2")
    assert "train/batches_sampled" not in rows[0]
    assert any((r == 1).sum() < 4 for r in seen)


def test_dynamic_sampling_stops_at_its_cap_and_trains_on_what_it_has(tiny_ckpt, tmp_path, monkeypatch):
    """No group is informative: the refill ends after --max_sample_batches draws, the step trains
    on --batch_size flat groups (A = 0) and its log says none was kept."""
    rows, seen = _run(tiny_ckpt, tmp_path, monkeypatch, lambda t: False, "--dynamic_sampling", "--max_steps", "1",
                      "--max_sample_batches", "3")
    assert rows[0]["train/batches_sampled"] == 3 and rows[0]["train/groups_kept"] == 0
    assert rows[0]["train/rollouts_sampled"] == 48 and rows[0]["train/flat_groups"] == 1
    assert seen[0].shape == (4, 4) and rows[0]["train/zero_adv_groups"] == 1


# ---- each variant two steps on the tiny model, as every script has -------------------------------
@pytest.mark.parametrize("flags", [["--ratio_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4"],
                                   ["--loss_type", "cispo", "--epsilon_high", "0.28"],
                                   ["--dynamic_sampling", "--max_sample_batches", "2"],
                                   ["--overlong_buffer", "4", "--overlong_factor", "0.5"]])
def test_each_variant_runs_two_steps(tiny_ckpt, tmp_path, monkeypatch, flags):
    """Two steps of two passes each (μ = 2: the second pass has ρ ≠ 1): finite losses, and GSPO's
    clip_frac a share of rollouts (a whole number of the 16 over the two passes). Scores scripted
    (an untrained model solves nothing: no advantage, no move)."""
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")
    monkeypatch.setattr(grpo, "score_rollouts", scripted_scores(lambda t: t["target"] % 2 == 1))
    real = grpo.rollouts

    def rollouts(*args, **kwargs):  # groups 1 and 3 of 3 tokens: a share of rollouts is not of tokens
        ro = real(*args, **kwargs)
        for i in [i for i in range(len(ro.completion_ids)) if i // 4 % 2]:
            ro.completion_ids[i], ro.logprobs[i] = ro.completion_ids[i][:3], ro.logprobs[i][:3]
        return ro
    monkeypatch.setattr(grpo, "rollouts", rollouts)
    out = tmp_path / "run"
    grpo.main(["--init", tiny_ckpt, *ONE, "--max_steps", "2", "--num_iterations", "2",
               *flags, "--output_dir", str(out)])
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")][1:]
    assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
    if "sequence" in flags:
        for r in rows:
            n = r["train/clip_frac"] * 2 * 16  # the mean over 2 passes of clipped rollouts / 16
            assert abs(n - round(n)) < 1e-6, r["train/clip_frac"]
        assert max(r["train/clip_frac"] for r in rows) > 0  # lr 1e-3 moves s_i past 1 ± 4e-4
    if "--overlong_buffer" in flags:  # 6-token budget, buffer 4: rollouts cut at 6 earn −0.5
        assert min(r["train/reward"] for r in rows) < 0


@pytest.mark.parametrize("flags", [["--max_sample_batches", "0"], ["--overlong_buffer", "-4"],
                                   ["--overlong_buffer", "7"], ["--ratio_level", "seq"], ["--loss_type", "gspo"]])
def test_a_family_flag_it_cannot_take_is_one_line(tiny_ckpt, tmp_path, flags):
    """A bad value stops before anything loads, with one line naming the flag (budget: 6 tokens)."""
    r = run_cli("grpo.py", "--init", tiny_ckpt, *ONE, *flags, "--output_dir", str(tmp_path / "run"))
    assert r.returncode == 2 and flags[0] in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
