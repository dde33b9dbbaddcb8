"""The trace strategies (plumbing/traces.py): every trace verified and its arithmetic exact, the backward
line written as the docstring says, the mixture's weights honoured, the strategy read back from the
text, and the bookkeeping the evaluation and the RL logs print."""
import random
import re

import pytest

from plumbing import tasks as D
import evaluate as E
from plumbing import traces as TR
import verifier as V


@pytest.fixture(scope="module")
def problems():
    return V.generate_splits({"p": 300}, seed=7, num_numbers=(3,), num_range=(1, 20),
                             target_range=(10, 100))["p"]


@pytest.mark.parametrize("mix", [{"backward": 1.0}, {"random": 0.5, "backward": 0.5}])
def test_every_trace_is_verified_and_every_written_step_exact(problems, mix):
    rng = random.Random(0)
    traces = [TR.make_trace(p["nums"], p["target"], rng, 1.0, 0.5, mix) for p in problems]
    assert all(V.score(t, p["nums"], p["target"]) == 1.0 for t, p in zip(traces, problems))
    a = E.arithmetic(traces, [p["target"] for p in problems])
    # a needed value, a pair's result or a closing step computed wrong would show here
    assert a["steps"] > 5 * len(problems) and a["step_error"] == 0 and a["false_claims"] == 0


def test_a_backward_line_is_one_subgoal_then_the_pair_until_it_is_made():
    # 35 = 5 * 7: the factorization comes first, and the pair's fourth result makes it
    # (the closing step on a line of its own, as a random try's steps: plumbing/traces.py)
    assert TR.make_trace([2, 14, 5], 35, mix={"backward": 1}) == (
        "Need 35/5=7: 2+14=16,2*14=28,14-2=12,14/2=7.\n7*5=35. "
        "Target 35, found.\n</think>\n<answer>(14/2)*5</answer>")
    # 12 / 3 = 4 is not made (14 / 5 is not exact: no fourth result); 12 / 14 and 12 / 5 are not
    # exact; then target - c, over c in the prompt's order
    assert TR.make_trace([3, 14, 5], 12, mix={"backward": 1}) == (
        "Need 12/3=4: 14+5=19,14*5=70,14-5=9, back.\n"
        "Need 12-3=9: 14+5=19,14*5=70,14-5=9.\n9+3=12. Target 12, found.\n"
        "</think>\n<answer>(14-5)+3</answer>")
    # the procedure is deterministic: the rng never changes a backward trace that finds
    assert {TR.make_trace([2, 14, 5], 35, random.Random(s), mix={"backward": 1}) for s in range(5)} \
        == {TR.make_trace([2, 14, 5], 35, mix={"backward": 1})}


def test_the_mixture_is_honoured_and_the_default_stream_unchanged(problems):
    rng = random.Random(1)
    names = [TR.strategy_of(TR.make_trace(p["nums"], p["target"], rng, 1.0, 0.0,
                                          {"random": 0.7, "backward": 0.3}))
             for p in problems * 4]
    assert abs(names.count("backward") / len(names) - 0.3) < 0.04
    assert set(names) == {"random", "backward"}
    # no mix and a mix of random alone draw nothing extra: the traces before strategies existed
    for p in problems[:30]:
        assert TR.make_trace(p["nums"], p["target"], random.Random(3), 1.0, 0.5) == \
            TR.make_trace(p["nums"], p["target"], random.Random(3), 1.0, 0.5, {"random": 1})
    # 4 numbers: backward is written for 3, so such a problem gets random tries, still verified
    t = TR.make_trace([3, 7, 2, 9], 24, random.Random(0), mix={"backward": 1})
    assert TR.strategy_of(t) == "random" and V.score(t, [3, 7, 2, 9], 24) == 1.0


def test_backward_solves_more_problems_in_the_first_line_than_a_random_try(problems):
    rng = random.Random(2)
    verdict = lambda t: re.search(r"Target \d+, (found|back)\.", t).group(1)  # noqa: E731 (the first)
    first = {name: sum(verdict(TR.make_trace(p["nums"], p["target"], rng, 1e9, 0.0, {name: 1}))
                       == "found" for p in problems) / len(problems)
             for name in TR.STRATEGIES}
    assert first["backward"] > 0.4 and first["random"] < 0.15  # measured 0.48 and 0.07 (train)


