"""The instructor's hidden cases (course/instructor.md), left out of a handout: for each graded
function, inputs that never ship to students, drawn at random from a seed of the instructor's, of
other shapes than tests/test_graded.py's hand-computed ones, with masks, padding, equal groups, a
missing reference. course/grade.py calls the reference functions on them in the instructor's
repo and holds each submission's to the same results: every value, key, shape and dtype the
reference returns, its gradients to the inputs that carry one. A function fitted to the visible
cases fails here. tests/test_graders.py checks that the reference passes them all.

CASES[module.function](rng) -> [(what, args, kwargs)]: `what` is the one-line description a
failure prints; tensors in args that require grad are the ones whose gradients are compared."""
import torch


def _logp(g, *shape):
    return (-torch.rand(*shape, generator=g) * 3 - 0.01).requires_grad_()


def _mask(g, b, t):
    """Right-padded response masks (b, t), one row with a single token, one full."""
    n = torch.randint(1, t + 1, (b,), generator=g)
    n[0], n[-1] = 1, t
    return (torch.arange(t)[None] < n[:, None]).float()


def _rewards(g, b, k):
    """(b, k) rewards in {0, 0.1, 1} with an all-equal group (row 0)."""
    r = torch.tensor([0.0, 0.1, 1.0])[torch.randint(0, 3, (b, k), generator=g)]
    r[0] = r[0, 0]
    return r


def _seqs(g, b, t):
    return _logp(g, b, t), -torch.rand(b, t, generator=g) * 3, _mask(g, b, t)


def score_cases(g):
    a = lambda e: f"<think>tries</think>\n<answer>{e}</answer>"  # noqa: E731
    cases = [(a("(7 - 2) * 9 + 4"), [7, 2, 9, 4], 49), (a("4 + 9 * (7 - 2)"), [7, 2, 9, 4], 49),
             (a("(7 - 2) * 9 + 4"), [7, 2, 9, 4], 50), (a("(7 - 2) * 9"), [7, 2, 9, 4], 45),
             (a("(7 - 2) * 9 + 4 + 4"), [7, 2, 9, 4], 53), (a("18 / (8 - 5)"), [18, 8, 5], 6),
             (a("18 / (5 - 5)"), [18, 5, 5], 6), (a("2 ** 3 + 5"), [2, 3, 5], 13), (a("-2 + 9 + 6"), [2, 9, 6], 13),
             (a("x + 9"), [4, 9], 13), (a("13"), [4, 9], 13), (a("4 + 9 = 13"), [4, 9], 13),
             ("<answer>4 + 9</answer><answer>4 * 9</answer>", [4, 9], 13), ("<answer>4 + 9", [4, 9], 13),
             ("no tags at all: 4 + 9", [4, 9], 13), (a(" ( 4+9 ) "), [4, 9], 13), (a("6 / 4 * 2"), [6, 4, 2], 3),
             (a("12 // 4 + 1"), [12, 4, 1], 4), (a("3.0 + 4"), [3, 4], 7)]
    return [(f"{r!r} with {n} -> {t}", [r, n, t], {}) for r, n, t in cases]


def _sft(g):
    return [(f"log-probs {(b, t)}, masks of 1 to {t} tokens", [_logp(g, b, t), _mask(g, b, t)], {})
            for b, t in ((3, 5), (1, 7))]


def _ipo(g):
    out = []
    for b, beta in ((5, 0.3), (2, 0.05)):
        x = [_logp(g, b), _logp(g, b), -torch.rand(b, generator=g), -torch.rand(b, generator=g)]
        out.append((f"{b} pairs, β {beta}", x, {"beta": beta}))
    return out


def _seq_logp(g):
    return [(f"log-probs (4, 6), length_norm {n}", [_logp(g, 4, 6), _mask(g, 4, 6), n], {}) for n in (False, True)]


def _adv(g):
    return [("rewards (5, 6) in {0, 0.1, 1}, an equal group", [_rewards(g, 5, 6)], {}),
            ("rewards (2, 2)", [_rewards(g, 2, 2)], {})]


def _rloo_adv(g):
    return _adv(g) + [("rewards (4, 3), positive_weight 0.3", [_rewards(g, 4, 3), 0.3], {})]


def _grpo_adv(g):
    return _adv(g) + [("rewards (4, 5), scale False", [_rewards(g, 4, 5)], {"scale": False})]


def _is(g):
    return [("log-ratios of 6 rollouts from -3 to 3, clip 2", [_logp(g, 6), -torch.rand(6, generator=g) * 3],
             {"clip": 2.0})]


def _k3(g):
    logp, other, _ = _seqs(g, 3, 4)
    return [("(3, 4) log-probs, no sample_logp", [logp, other], {}),
            ("(3, 4) log-probs, with sample_logp", [logp, other, -torch.rand(3, 4, generator=g)], {})]


def _rloo_loss(g):
    out = []
    for kl_ratio, pg_norm in ((True, "sum"), (False, "mean")):
        logp, old, mask = _seqs(g, 4, 6)
        ent = torch.rand(4, 6, generator=g).requires_grad_()
        adv = torch.randn(4, generator=g)
        out.append((f"(4, 6) rollouts, λ_H 0.01, λ_KL 0.1, clip 3, kl_ratio {kl_ratio}, pg_norm {pg_norm!r}",
                    [logp, old, ent, mask, adv, 0.01, 0.1, 3.0, kl_ratio, pg_norm], {}))
    return out


