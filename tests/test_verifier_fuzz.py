"""The verifier under fire (hypothesis): whatever a model writes, `score` returns one of its three
values in milliseconds, never raises, and never gives 1.0 unless the answer's literals are
exactly the given numbers and its exact value is the target. The oracle below is written
independently of verifier.py."""
import re
import time
from collections import Counter
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import verifier as V

FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# per call; typical calls take well under a millisecond (the adversarial tests: < 10 ms)
LIMIT_S = 0.05


def timed_score(response, nums, target):
    """score(), and the best of up to 3 timings under LIMIT_S: a garbage collection or a busy CI
    core can stall any one call."""
    seconds = []
    for _ in range(3):
        t0 = time.perf_counter()
        s = V.score(response, nums, target)
        seconds.append(time.perf_counter() - t0)
        if seconds[-1] < LIMIT_S:
            break
    assert s in (0.0, 0.1, 1.0) and min(seconds) < LIMIT_S, (s, seconds, response[:200])
    return s


def tree_value(expr):
    """Oracle: exact value of a +-*/ expression with parentheses, by Python's own precedence on
    Fractions (the string only holds digits, operators, parens and spaces)."""
    py = re.sub(r"\d+", lambda m: f"Fraction({int(m.group())})", expr)
    try:
        # test oracle only; verifier.py never evaluates code
        return eval(py, {"Fraction": Fraction})
    except ZeroDivisionError:
        return None


# +-*/ expressions with literals 0-120, random parentheses (so every precedence case comes up), up
# to 6 leaves
expressions = st.recursive(st.integers(0, 120).map(str),
                           lambda kids: st.tuples(kids, st.sampled_from("+-*/"), kids, st.booleans(), st.booleans())
                           .map(lambda t: f"{'(' + t[0] + ')' if t[3] else t[0]} {t[1]} {'(' + t[2] + ')' if t[4] else t[2]}"),
                           max_leaves=6)


@FAST
@given(st.text(max_size=400), st.lists(st.integers(0, 100), min_size=1, max_size=4), st.integers(-100, 200))
def test_arbitrary_text_never_raises_and_is_fast(text, nums, target):
    timed_score(text, nums, target)
    timed_score(f"<answer>{text}</answer>", nums, target)


@FAST
@given(st.text(alphabet="0123456789+-*/() <>answer/\n", max_size=300), st.lists(st.integers(0, 99), min_size=3, max_size=4),
       st.integers(0, 100))
def test_arithmetic_looking_noise_scores_one_only_when_right(text, nums, target):
    s = timed_score(text, nums, target)
    if s == 1.0:
        answer = V.extract_answer(text)
        assert Counter(int(x) for x in re.findall(r"\d+", answer)) == Counter(nums)
        assert tree_value(answer) == target


@FAST
@given(expressions, st.data())
def test_scores_one_iff_the_literals_are_the_numbers_and_the_value_the_target(expr, data):
    lits = [int(x) for x in re.findall(r"\d+", expr)]
    value = tree_value(expr)
    # the given numbers: the expression's own literals (shuffled), or a multiset that differs from
    # them
    same = data.draw(st.booleans())
    nums = data.draw(st.permutations(lits)) if same else data.draw(
        st.lists(st.integers(0, 120), min_size=1, max_size=6).filter(lambda n: Counter(n) != Counter(lits)))
    target = int(value) if value is not None and value.denominator == 1 else data.draw(st.integers(0, 100))
    prose = data.draw(st.sampled_from(["", "<think>try 3 + 4</think>\n", "<answer>1 + 2</answer> then "]))
    s = timed_score(f"{prose}<answer>{expr}</answer>", nums, target)
    assert (s == 1.0) == (same and value is not None and value == target)


@FAST
@given(st.integers(1, 3000), st.sampled_from(["(", "-", "((-", "(-("]))
def test_deep_nesting_and_unary_chains_are_answered(depth, opener):
    closer = ")" * opener.count("(")
    expr = opener * depth + "3" + closer * depth + " + 4 + 5"
    timed_score(f"<answer>{expr}</answer>", [3, 4, 5], 12)


def test_non_ascii_digits_are_not_numbers():
    # found by the fuzz tests above: '\d' matched Arabic-Indic and full-width digits, and int() read
    # them
    for three in ("\u0663", "\uff13", "\U0001d7d1"):
        assert V.score(f"<answer>{three} + 4 + 5</answer>", [3, 4, 5], 12) == 0.1
    assert V.score("<answer>3 + 4 + 5</answer>", [3, 4, 5], 12) == 1.0