@pytest.mark.parametrize("text,name", [
    (" Need 35 / 5 = 7: 2 + 14 = 16, back.", "backward"),
    ("Need 5: ...", "backward"),
    (" 3 + 5 = 8, left 7 8. 7 * 8 = 56. Target 60, back.", "random"),
    ("12 / 4 = 3. Target 3, found.", "random"),
    (" </think>\n<answer>3 + 5</answer>", "other"),
    ("", "other"),
    ("need 5: lower case is not the strategy's word", "other"),
])
def test_strategy_of(text, name):
    assert TR.strategy_of(text) == name


def test_strategy_stats_and_metrics():
    texts = ["Need 5: x", "Need 3: y", "1 + 2 = 3.", "??"]
    stats = TR.strategy_stats(texts, [1.0, 0.1, 0.0, 1.0])
    assert stats == {"random": {"share": 0.25, "pass@1": 0.0},
                     "backward": {"share": 0.5, "pass@1": 0.5},
                     "other": {"share": 0.25, "pass@1": 1.0}}
    m = TR.strategy_metrics("train", TR.strategy_stats(texts[:1], [1.0]))
    # a strategy no sample used: share 0, and no pass rate rather than a made-up one
    assert m == {"train/strategy/random": 0.0, "train/strategy/backward": 1.0,
                 "train/strategy_acc/backward": 1.0}


@pytest.mark.parametrize("text,bad", [("random:0.7,backward:0.3", None), ("backward", None),
                                      ("forward:1", "unknown"), ("random:x", "not a number"),
                                      ("random:-1", "negative"), ("random:0", "sum to 0")])
def test_parse_mix(text, bad):
    if bad is None:
        assert sum(TR.parse_mix(text).values()) > 0
    else:
        with pytest.raises(ValueError, match=bad):
            TR.parse_mix(text)


# ---- the unverified source: LLM-like mistakes, read back from the text -------------------------
@pytest.mark.parametrize("kind", TR.MISTAKES)
def test_each_mistake_is_written_wrong_and_read_back_as_its_kind(problems, kind):
    rng = random.Random(0)
    traces = [TR.make_trace(p["nums"], p["target"], rng, 1.0, 0.5, {"random": 0.7, "backward": 0.3},
                            {kind: 1.0}) for p in problems]
    # every one answers, and wrongly: the real set's wrong traces score 0.1, never 0
    assert all(V.score(t, p["nums"], p["target"]) == 0.1 for t, p in zip(traces, problems))
    kinds = [TR.mistake_of(t, p["nums"], p["target"]) for t, p in zip(traces, problems)]
    # a kind a problem cannot have (no try misses, no variant reaches the target) is `malformed`
    assert set(kinds) <= {kind, "malformed"} and kinds.count(kind) > 0.85 * len(kinds)
    a = E.arithmetic(traces, [p["target"] for p in problems])
    if kind == "slip":  # a step written wrong, its value the target's: a step error, not a claim's
        assert a["step_error"] > 0.15 and a["false_claims"] == 0
    else:  # the other kinds compute every written step right
        assert a["step_error"] == 0


def test_the_default_source_is_as_often_right_as_the_real_set_and_the_gate_keeps_only_those():
    import sft
    prompts, write = D.sft_data("gen:nums=3,range=1-20,test=5,val=5", "train", 1500, "compact",
                                  5, 1.0, 0.5, mix={"random": 0.7, "backward": 0.3},
                                  mistakes=TR.parse_mix(D.LLM_MISTAKES, TR.MISTAKES, rates=True))
    tasks = D.load_tasks("gen:nums=3,range=1-20,test=5,val=5", "train", 1500)  # the prompts' own
    traces = write(random.Random(0))
    right = [V.score(t, x["nums"], x["target"]) == 1.0 for t, x in zip(traces, tasks)]
    assert abs(sum(right) / len(right) - 0.37) < 0.04  # Cognitive Behaviors' set: ~37 % correct
    shares = TR.mistake_shares(traces, tasks)
    assert abs(shares["slip"] - 0.25) < 0.04 and 0.1 < shares["reuse"] < 0.17
    assert abs(sum(shares.values()) + sum(right) / len(right) - 1) < 1e-9  # each wrong one a kind
    _, gated = D.sft_data("gen:nums=3,range=1-20,test=5,val=5", "train", 1500, "compact", 5, 1.0,
                            0.5, mix={"random": 0.7}, mistakes={"slip": 0.6}, verified=True)
    kept = gated(random.Random(0))
    assert all(V.score(t, x["nums"], x["target"]) == 1.0 for t, x in zip(kept, tasks) if t)
    assert abs(sum(t is not None for t in kept) / len(kept) - 0.4) < 0.05
    # the gate's rejects drop out of the batch, not into it as empty targets
    from plumbing import models
    tok = models.build_tiny_tokenizer()
    mbs = list(sft.micro_batches(tok, prompts[:64], kept[:64], 64, 512, 1024, "cpu"))
    assert len(mbs[0][0]) == sum(t is not None for t in kept[:64])


