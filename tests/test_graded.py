"""Graded exercises, in the way of Stanford CS336's alignment assignment: the functions a student
writes from a blank body (the advantage, the loss, the reward, the KL) and the check that grades each
(course/assignment.md lists them with their points). A check calls the function on small
hand-computed tensors; every failure is one line that starts with the function's name and states
the property it breaks with the numbers it was called on. Grade one function (a blank body fails as
"not written yet", a blank callee as "calls X, which is not written yet"):
    python -m pytest tests/test_graded.py -k rloo_advantages -n 0
(-n 0, not -p no:xdist: pyproject's addopts pass -n, which needs xdist loaded). The graders are
themselves graded against blank bodies, zero stubs and typed-in mistakes by the instructor's own
tests, which a handout leaves out with the hidden cases."""
import importlib
import math
from typing import Callable, NamedTuple

import pytest
import torch


def fmt(x):
    """A tensor as nested lists rounded to 4 places (anything else as repr)."""
    return ((x.detach().double() * 1e4).round() / 1e4).tolist() if isinstance(x, torch.Tensor) else repr(x)


def expect(fn, ok, message):
    """Unless ok, fails with `<fn's name>: <message>` alone: a student reads one line, no traceback."""
    if not ok:
        pytest.fail(f"{fn.__name__}: {message}", pytrace=False)


def close(fn, got, want, what, atol=1e-5, hints=()):
    """Fails with `<name>: <what> should give <want>, got <got>` unless got ≈ want (shape too), and
    says first what the value is where that is plain: no tensor, the wrong shape, all zeros, or one
    of `hints`' (value, what it is) pairs, the values a known slip gives."""
    want = torch.tensor(want, dtype=torch.float64)
    if not isinstance(got, torch.Tensor):
        expect(fn, False, f"returns {got!r}, not a tensor: {what} should give {fmt(want)}")
    if got.shape != want.shape:
        expect(fn, False, f"returns shape {tuple(got.shape)}, not {tuple(want.shape)}: {what} should "
               f"give {fmt(want)}, got {fmt(got)}")
    got = got.detach().double()
    if torch.allclose(got, want, atol=atol):
        return
    plain = "returns zeros: " if not got.any() else ""
    plain += next((f"{why}: " for value, why in hints
                   if torch.allclose(got, torch.tensor(value, dtype=torch.float64), atol=atol)), "")
    expect(fn, False, f"{plain}{what} should give {fmt(want)}, got {fmt(got)}")


# ---- the return contract: what the scripts read of each function's result ----------------------
class T(NamedTuple):
    """A tensor of `shape` and `dtype` (float32 unless said); grad True: must carry a gradient
    (backward() goes through it), False: must be detached, None: either."""
    shape: tuple
    grad: bool = None
    dtype: torch.dtype = torch.float32


NUMBER = "a number"  # a Python float (or int): verifier's rewards


def conforms(fn, got, spec, path, reads):
    """Fails with one line naming the first part of `got` that is not `spec`'s: a missing key, a
    shape, a dtype, a gradient. `path` names the value as a caller reads it; `reads` says who."""
    if spec == NUMBER:
        expect(fn, isinstance(got, (int, float)) and not isinstance(got, bool),
               f"returns {got!r} as {path}, not a number ({reads})")
    elif isinstance(spec, T):
        expect(fn, isinstance(got, torch.Tensor), f"returns {type(got).__name__} as {path}, not a tensor ({reads})")
        expect(fn, tuple(got.shape) == spec.shape, f"returns {path} of shape {tuple(got.shape)}, not {spec.shape} ({reads})")
        expect(fn, got.dtype == spec.dtype, f"returns {path} as {got.dtype}, not {spec.dtype} ({reads})")
        expect(fn, spec.grad is not True or got.requires_grad, f"returns {path} detached: backward() through it "
               f"would not reach the model ({reads})")
        expect(fn, spec.grad is not False or not got.requires_grad, f"returns {path} still attached to the graph: "
               f"it must be detached ({reads})")
    elif isinstance(spec, dict):
        expect(fn, isinstance(got, dict), f"returns {type(got).__name__} as {path}, not a dict with keys "
               f"{', '.join(map(repr, spec))} ({reads})")
        for key, sub in spec.items():
            expect(fn, key in got, f"returns no key {key!r} in {path}, which has {sorted(got)} ({reads} "
                   f"reads {', '.join(map(repr, spec))})")
            conforms(fn, got[key], sub, f"{path}[{key!r}]", reads)
    else:  # a tuple of (name, spec)
        expect(fn, isinstance(got, tuple) and len(got) == len(spec), f"returns {_what(got)}, not the "
               f"{len(spec)} values ({', '.join(n for n, _ in spec)}) that {reads} unpacks")
        for value, (name, sub) in zip(got, spec):
            conforms(fn, value, sub, name, reads)


def _what(x):
    return f"{len(x)} values" if isinstance(x, tuple) else repr(x) if not isinstance(x, torch.Tensor) else \
        f"one tensor of shape {tuple(x.shape)}"


def contract(fn, got, spec, reads):
    """got (one call's result) against spec; a bare value's path is "its result"."""
    conforms(fn, got, spec, "its result", reads)