def _grpo_loss(g):
    out = []
    for ref, eps_hi, kl_ratio, w in ((True, 0.0, True, False), (False, 0.28, False, False), (True, 0.0, False, True)):
        logp, old, mask = _seqs(g, 3, 5)
        old = logp.detach() + torch.randn(3, 5, generator=g) * 0.3
        kw = {"beta": 0.1, "epsilon": 0.2, "epsilon_high": eps_hi, "kl_ratio": kl_ratio}
        if w:  # an off-policy correction's weights (off_policy_weight)
            kw["is_weight"] = torch.rand(3, 5, generator=g) + 0.5
        out.append((f"(3, 5) rollouts, reference {ref}, ε_high {eps_hi}, kl_ratio {kl_ratio}, is_weight {w}",
                    [logp, old, -torch.rand(3, 5, generator=g) * 3 if ref else None, torch.randn(3, generator=g)], kw))
    return out


def _sequence_log_ratio(g):
    out = []
    for b, t in ((4, 6), (2, 5)):
        logp, _, mask = _seqs(g, b, t)
        old = logp.detach() + torch.randn(b, t, generator=g) * 0.4
        out.append((f"({b}, {t}) log-probs, log π_old = log π_θ + N(0, 0.4²), right-padded masks of 1 to {t} tokens",
                    [logp, old, mask], {}))
    return out


def _cispo_surrogate(g):
    out = []
    for eps_hi in (0.28, 0.2):
        logp = _logp(g, 3, 5)
        ratio = (torch.rand(3, 5, generator=g) * 1.7 + 0.3).requires_grad_()  # 0.3 to 2: under 1 − ε and over 1 + ε
        out.append((f"(3, 5) ratios from 0.3 to 2, A (3, 1) drawn from N(0, 1), ε_hi {eps_hi}",
                    [ratio, logp, torch.randn(3, 1, generator=g), eps_hi], {}))
    return out


def _aggregate(g):
    return [(f"(3, 5) per-token, mode {m!r}, n_rows 6, n_tokens 19, max_len 7",
             [torch.randn(3, 5, generator=g).requires_grad_(), _mask(g, 3, 5), m, 6, 19, 7], {})
            for m in ("seq-mean", "token-mean", "constant")]


def _opd_loss(g):
    out = []
    for pg_norm in ("sum", "mean"):
        logp, old, mask = _seqs(g, 4, 5)
        kl, ent = (torch.rand(4, 5, generator=g).requires_grad_() for _ in range(2))
        out.append((f"(4, 5) rollouts, λ_KL 0.7, λ_RL 0.3, λ_H 0.01, clip 2, pg_norm {pg_norm!r}",
                    [logp, old, kl, ent, mask, torch.randn(4, generator=g), 0.7, 0.3, 0.01, 2.0, pg_norm], {}))
    return out


def _rlt_loss(g):
    out = []
    for ref in (True, False):
        logp, _, mask = _seqs(g, 3, 6)
        old = logp.detach() + torch.randn(3, 6, generator=g) * 0.3
        out.append((f"(3, 6) rollouts, reference {ref}, β 0.1, ε 0.2",
                    [logp, old, -torch.rand(3, 6, generator=g) * 3 if ref else None, mask,
                     torch.randn(3, generator=g), 0.1, 0.2], {"kl_ratio": ref}))
    return out


def _reward_parts(g):
    sol = torch.tensor([[0.0, 0, 0, 0, 1, 1]] * 3)
    expl = torch.tensor([[1.0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    return [("3 rows of 6 tokens, one explanation empty, negative KL_t",
             [-torch.rand(3, 6, generator=g) * 4, torch.randn(3, 6, generator=g), sol, expl], {})]


def _rlt_reward(g):
    return [("5 rows, α 0.05, λ 1.5, penalty -2", [torch.randn(5, 4, generator=g), [True, False, False, True, False]],
             {"alpha": 0.05, "lam": 1.5, "penalty": -2.0})]


CASES = {
    "verifier.score": score_cases, "verifier.dense_score": score_cases, "sft.sft_loss": _sft,
    "ipo.ipo_loss": _ipo, "ipo.sequence_logp": _seq_logp, "ipo.rpo_nll": lambda g: [
        ("log-probs (3, 6)", [_logp(g, 3, 6), _mask(g, 3, 6)], {})],
    "rloo.rloo_advantages": _rloo_adv, "opd.rloo_advantages": _rloo_adv, "rloo.importance_weights": _is,
    "common.k3_kl": _k3, "rloo.rloo_loss": _rloo_loss, "grpo.grpo_advantages": _grpo_adv,
    "rlt.grpo_advantages": _grpo_adv, "grpo.grpo_loss": _grpo_loss, "rlt.rlt_loss": _rlt_loss,
    "grpo.aggregate": _aggregate, "opd.opd_loss": _opd_loss, "rlt.reward_parts": _reward_parts,
    "rlt.rlt_reward": _rlt_reward, "grpo.sequence_log_ratio": _sequence_log_ratio,
    "grpo.cispo_surrogate": _cispo_surrogate,
}


def cases(q, seed):
    """The hidden cases of function q (module.function), drawn from `seed`."""
    return CASES[q](torch.Generator().manual_seed(seed))