@pytest.mark.parametrize("text,out", [("none", {}), ("slip:0.3,giveup:0.2", {"slip": 0.3, "giveup": 0.2}),
                                      ("slip:0.7,giveup:0.5", "more than 1"), ("typo:0.1", "unknown")])
def test_parse_mistake_rates(text, out):
    if isinstance(out, dict):
        assert TR.parse_mix(text, TR.MISTAKES, rates=True) == out
    else:
        with pytest.raises(ValueError, match=out):
            TR.parse_mix(text, TR.MISTAKES, rates=True)


def test_mistake_of_reads_a_models_text():
    n, t = [3, 5, 7], 22
    assert TR.mistake_of(" 3 * 5 = 15, left 7 15. 15 + 7 = 22. Target 22, found.\n</think>\n"
                         "<answer>3 * 5 + 7</answer>", n, t) is None  # right
    assert TR.mistake_of(" 3 + 5 = 8, left 7 8. 8 * 7 = 22. Target 22, found.\n</think>\n", n, t) is None
    assert TR.mistake_of(" 3 + 5 = 8, left 7 8. 8 * 7 = 22. Target 22, found.\n</think>\n"
                         "<answer>(3 + 5) * 7</answer>", n, t) == "slip"
    assert TR.mistake_of(" 3 + 5 = 8, left 7 8. 8 * 7 = 56. Target 22, back.\n</think>\n"
                         "<answer>(3 + 5) * 7</answer>", n, t) == "giveup"
    assert TR.mistake_of("<answer>15 + 7</answer>", n, t) == "reuse"  # 3 and 5 left out
    assert TR.mistake_of("<answer>3 * 5 + 7 + 7</answer>", n, t) == "reuse"  # 7 twice
    assert TR.mistake_of("<answer>3 * 5 + 7 = 22</answer>", n, t) == "malformed"
    assert TR.mistake_of("<answer>3 * (5 + 7</answer>", n, t) == "malformed"


def test_the_solver_on_ints_moves_as_on_fractions():
    """verifier._moves' restricted fast path (ints, used by the traces) gives the moves, values and
    order of the rule on Fractions: a non-negative integer result only."""
    from fractions import Fraction
    for x in range(0, 25):
        for y in range(0, 25):
            on_ints = V._moves((x, "a"), (y, "b"), True)
            on_fractions = [m for m in V._moves((Fraction(x), "a"), (Fraction(y), "b"), False)
                            if m[0] >= 0 and m[0].denominator == 1]
            assert [(v, op, l[1], r[1]) for v, op, l, r in on_ints] == \
                [(v, op, l[1], r[1]) for v, op, l, r in on_fractions]
            assert all(type(m[0]) is int for m in on_ints)


def test_the_reuse_mistake_is_the_same_with_the_solvable_check_first(problems, monkeypatch):
    """_reuse asks the generator's cached check before searching a variant: the same mistakes, the
    same rng stream, as searching every variant."""
    four = V.generate_splits({"p": 100}, seed=3, num_numbers=(4,), num_range=(1, 30))["p"]
    fast = [TR._reuse(p["nums"], p["target"], random.Random(i)) for i, p in enumerate(problems + four)]
    monkeypatch.setattr(TR, "_solvable", lambda values, target: True)
    slow = [TR._reuse(p["nums"], p["target"], random.Random(i)) for i, p in enumerate(problems + four)]
    assert fast == slow and sum(x is not None for x in fast) > 100