# ---- sft.py, ipo.py ------------------------------------------------------------------------------
def check_sft_loss(fn):
    close(fn, fn(torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)), 3.0, "Eq. 1's loss is the negative "
          "log-likelihood summed over the response tokens (the caller divides by the step's token count); "
          "log-probs [[-1, -2]]", hints=[(1.5, "that is their mean, not their sum"),
                                          (-3.0, "that is the log-likelihood, not its negative")])
    logp, mask = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]), torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    close(fn, fn(logp, mask), 9.0, "only response tokens count: positions with mask 0 (prompt, padding) are left "
          "out; log-probs [[-1, -2, -3], [-4, -5, -6]], mask [[0, 1, 1], [1, 0, 0]]")


def check_ipo_loss(fn):
    w, l, rw, rl = (torch.tensor(x) for x in ([-1.0, -3.0], [-3.0, -1.0], [-2.0, -1.0], [-2.0, -3.0]))
    loss, h = fn(w, l, rw, rl, beta=0.1)
    close(fn, h, [2.0, -4.0], "the margin h is the log-ratio to π_ref of y_w minus that of y_l (Eq. 2); "
          "logp_w [-1, -3], logp_l [-3, -1], ref_w [-2, -1], ref_l [-2, -3]")
    close(fn, loss, [9.0, 81.0], "the loss (h − 1/(2β))² pulls h to the target margin 1/(2β) (Eq. 2); "
          "h [2, -4], β 0.1")
    close(fn, fn(rw, rl, rw, rl, beta=0.05)[0], [100.0, 100.0], "a policy equal to its reference has h = 0, "
          "loss (1/(2β))²; β 0.05")


SEQ_LOGP = torch.tensor([[-1.0, -1.0, -4.0], [-2.0, -7.0, -7.0]])
SEQ_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
SEQ = "log-probs [[-1, -1, -4], [-2, (-7, -7 masked)]]"


def check_sequence_logp(fn):
    close(fn, fn(SEQ_LOGP, SEQ_MASK, False), [-6.0, -2.0], "log π(y|x) sums the response tokens' log-probs "
          f"(paper 000); {SEQ}")
    close(fn, fn(SEQ_LOGP, SEQ_MASK, True), [-2.0, -2.0], "length_norm divides each row's sum by its own number "
          f"of response tokens (3 and 1 here), not by the padded length T (paper 001); {SEQ}")


def check_rpo_nll(fn):
    close(fn, fn(SEQ_LOGP, SEQ_MASK), [2.0, 2.0], "the RPO anchor is the chosen response's mean negative "
          f"log-likelihood per response token (paper 001); {SEQ}")


# ---- rloo.py -------------------------------------------------------------------------------------
def check_rloo_advantages(fn):
    adv = fn(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1], [1.0, 0.1, 0.0, 1.0]]))
    close(fn, adv[0], [1.0, -1 / 3, -1 / 3, -1 / 3], "each rollout's baseline is the mean of the OTHER G-1 "
          "rewards of its prompt (leave-one-out, Eq. 3); rewards [1, 0, 0, 0]")
    close(fn, adv[1], [0.0] * 4, "a group of equal rewards gets A = 0 (no signal: the flatline); rewards [0.1] * 4")
    close(fn, adv[2], [1 - 1.1 / 3, 0.1 - 2 / 3, -2.1 / 3, 1 - 1.1 / 3], "the leave-one-out baseline is taken "
          "within each prompt's row (B, G); rewards [1, 0.1, 0, 1]")
    close(fn, fn(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), 0.1), [[0.1, -1 / 3, -1 / 3, -1 / 3]], "positive_weight λ "
          "scales the positive advantages only (W-REINFORCE, Zhu et al. 2025); rewards [1, 0, 0, 0], λ 0.1")


def check_importance_weights(fn):
    logp = torch.tensor([0.0, 5.0, -1.0], requires_grad=True)
    w, raw = fn(logp, torch.zeros(3), clip=10.0)
    close(fn, raw, [1.0, math.exp(5), math.exp(-1)], "the raw weight is the sequence ratio π_θ(y)/μ(y) = "
          "exp(log π_θ − log μ); log-ratios [0, 5, -1]")
    close(fn, w, [1.0, 10.0, math.exp(-1)], "w is the raw weight clipped from above at `clip` (w_max, 000 Table 5); "
          "log-ratios [0, 5, -1], clip 10")
    expect(fn, not (w.requires_grad or raw.requires_grad), "the weights are detached: w rescales the gradient of "
           "log π_θ, it is not itself optimized; got weights that require grad")


# one rollout: log-probs, response mask (the last token is padding), entropies
ROLLOUT = torch.tensor([[-1.0, -2.0, -4.0]]), torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 3.0, 7.0]])
HALF, QUARTER = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
K3 = 0.5 - 1 - math.log(0.5)  # r = 0.25 / 0.5


def check_k3_kl(fn):
    close(fn, fn(HALF, QUARTER), [[K3]], "k3 = r − 1 − log r with r = other/π_θ = exp(other_logp − logp) "
          "(Schulman's k3); π_θ 0.5, other 0.25")
    logp = HALF.clone().requires_grad_()
    kl = fn(logp, QUARTER, QUARTER)
    close(fn, kl, [[2 * K3]], "with sample_logp, k3 is times the ratio π_θ/μ = exp(logp − sample_logp) "
          "(TRL's use_bias_correction_kl); π_θ 0.5, other = μ 0.25")
    grad = torch.autograd.grad(kl.sum(), logp)[0] if kl.requires_grad else None
    close(fn, grad, [[2 * math.log(2)]], "the ratio π_θ/μ is not detached: with it the gradient of k3 is that "
          "of KL(π_θ ‖ other); d/dlogp at π_θ 0.5, other = μ 0.25")


def check_rloo_loss(fn):
    logp, mask, entropy = ROLLOUT
    mu = logp + torch.tensor([[0.0, math.log(2), 0.0]])  # μ gave token 2 twice π_θ's probability: w = 0.5
    k3 = 1 - math.log(2)  # token 2: r = μ/π_θ = 2

    def loss(old, adv=0.5, ent=0.0, kl=0.0, kl_ratio=True, pg_norm="sum"):
        return fn(logp, old, entropy, mask, torch.tensor([adv]), ent, kl, 10.0, kl_ratio, pg_norm)
    close(fn, loss(logp)[0], [1.5], "the policy-gradient term is −w·A·log π_θ(y|x), log π_θ(y|x) the sum over "
          "the response tokens (Eq. 3); w 1, A 0.5, log-probs [-1, -2, (-4 masked)]")
    out, parts = loss(mu)
    close(fn, parts["is_weight"], [0.5], "parts['is_weight'] is w = π_θ(y)/μ(y) of the whole sequence; μ gave "
          "token 2 twice π_θ's probability")
    close(fn, out, [0.75], "the policy-gradient term is weighted by w = π_θ(y)/μ(y) (Eq. 3); w 0.5, A 0.5")
    close(fn, loss(logp, adv=0.0, ent=0.1)[0], [-0.2], "the entropy bonus is −λ_H times the mean entropy over "
          "the response tokens; λ_H 0.1, entropies [1, 3, (7 masked)]")
    close(fn, loss(mu, adv=0.0, kl=1.0, kl_ratio=False)[0], [k3 / 2], "the KL term is λ_KL times the mean over "
          "the response tokens of k3 between π_θ and μ; kl_ratio False, λ_KL 1, k3 [0, 1 − log 2]")
    close(fn, loss(mu, adv=0.0, kl=1.0)[0], [k3 / 4], "with kl_ratio each token's k3 is times π_θ/μ (0.5 on token 2)")
    close(fn, loss(mu, ent=0.1, kl=1.0)[0], [0.75 - 0.2 + k3 / 4], "the loss is the sum of its three terms; A 0.5, "
          "λ_H 0.1, λ_KL 1")
    close(fn, loss(logp, pg_norm="mean")[0], [0.75], "pg_norm 'mean' divides the policy-gradient term by the "
          "rollout's response-token count (2)")


# ---- grpo.py -------------------------------------------------------------------------------------
def check_grpo_advantages(fn):
    reward = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = fn(reward)
    close(fn, adv[0], [1.5, -0.5, -0.5, -0.5], "A = (r − the group's mean) / (its unbiased std + ε) (004 Eq. 2); "
          "rewards [1, 0, 0, 0]: mean 0.25, std 0.5", atol=1e-3)
    close(fn, adv[1:], [[0.0] * 4] * 2, "a group of equal rewards gets A = 0, never NaN (ε keeps 0/0 away); "
          "rewards all 0, all 1")
    close(fn, fn(reward, scale=False)[0], [0.75, -0.25, -0.25, -0.25], "scale=False (Dr. GRPO) only centers: "
          "A = r − the group's mean; rewards [1, 0, 0, 0]")


def check_grpo_loss(fn):
    logp, old = torch.log(torch.tensor([[1.5, 1.1, 0.5, 0.9]])).requires_grad_(), torch.zeros(1, 4)  # ρ
    for A, want, clipped, side in ((1.0, [[-1.2, -1.1, -0.5, -0.9]], [[1, 0, 0, 0]], "A > 0 caps ρ at 1 + ε"),
                                   (-1.0, [[1.5, 1.1, 0.8, 0.9]], [[0, 0, 1, 0]], "A < 0 floors ρ at 1 − ε")):
        loss, parts = fn(logp, old, None, torch.tensor([A]), beta=0.0, epsilon=0.2)
        close(fn, loss, want, "per token −min(ρA, clip(ρ, 1 − ε, 1 + ε)·A), PPO's clipped surrogate (004 Eq. 1): "
              f"{side}; ratios [1.5, 1.1, 0.5, 0.9], ε 0.2")
        close(fn, parts["clipped"], clipped, f"parts['clipped'] marks the tokens where the clipped term wins; {side}")
    loss, parts = fn(logp, old, None, torch.tensor([1.0]), beta=0.0, epsilon=0.2, epsilon_high=0.6)
    close(fn, loss, [[-1.5, -1.1, -0.5, -0.9]], "epsilon_high (DAPO's clip-higher) moves the upper bound only; "
          "ε 0.2, ε_high 0.6")
    close(fn, parts["clipped"], [[0] * 4], "parts['clipped'] marks no token under clip-higher; ρ 1.5 < 1 + 0.6")
    grad = torch.autograd.grad(fn(logp, old, None, torch.tensor([1.0]), beta=0.0, epsilon=0.2)[0].sum(), logp)[0]
    close(fn, grad, [[0.0, -1.1, -0.5, -0.9]], "the clipped token has no gradient, each other one −ρ; A 1")
    for kl_ratio in (False, True):
        loss, parts = fn(HALF, HALF, QUARTER, torch.tensor([0.0]), beta=0.5, epsilon=0.2, kl_ratio=kl_ratio)
        close(fn, torch.cat([parts["kl"], loss]), [[K3], [0.5 * K3]], "the KL penalty (parts['kl'], then the loss) is "
              f"β times k3 to π_ref (Eq. 1); A 0, ρ 1, kl_ratio {kl_ratio}, π_θ 0.5, π_ref 0.25, β 0.5")


def check_aggregate(fn):
    per_token, mask = torch.tensor([[2.0, 9.0, 9.0], [1.0, 1.0, 1.0]]), torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    for mode, want, what in (("seq-mean", (2 / 1 + 3 / 3) / 2, "each rollout's token mean, then / n_rows (DeepSeekMath)"),
                             ("token-mean", (2 + 3) / 4, "the masked sum / n_tokens (DAPO, 002 Eq. 1)"),
                             ("constant", (2 + 3) / (2 * 4), "the masked sum / (n_rows · max_len) (Dr. GRPO)")):
        inputs = "; per-token [[2, (9, 9 masked)], [1, 1, 1]], n_rows 2, n_tokens 4, max_len 4"
        close(fn, fn(per_token, mask, mode, 2, 4, 4), want, f"{mode} is {what}{inputs}")
        halves = fn(per_token[:1], mask[:1], mode, 2, 4, 4) + fn(per_token[1:], mask[1:], mode, 2, 4, 4)
        close(fn, halves, want, f"{mode}: micro-batches add up to the batch's loss (each divides by the whole "
              f"batch's counts, not its own){inputs}, one row a micro-batch")


# ---- grpo.py's family: GSPO's ratio and CISPO's surrogate (the optional part) ------------------------
def check_sequence_log_ratio(fn):
    log2, log15 = math.log(2), math.log(1.5)
    one = fn(torch.log(torch.tensor([[2.0, 0.5, 1.0]])), torch.zeros(1, 3), torch.ones(1, 3))
    close(fn, one, [[0.0] * 3], "log s_i is the mean over the rollout's tokens of log ρ_it = log π_θ − log π_old, so "
          "s_i is the GEOMETRIC mean of the token ratios (GSPO), and every token of the row carries it; ratios "
          "[2, 0.5, 1]: s_i 1", hints=[([[math.log(7 / 6)] * 3], "that is the log of their arithmetic mean (7/6), not "
                                        "of their geometric mean"),
                                       ([[log2, -log2, 0.0]], "those are the tokens' own log ρ_it (PPO's ratio), not "
                                        "the rollout's mean"),
                                       ([[1.0] * 3], "that is s_i, not its log: grpo_loss takes .exp() of what this returns")])
    logp = torch.log(torch.tensor([[1.5, 1.5, 1.5], [2.0, 2.0, 100.0]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    inputs = "ratios [[1.5, 1.5, 1.5], [2, 2, (100 masked)]]"
    out = fn(logp, torch.zeros(2, 3), mask)
    close(fn, out, [[log15] * 3, [log2] * 3], "a masked token is left out of the mean (its ratio does not enter, and "
          "the row divides by its own token count, 2), yet every token of the row carries log s_i, the masked one too "
          f"(the caller's mask drops it later); {inputs}",
          hints=[([[log15] * 3, [math.log(400) / 3] * 3], "that takes the masked token's ratio 100 into the mean"),
                 ([[log15] * 3, [2 * log2 / 3] * 3], "that divides by the padded length T (3), not the row's own token "
                  "count (2)"),
                 ([[3 * log15] * 3, [2 * log2] * 3], "that is the sum of the log-ratios, not their mean"),
                 ([[log15] * 3, [log2, log2, 0.0]], "that leaves the masked token without log s_i")])
    c = torch.tensor([[1.0, 2.0, 3.0]] * 2)  # distinct weights: a token's gradient must be its own token's only
    grad = torch.autograd.grad((out.exp() * c).sum(), logp)[0] if out.requires_grad else None
    close(fn, grad, [[1.5, 3.0, 4.5], [2.0, 4.0, 6.0]], "each token carries s_i with its OWN token's gradient, "
          "sg[s_i]·π_θ(y_it)/sg[π_θ(y_it)]: d s_it / d log π_θ(y_it') is s_i where t' = t and 0 elsewhere, the mean "
          f"itself detached; the gradient of Σ_t c_t·s_it with c [1, 2, 3], s_i 1.5 and 2, {inputs}",
          hints=[([[4.5, 6.0, 7.5], [8.0, 10.0, 6.0]], "that is with the mean not detached: its gradient spreads over "
                  "the row's tokens")])


def check_cispo_surrogate(fn):
    ratios = [1.5, 1.1, 0.5, 0.9]
    logs = [math.log(r) for r in ratios]
    inputs = "ratios [1.5, 1.1, 0.5, 0.9] (π_old 1: log π_θ = log ρ), ε_hi 0.2"

    def per_token(weight, A):  # weight(ρ) · A · log π_θ on each token
        return [[weight(r) * A * lp for r, lp in zip(ratios, logs)]]
    for A in (1.0, -1.0):
        logp = torch.log(torch.tensor([ratios])).requires_grad_()
        out, capped = fn(logp.exp(), logp, torch.tensor([[A]]), 0.2)  # ρ carries log π_θ's gradient, as in grpo_loss
        close(fn, out, per_token(lambda r: min(r, 1.2), A), "CISPO's surrogate is sg(min(ρ, 1 + ε_hi))·A·log π_θ per "
              "token (MiniMax-M1 Eq. 4): REINFORCE weighted by the ratio capped above only, so a ratio 0.5 keeps its "
              f"weight 0.5; {inputs}, A {A:g}",
              hints=[(per_token(lambda r: min(max(r, 0.8), 1.2), A), "that also floors the weight at 1 − ε_hi: "
                      "CISPO has no lower cap"),
                     (per_token(lambda r: r, A), "that is the ratio uncapped: the cap is 1 + ε_hi"),
                     (per_token(lambda r: min(r, 0.2), A), "that caps at ε_hi itself (TRL's absolute cap), not at "
                      "1 + ε_hi (verl's offset, this repo's --epsilon_high)"),
                     ([[min(r, 1.2) * A for r in ratios]], "that is the weight times A, without log π_θ")])
        close(fn, capped, [[1.0, 0.0, 0.0, 0.0]], "the second value marks the tokens where the cap binds, ρ > 1 + "
              "ε_hi, whatever the sign of A (CISPO caps the weight either way; PPO's `clipped` depends on A); "
              f"{inputs}, A {A:g}")
        grad = torch.autograd.grad(out.sum(), logp)[0] if out.requires_grad else None
        close(fn, grad, [[min(r, 1.2) * A for r in ratios]], "the weight is detached: each token's gradient is "
              "sg(w)·A alone, with no ρ·A·log π_θ from the ratio's own gradient, and the capped token keeps its "
              f"gradient (1.2·A, where PPO's clip leaves none); d/d log π_θ, {inputs}, A {A:g}",
              hints=[([[1.2 * A] + [r * A * (1 + lp) for r, lp in zip(ratios[1:], logs[1:])]], "that is with the "
                      "weight not detached: the ratio's gradient adds ρ·A·log π_θ")])
    logp = torch.log(torch.tensor([ratios]))
    out, capped = fn(logp.exp(), logp, torch.tensor([[1.0]]), 0.6)
    close(fn, torch.cat([out, capped.float()]), per_token(lambda r: r, 1.0) + [[0.0] * 4], "ε_hi is an offset from 1 "
          "(verl's convention, as --epsilon_high): the cap is 1 + ε_hi = 1.6, which no ratio here reaches, so "
          "nothing is capped (the surrogate, then the capped marks); ratios [1.5, 1.1, 0.5, 0.9], ε_hi 0.6, A 1",
          hints=[(per_token(lambda r: min(r, 0.6), 1.0) + [[1.0, 1.0, 0.0, 1.0]], "that caps at ε_hi itself (TRL's "
                  "absolute cap)")])


def check_rlt_loss(fn):
    logp, old = torch.log(torch.tensor([[1.5, 1.1, 0.5, 0.9]])), torch.zeros(1, 4)  # ρ per token
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    for A, want, side in ((1.0, -(1.2 + 1.1 + 0.5) / 3, "A > 0 caps ρ at 1 + ε"),
                          (-1.0, (1.5 + 1.1 + 0.8) / 3, "A < 0 floors ρ at 1 − ε")):
        close(fn, fn(logp, old, None, mask, torch.tensor([A]), 0.0, 0.2)[0], [want], "the loss is the mean "
              "over the rollout's response tokens of −min(ρA, clip(ρ, 1 − ε, 1 + ε)·A), PPO's clipped "
              f"surrogate (004 Eq. 6, GRPO's): {side}; ratios [1.5, 1.1, 0.5, (0.9 masked)], ε 0.2")
    for kl_ratio, want in ((False, K3), (True, 2 * K3)):
        out, parts = fn(HALF, QUARTER, QUARTER, torch.ones(1, 1), torch.tensor([0.0]), 0.5, 0.2, kl_ratio)
        close(fn, parts["kl"], [[want]], "parts['kl'] is k3 to π_ref per token, times ρ = π_θ/π_old with "
              f"kl_ratio; π_θ 0.5, π_old = π_ref 0.25, kl_ratio {kl_ratio}")
        close(fn, out, [0.5 * want], f"the loss adds β times that KL's token mean; A 0, β 0.5, kl_ratio {kl_ratio}")
    close(fn, fn(HALF, HALF, None, torch.ones(1, 1), torch.tensor([0.0]), 0.5, 0.2)[1]["kl"], [[0.0]],
          "without a reference (ref_logp None) the KL is 0")


# ---- opd.py, rlt.py ------------------------------------------------------------------------------
def check_opd_loss(fn):
    logp, mask, entropy = ROLLOUT

    def loss(old=logp, kl=0.0, rl=0.0, ent=0.0):
        return fn(logp, old, torch.tensor([[0.2, 0.4, 9.0]]), entropy, mask, torch.tensor([0.5]), kl, rl, ent, 10.0)
    close(fn, loss(kl=0.5)[0], [0.15], "the distillation term is λ_KL times the teacher KL's mean over the "
          "response tokens (Algorithm 1 line 5); λ_KL 0.5, KL [0.2, 0.4, (9 masked)]")
    out, parts = loss(rl=0.5)
    close(fn, parts["pg"], [1.5], "parts['pg'] is RLOO's −w·A·log π_θ(y|x), summed over the response tokens "
          "(line 7, Eq. 3); w 1, A 0.5, log-probs [-1, -2, (-4 masked)]")
    close(fn, out, [0.75], "the RL term is λ_RL times −w·A·log π_θ(y|x) (line 9); λ_RL 0.5")
    close(fn, loss(ent=0.1)[0], [-0.2], "the entropy bonus is −λ_H times the mean entropy over the response "
          "tokens (line 8); λ_H 0.1, entropies [1, 3, (7 masked)]")
    close(fn, loss(kl=0.5, rl=0.5, ent=0.1)[0], [0.7], "the loss is the sum of its three terms (line 9); "
          "λ_KL 0.5, λ_RL 0.5, λ_H 0.1")
    close(fn, loss(logp - torch.tensor([[5.0, 0.0, 0.0]]), rl=0.5)[1]["is_weight"], [10.0], "w = π_θ(y)/μ(y) is "
          "clipped at is_clip (line 6); π_θ/μ = e^5, is_clip 10")


RLT_LOGP = torch.tensor([[-9.0, -1.0, -3.0, -0.5, -1.5], [-9.0, -9.0, -9.0, -2.0, -2.0]])
RLT_SOL, RLT_EXPL = torch.tensor([[0.0, 0, 0, 1, 1]] * 2), torch.tensor([[0.0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])


def check_reward_parts(fn):
    parts = fn(RLT_LOGP, torch.tensor([[0.0, 0.2, 0.6, 9.0, 9.0], [0.0, 0.0, 0.0, 9.0, 9.0]]), RLT_SOL, RLT_EXPL)
    close(fn, parts[0], [-1.0, -1.5, 0.4, 0.6], "a row is [avg, min] of log π_s over the solution's tokens and "
          "[avg, max] of KL_t over the explanation's (004 Eq. 3-4); log π_s [-9, -1, -3, -0.5, -1.5], "
          "KL_t [0, 0.2, 0.6, 9, 9], explanation tokens 2-3, solution 4-5")
    close(fn, parts[1], [-2.0, -2.0, 0.0, 0.0], "an empty explanation gets 0 for both KL terms; row 2")
    neg = fn(RLT_LOGP, torch.tensor([[5.0, -0.2, -0.6, 9.0, 9.0]] * 2), RLT_SOL, RLT_EXPL)
    close(fn, neg[:, 2:], [[-0.4, -0.2], [0.0, 0.0]], "the max of KL_t is over the explanation's tokens only, "
          "never the masked zeros (a sampled KL_t can be negative); KL_t [5, -0.2, -0.6, 9, 9]")


def check_rlt_reward(fn):
    parts = torch.tensor([[-1.0, -1.5, 0.4, 0.6], [-2.0, -2.0, 0.0, 0.0]])
    r, r_ss, r_kl = fn(parts, [False, True], alpha=0.01, lam=3.0, penalty=-1.0)
    close(fn, r_ss, [-1.015, -2.02], "r_SS = avg log π_s + α · min log π_s (004 Eq. 3); α 0.01")
    close(fn, r_kl, [0.406, 0.0], "r_KL = avg KL_t + α · max KL_t (Eq. 4); α 0.01")
    close(fn, r, [-1.015 - 3 * 0.406, -2.02 - 1], "r = r_SS − λ·r_KL, plus `penalty` ADDED where the explanation "
          "never closed </think> (Eq. 5, 004 §A.1); λ 3, penalty -1 on row 2")


# ---- verifier.py: the reward of RLOO and GRPO (paper 000 §3.1) -----------------------------------
def ans(expr):
    return f"<think>...</think>\n<answer>{expr}</answer>"


SCORE_CASES = [(ans("(3 + 5) * 4"), 1.0, "a correct expression over exactly the given numbers scores 1.0"),
               (ans("4*(5+3)"), 1.0, "any order, spacing and parentheses of a correct answer score 1.0"),
               (ans("3 + 5 + 4"), 0.1, "an answer present but wrong scores 0.1"),
               (ans("(3 + 3) * 4"), 0.1, "an answer present but not over exactly the given numbers scores 0.1"),
               (ans(""), 0.1, "an empty answer block is an answer present but invalid: 0.1"),
               ("(3 + 5) * 4", 0.0, "no <answer>...</answer> block scores 0.0"),
               ("<answer>(3 + 5) * 4", 0.0, "an unclosed block is no answer: 0.0"),
               (ans("3 + 5 + 4") + ans("(3 + 5) * 4"), 1.0, "the LAST complete answer block is the answer"),
               (ans("(3 + 5) * 4") + ans("3 + 5 + 4"), 0.1, "the LAST complete answer block is the answer")]


def check_score(fn):
    for response, want, rule in SCORE_CASES:
        got = fn(response, [3, 5, 4], 32)
        expect(fn, got == want, f"returns {got!r} for {response!r} with [3, 5, 4] -> 32, not {want}: {rule}")


def check_dense_score(fn):
    for response, want, rule in [(ans("(3 + 5) * 4"), 1.0, "the target scores 1.0, as score does"),
                                 ("(3 + 5) * 4", 0.0, "no <answer> block scores 0.0, as score does"),
                                 (ans("(3 + 3) * 4"), 0.1, "an answer not over exactly the given numbers scores 0.1"),
                                 (ans("3 + 5 + 4"), 0.1 + 0.5 * (1 - 20 / 32), "a valid answer with the wrong value "
                                  "v earns 0.1 + 0.5 · (1 − |v − target| / max(1, |target|)) (paper 001): v 12, target 32"),
                                 (ans("3 - 5 - 4"), 0.1, "a wrong value farther from the target than the target's "
                                  "size earns 0.1, no less (the max with 0): v -6, target 32")]:
        got = fn(response, [3, 5, 4], 32)
        expect(fn, isinstance(got, (int, float)) and abs(got - want) < 1e-9,
               f"returns {got!r} for {response!r} with [3, 5, 4] -> 32, not {round(want, 4)}: {rule}")
    got = fn(ans("4 - 3 - 5"), [3, 5, 4], 0)
    expect(fn, isinstance(got, (int, float)) and abs(got - 0.1) < 1e-9, f"returns {got!r} for "
           f"{ans('4 - 3 - 5')!r} with [3, 5, 4] -> 0, not 0.1: a target of 0 divides by max(1, |target|) = 1, "
           f"v -4 is 4 away: the max with 0")


# ---- what each function's callers read of its result (checked before the values) -----------------
def _logp(*shape):
    """Log-probs that require grad, as a training forward's do."""
    return (-torch.rand(*shape) - 0.1).requires_grad_()


MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
LOSS = ("the loss", T((2,), True))
CONTRACTS = {  # module.function: (its arguments, what it returns, who reads it)
    "verifier.score": (lambda: ([ans("1 + 2"), [1, 2], 3], {}), NUMBER, "common.score_rollouts"),
    "verifier.dense_score": (lambda: ([ans("1 + 1"), [1, 1], 3], {}), NUMBER, "common.score_rollouts"),
    "sft.sft_loss": (lambda: ([_logp(2, 3), MASK], {}), T((), True), "sft.py's loop: loss / tokens, backward()"),
    "ipo.ipo_loss": (lambda: ([_logp(2), _logp(2), -torch.rand(2), -torch.rand(2)], {"beta": 0.1}),
                     (LOSS, ("the margin h", T((2,)))), "ipo.py's loop: loss, h = ipo_loss(...)"),
    "ipo.sequence_logp": (lambda: ([_logp(2, 3), MASK, True], {}), T((2,), True), "ipo.py's pair log-probs"),
    "ipo.rpo_nll": (lambda: ([_logp(2, 3), MASK], {}), T((2,), True), "ipo.py's loss, + α · rpo_nll"),
    "rloo.rloo_advantages": (lambda: ([torch.tensor([[1.0, 0.0, 0.1]] * 2)], {}), T((2, 3)),
                             "rloo.py's loop: adv.flatten()"),
    "rloo.importance_weights": (lambda: ([_logp(2), -torch.rand(2)], {"clip": 10.0}),
                                (("w", T((2,), False)), ("the raw w", T((2,), False))), "rloo_loss"),
    "common.k3_kl": (lambda: ([_logp(2, 3), -torch.rand(2, 3), -torch.rand(2, 3)], {}), T((2, 3), True),
                     "rloo_loss, grpo_loss and rlt_loss"),
    "rloo.rloo_loss": (lambda: ([_logp(2, 3), -torch.rand(2, 3), torch.rand(2, 3, requires_grad=True), MASK,
                                 torch.tensor([0.5, -0.5]), 1e-3, 1e-3, 10.0], {}),
                       (LOSS, ("parts", {"kl": T((2, 3)), "is_weight": T((2,)), "is_weight_raw": T((2,)),
                                         "terms": {"pg": T((2,), True), "entropy": T((2,), True),
                                                   "kl": T((2,), True)}})), "rloo.py's loop"),
    "grpo.grpo_advantages": (lambda: ([torch.tensor([[1.0, 0.0, 0.1]] * 2)], {}), T((2, 3)),
                             "grpo.py's loop: adv.flatten()"),
    "grpo.grpo_loss": (lambda: ([_logp(2, 3), -torch.rand(2, 3), -torch.rand(2, 3), torch.tensor([0.5, -0.5])],
                                {"beta": 0.04, "epsilon": 0.2}),
                       (("the per-token loss", T((2, 3), True)),
                        ("parts", {"kl": T((2, 3)), "ratio": T((2, 3)), "clipped": T((2, 3)),
                                   "terms": {"pg": T((2, 3), True), "kl": T((2, 3), True)}})), "grpo.py's loop"),
    "grpo.aggregate": (lambda: ([_logp(2, 3), MASK, "token-mean", 2, 3, 3], {}), T((), True),
                       "grpo.py's loop: backward()"),
    "grpo.sequence_log_ratio": (lambda: ([_logp(2, 3), -torch.rand(2, 3), MASK], {}), T((2, 3), True),
                                "grpo_loss: ratio = log_ratio.exp(), its gradient the model's"),
    "grpo.cispo_surrogate": (lambda: ([(_logp(2, 3) + 0.6).exp(), _logp(2, 3), torch.tensor([[0.5], [-0.5]]), 0.28], {}),
                             (("the surrogate", T((2, 3), True)), ("capped", T((2, 3), False, torch.bool))),
                             "grpo_loss: surrogate, clipped = cispo_surrogate(...)"),
    "opd.opd_loss": (lambda: ([_logp(2, 3), -torch.rand(2, 3), torch.rand(2, 3, requires_grad=True),
                               torch.rand(2, 3, requires_grad=True), MASK, torch.tensor([0.5, -0.5]), 0.5, 0.5,
                               1e-3, 10.0], {}),
                     (LOSS, ("parts", {"pg": T((2,)), "is_weight": T((2,)), "is_weight_raw": T((2,)),
                                       "terms": {"kl": T((2,), True), "pg": T((2,), True),
                                                 "entropy": T((2,), True)}})), "opd.py's loop"),
    "rlt.reward_parts": (lambda: ([-torch.rand(2, 3), torch.rand(2, 3), torch.tensor([[0.0, 0, 1]] * 2),
                                   torch.tensor([[1.0, 1, 0]] * 2)], {}), T((2, 4)), "rlt.score_explanations"),
    "rlt.rlt_reward": (lambda: ([-torch.rand(2, 4), [False, True]], {"alpha": 0.01, "lam": 3.0, "penalty": -1.0}),
                       (("r", T((2,))), ("r_SS", T((2,))), ("r_KL", T((2,)))), "rlt.py's loop: reward, r_ss, r_kl"),
    "rlt.rlt_loss": (lambda: ([_logp(2, 3), -torch.rand(2, 3), -torch.rand(2, 3), MASK, torch.tensor([0.5, -0.5]),
                               0.04, 0.2], {}),
                     (LOSS, ("parts", {"kl": T((2, 3)), "terms": {"pg": T((2,), True), "kl": T((2,), True)}})),
                     "rlt.py's loop"),
}
CONTRACTS["opd.rloo_advantages"] = CONTRACTS["rloo.rloo_advantages"][:2] + ("opd.py's loop: adv.flatten()",)
CONTRACTS["rlt.grpo_advantages"] = CONTRACTS["grpo.grpo_advantages"][:2] + ("rlt.py's loop: adv.flatten()",)


def check_contract(q, fn):
    """fn called once as its callers call it; its result against what they read."""
    make, spec, reads = CONTRACTS[q]
    args, kwargs = make()
    contract(fn, fn(*args, **kwargs), spec, reads)


# ---- the table: each graded function, its check and its part of course/assignment.md -------------
class Graded(NamedTuple):
    module: str
    function: str
    check: Callable
    part: str


GRADED = [
    Graded("verifier", "score", check_score, "verifier"),
    Graded("verifier", "dense_score", check_dense_score, "verifier"),
    Graded("sft", "sft_loss", check_sft_loss, "sft"),
    Graded("ipo", "ipo_loss", check_ipo_loss, "ipo"),
    Graded("ipo", "sequence_logp", check_sequence_logp, "ipo"),
    Graded("ipo", "rpo_nll", check_rpo_nll, "ipo"),
    Graded("rloo", "rloo_advantages", check_rloo_advantages, "rloo"),
    Graded("opd", "rloo_advantages", check_rloo_advantages, "rloo"),  # rloo.py's twin
    Graded("rloo", "importance_weights", check_importance_weights, "rloo"),
    Graded("common", "k3_kl", check_k3_kl, "rloo"),
    Graded("rloo", "rloo_loss", check_rloo_loss, "rloo"),
    Graded("grpo", "grpo_advantages", check_grpo_advantages, "grpo"),
    Graded("rlt", "grpo_advantages", check_grpo_advantages, "grpo"),  # grpo.py's twin
    Graded("grpo", "grpo_loss", check_grpo_loss, "grpo"),
    Graded("rlt", "rlt_loss", check_rlt_loss, "grpo"),  # GRPO's surrogate and KL, RLT's update
    Graded("grpo", "aggregate", check_aggregate, "grpo"),
    Graded("opd", "opd_loss", check_opd_loss, "opd"),
    Graded("rlt", "reward_parts", check_reward_parts, "rlt"),
    Graded("rlt", "rlt_reward", check_rlt_reward, "rlt"),
    Graded("grpo", "sequence_log_ratio", check_sequence_log_ratio, "grpo_family"),  # optional: GSPO's ratio
    Graded("grpo", "cispo_surrogate", check_cispo_surrogate, "grpo_family"),  # optional: CISPO's surrogate
]
IDS = [f"{e.module}.{e.function}" for e in GRADED]


def grade(entry, fn):
    """entry's check on fn, after its return contract (CONTRACTS: what the scripts read of it). A
    blank body fails as not written; a function whose callee is still blank says which; a crash
    inside the check (what fn returned did not fit) says what it was."""
    try:
        check_contract(f"{entry.module}.{entry.function}", fn)  # every key, shape, dtype a caller reads
        return entry.check(fn)
    except NotImplementedError as e:  # the handout's stub says whose body it is: "name: write ..."
        blank = str(e).split(":")[0]
        why = "not written yet (its body raises NotImplementedError)" if blank == entry.function else \
            f"calls {blank}, which is not written yet"
    except Exception as e:  # noqa: BLE001  (pytest.fail's exception is not an Exception: it passes)
        why = f"returns or raises what the check cannot use: {type(e).__name__}: {e}"
    pytest.fail(f"{entry.function}: {why}", pytrace=False)  # outside the except: one line, no chain


@pytest.mark.parametrize("entry", GRADED, ids=IDS)
def test_graded(entry):
    grade(entry, getattr(importlib.import_module(entry.module), entry.function))
