import hashlib
import json
import random
import re
import time
from fractions import Fraction

import pytest

from plumbing import traces as TR
import verifier as V

NUMS, TARGET = [3, 5, 4], 32  # (3 + 5) * 4 = 32


def ans(expr):
    return f"<think>...</think>\n<answer>{expr}</answer>"


@pytest.mark.parametrize("response, expected", [
    # correct: any parenthesization, order, whitespace (newlines too), unary minus, redundant parens
    (ans("(3 + 5) * 4"), 1.0),
    (ans("4*(5+3)"), 1.0),
    (ans("\n ( 3\n+5 )\t* 4 \n"), 1.0),
    (ans("((((3 + 5)))) * 4"), 1.0),
    (ans("-(-3 - 5) * 4"), 1.0),
    (ans("- - (3 + 5) * 4"), 1.0),
    (ans("4 * (5 + 3) / 1 * 1") , 0.1),       # extra literals: not the given multiset
    (ans("(3 + 5) * 04"), 1.0),                # leading zero is still the integer 4
    # the last complete block wins
    (ans("3 + 5 + 4") + ans("(3 + 5) * 4"), 1.0),
    (ans("(3 + 5) * 4") + ans("3 + 5 + 4"), 0.1),
    (ans("(3 + 5) * 4") + "<answer>3 + 5", 1.0),   # an unclosed block is not an answer
    ("<answer><answer>(3 + 5) * 4</answer>", 1.0),
    # no complete block: 0.0
    ("(3 + 5) * 4", 0.0),
    ("<answer>(3 + 5) * 4", 0.0),
    ("(3 + 5) * 4</answer>", 0.0),
    ("</answer>(3+5)*4<answer>", 0.0),
    ("", 0.0),
    # present but wrong or invalid: 0.1
    (ans("3 + 5 + 4"), 0.1),                   # wrong value
    (ans("(3 + 5) * 4 = 32"), 0.1),            # '=' is not part of an expression
    (ans("(3 + 3) * 4"), 0.1),                 # wrong numbers
    (ans("(3 + 5) * 4 * 4"), 0.1),             # a number used twice
    (ans("8 * 4"), 0.1),                       # intermediate value instead of the numbers
    (ans("(3 + 5) ** 4"), 0.1),
    (ans("(3 + 5) // 4 * 4"), 0.1),
    (ans("(3 + 5) % 4"), 0.1),
    (ans("(3.0 + 5) * 4"), 0.1),               # decimals
    (ans("(3 + 5) x 4"), 0.1),                 # names
    (ans("(3 + 5) × 4"), 0.1),                 # only ASCII operators
    (ans("abs(3 + 5) * 4"), 0.1),              # calls
    (ans("(3 + 5)(4)"), 0.1),                  # implicit multiplication
    (ans("+3 + 5 * 4"), 0.1),                  # no unary plus
    (ans("(3 + 5 * 4"), 0.1),                  # unbalanced
    (ans("3 + 5) * 4"), 0.1),
    (ans("()3 + 5 * 4"), 0.1),
    (ans(""), 0.1),
    (ans("   "), 0.1),
    (ans("3 + 5 * 4 -"), 0.1),
    (ans("3 5 4"), 0.1),
    (ans("__import__('os')"), 0.1),
])
def test_score_table(response, expected):
    assert V.score(response, NUMS, TARGET) == expected


@pytest.mark.parametrize("expr, nums, target, expected", [
    # exact fractions: 4 / (1/6) = 24, floats would miss
    ("4 / (1 - 5 / 6)", [4, 1, 5, 6], 24, 1.0),
    ("6 / (1 - 3 / 4)", [6, 1, 3, 4], 24, 1.0),
    ("(1 + 2) / (3 - 3)", [1, 2, 3, 3], 0, 0.1),  # division by zero
    ("7 / 2 * 2", [7, 2, 2], 7, 1.0),
    ("7 / 2", [7, 2], 3, 0.1),                     # no integer division
    ("-5 + 3 + 12", [5, 3, 12], 10, 1.0),
    ("2 - 3 - 4", [2, 3, 4], -5, 1.0),             # left-associative
    ("2 - (3 - 4)", [2, 3, 4], 3, 1.0),
    ("2 * 3 + 4", [2, 3, 4], 10, 1.0),             # precedence
    ("2 + 3 * 4", [2, 3, 4], 14, 1.0),
    ("48 / 4 / 2", [48, 4, 2], 6, 1.0),
])
def test_score_arithmetic(expr, nums, target, expected):
    assert V.score(ans(expr), nums, target) == expected


def test_extract_answer():
    assert V.extract_answer("a <answer> x </answer> b <answer>y</answer>") == "y"
    assert V.extract_answer("<answer>y") is None
    assert V.extract_answer("no tags") is None


ADVERSARIAL = [
    ans("(" * 5000 + "3 + 5" + ")" * 5000 + " * 4"),
    ans("(" * 5000 + "3 + 5 * 4"),
    ans("-" * 100_000 + "3"),
    ans("9**9**9**9"),
    ans("9" * 100_000),
    ans("1" * 4301 + " + 5 * 4"),  # longer than Python's int-parsing digit limit
    ans(" + ".join(["3"] * 30_000)),
    ans("3 + 5 * 4" + " " * 100_000),
    "<answer>" * 50_000 + "</answer>" * 50_000,
    ans("\x00\uffff" * 1000),
    ans("1+" * 200_000 + "1"),  # 400,000 characters, 200,001 literals
    ans("1+" * 2000 + "1"),  # under the length cap: rejected by the literal count, never tokenized
    ans("(" * 500_000 + "3 + 5" + ")" * 500_000 + " * 4"),  # 1 MB of valid nesting
    ans("-" * 1_000_000 + "3 + 5 * 4"),  # 1 MB of unary minus
    ans("-" * (V.MAX_ANSWER_CHARS - 10) + "3 + 5 * 4"),  # the slowest answer the parser still takes
    "x" * 1_000_000 + ans("3 + 5 * 4"),  # 1 MB of text before the answer
]


@pytest.mark.parametrize("response", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_are_fast_and_safe(response):
    for fn in (V.score, V.dense_score):
        seconds = []
        for _ in range(3):  # the best of 3, so a busy CI core does not fail the test
            t = time.perf_counter()
            result = fn(response, NUMS, TARGET)
            seconds.append(time.perf_counter() - t)
        assert min(seconds) < 0.010, f"{min(seconds) * 1e3:.1f} ms"
        assert result in (0.0, 0.1, 1.0) or 0.1 <= result <= 0.6


def test_runs_of_unary_minus_cancel_in_pairs():
    """The parser cancels '- -' before the operand (no arithmetic for a run of 4,000): values by
    parity."""
    for n in range(7):
        sign = (-1) ** n
        assert V.evaluate_expression("-" * n + "3 + 5 * 4", [3, 4, 5]) == sign * 3 + 20
        assert V.evaluate_expression("5 * " + "-" * n + "(3 - 4)", [3, 4, 5]) == 5 * sign * -1
        assert V.evaluate_expression("-" * n + "(" + "-" * n + "3 + 4) * 5", [3, 4, 5]) == sign * (sign * 3 + 4) * 5
        assert V.evaluate_expression("3 - " + "-" * n + "4 / 5", [3, 4, 5]) == 3 - sign * Fraction(4, 5)


def test_deep_but_valid_nesting_still_scores():
    """2,000 levels: twice Python's recursion limit, under MAX_ANSWER_CHARS."""
    assert V.score(ans("(" * 2000 + "3 + 5" + ")" * 2000 + " * 4"), NUMS, TARGET) == 1.0


def test_answers_over_the_length_cap_score_point_one():
    padded = "3 + 5 * 4" + " " * V.MAX_ANSWER_CHARS  # valid, but longer than any answer needs to be
    assert V.score(ans(padded), NUMS, TARGET) == 0.1 and V.dense_score(ans(padded), NUMS, TARGET) == 0.1


def test_dense_score():
    assert V.dense_score("no answer", NUMS, TARGET) == 0.0
    assert V.dense_score(ans("(3 + 5) * 4"), NUMS, TARGET) == 1.0
    assert V.dense_score(ans("8 * 4"), NUMS, TARGET) == 0.1  # not the given numbers
    assert V.dense_score(ans("3 + 5 + 4"), NUMS, TARGET) == pytest.approx(0.1 + 0.5 * (1 - 20 / 32))
    # |v - t| >= |t|: floor
    assert V.dense_score(ans("3 - 5 - 4"), NUMS, TARGET) == pytest.approx(0.1)
    # target 0: divide by 1
    assert V.dense_score(ans("3 - 5 * 4"), [3, 5, 4], 0) == pytest.approx(0.1)


def test_dense_score_monotone_in_distance():
    nums = [2, 3, 7]
    exprs = ["2 + 3 + 7", "2 * 3 + 7", "2 * 3 * 7", "(2 + 3) * 7", "7 - 3 - 2", "7 * 3 - 2", "7 / 2 + 3"]
    for target in (10, 20, 40):
        pairs = sorted((abs(V.evaluate_expression(e, nums) - target), V.dense_score(ans(e), nums, target)) for e in exprs)
        for (d1, s1), (d2, s2) in zip(pairs, pairs[1:]):
            assert s1 >= s2 if d1 <= d2 else True
        assert all(0.1 <= s <= 1.0 for _, s in pairs)


@pytest.fixture(scope="module")
def problems():
    return V.generate_splits({"test": 1000}, seed=7)["test"]


def test_every_solver_answer_scores_one(problems):
    assert len(problems) == 1000
    for p in problems:
        expr = V.solve(p["nums"], p["target"])
        assert expr is not None and V.score(ans(expr), p["nums"], p["target"]) == 1.0


def test_solve_unsolvable_returns_none():
    assert V.solve([1, 1, 1], 100) is None
    assert V.solve([2, 2], 5) is None


def test_generator_distribution_and_determinism(problems):
    assert problems[:50] == V.generate_splits({"test": 50}, seed=7)["test"]
    assert {len(p["nums"]) for p in problems} == {3, 4}
    assert all(1 <= x <= 99 for p in problems for x in p["nums"]) and all(10 <= p["target"] <= 100 for p in problems)
    keys = {(tuple(sorted(p["nums"])), p["target"]) for p in problems}
    assert len(keys) == len(problems)


def test_splits_are_disjoint_and_stable():
    a = V.generate_splits({"test": 100, "val": 50, "train": 300}, seed=1, num_numbers=(3,), num_range=(1, 9))
    b = V.generate_splits({"test": 100, "val": 50, "train": 600}, seed=1, num_numbers=(3,), num_range=(1, 9))
    assert a["test"] == b["test"] and a["val"] == b["val"]
    keys = {name: {(tuple(sorted(p["nums"])), p["target"]) for p in rows} for name, rows in a.items()}
    assert not keys["test"] & keys["train"] and not keys["test"] & keys["val"] and not keys["val"] & keys["train"]
    assert all(len(p["nums"]) == 3 and max(p["nums"]) <= 9 for p in a["train"])


def test_a_three_and_four_number_mix_is_balanced_in_every_prefix_of_every_split():
    """The 3/4 lane's data (paper 001's balanced mix): each split half 3-number, half 4-number, to
    one problem at every prefix (the uniform draw kept 173 four-number problems of 200 in 1-20);
    the splits disjoint; a longer train's prefix is the shorter one. Broken on purpose (the count
    drawn uniformly again), it failed."""
    a = V.generate_splits({"test": 201, "val": 100, "train": 400}, seed=2, num_numbers=(3, 4),
                          num_range=(1, 20))
    b = V.generate_splits({"test": 201, "val": 100, "train": 800}, seed=2, num_numbers=(3, 4),
                          num_range=(1, 20))
    assert a["test"] == b["test"] and a["val"] == b["val"] and b["train"][:400] == a["train"]
    for rows in b.values():
        fours = 0
        for i, p in enumerate(rows, 1):
            fours += len(p["nums"]) == 4
            assert abs(2 * fours - i) <= 1, i
    keys = {name: {(tuple(sorted(p["nums"])), p["target"]) for p in rows} for name, rows in b.items()}
    assert not keys["test"] & keys["train"] and not keys["test"] & keys["val"] and not keys["val"] & keys["train"]


def test_a_single_count_draws_the_problems_it_always_drew():
    """Balancing left one count's stream as it was: the default pipeline's splits (3 numbers in
    1-20) are the ones every earlier result was measured on (this hash is theirs, from the generator
    before the mix was balanced). Broken on purpose (the count drawn without rng.choice), it failed."""
    out = V.generate_splits({"test": 200, "val": 100, "train": 300}, 0, (3,), (1, 20), (10, 100))
    assert hashlib.sha256(json.dumps(out).encode()).hexdigest()[:16] == "63dbe38cedfab1c5"


def test_small_problem_space_runs_dry_instead_of_hanging():
    out = V.generate_splits({"test": 10, "train": 10**6}, seed=0, num_numbers=(2,), num_range=(1, 3), target_range=(1, 10))
    assert len(out["test"]) == 10 and 0 < len(out["train"]) < 50


@pytest.mark.parametrize("dead_ends", [0, 3])
def test_traces_end_in_a_verified_answer(problems, dead_ends):
    rng = random.Random(0)
    for p in problems[:200]:
        trace = TR.make_trace(p["nums"], p["target"], rng, dead_ends=dead_ends)
        assert trace.count("</think>") == 1 and trace.rstrip().endswith("</answer>")
        assert V.score(trace, p["nums"], p["target"]) == 1.0
        if dead_ends == 0:
            assert "back." not in trace
    assert TR.make_trace([1, 1, 1], 100) is None
    assert V.score(TR.make_trace([5], 5), [5], 5) == 1.0  # one number: no step, still a valid answer


def test_trace_tries_are_uncapped_and_claims_are_honest(problems):
    """Each try ends 'found' exactly when its last value is T, and the number of dead ends is
    geometric (mean about dead_ends, no cap): the position of a try never tells whether it is the
    one."""
    rng, dead = random.Random(0), []
    for p in problems[:300]:
        lines = TR.make_trace(p["nums"], p["target"], rng, dead_ends=2.0).split("\n")[:-2]
        tries = [line for line in lines if "Target" in line]  # a step a line; a try's last says its verdict
        assert all(", left " in line for line in lines if "Target" not in line) and lines[-1] is tries[-1]
        for line in tries:
            last = int(re.findall(r"=(\d+)\. Target", line)[-1])
            assert line.endswith(f"Target {p['target']}, " + ("found." if last == p["target"] else "back."))
            assert (last == p["target"]) == (line is tries[-1])
        dead.append(len(tries) - 1)
    assert 1.3 < sum(dead) / len(dead) < 2.1 and max(dead) >= 6 and dead.count(1) > 0


def test_near_misses_are_close_legal_misses(problems):
    """A near-miss dead end is a legal path that misses the target by less than a random path does,
    and its verdict is 'back': 'found' cannot be read off the value's magnitude. With
    near_misses=0 the traces are exactly the random-dead-end ones (same rng stream)."""
    rng, near, far = random.Random(0), [], []
    for p in problems[:300]:
        if len(p["nums"]) != 3:
            continue
        for share, dist in ((1.0, near), (0.0, far)):
            lines = TR.make_trace(p["nums"], p["target"], rng, 2.0, share).split("\n")
            for line in [line for line in lines if "Target" in line][:-1]:  # the dead ends' verdicts
                assert line.endswith(f"Target {p['target']}, back.")
                dist.append(abs(int(re.findall(r"=(\d+)\. Target", line)[-1]) - p["target"]))
    assert len(near) > 100 and 0 not in near and sorted(near)[len(near) // 2] * 4 < sorted(far)[len(far) // 2]
    a = [TR.make_trace(p["nums"], p["target"], random.Random(1), 1.0) for p in problems[:50]]
    assert a == [TR.make_trace(p["nums"], p["target"], random.Random(1), 1.0, 0.0) for p in problems[:50]]
    assert TR.near_miss([3, 4], 7, random.Random(0))[-1][3] != 7 and TR.near_miss([7], 7, random.Random(0)) is None


def test_arith_text_is_trace_steps_over_the_given_numbers():
    text = TR.arith_text([[7, 4, 5], [12, 3, 9, 20]], random.Random(0))
    lines = text.split("\n")
    assert [", left " in line for line in lines] == [True, False, True, True, False]  # a step a line
    assert all(line.count("=") == 1 for line in lines)
    assert "Target" not in text and re.match(r"[745][-+*/]", text) and re.match(r"(12|3|9|20)[-+*/]", lines[2])


def test_trace_arithmetic_is_right():
    trace = TR.make_trace([7, 4, 5], 55, random.Random(1), dead_ends=3)
    for line in trace.split("\n")[:-2]:
        (a, op, b, rhs), = re.findall(r"^(\d+)([-+*/])(\d+)=(\d+)[,.]", line)  # a step a line
        value = {"+": Fraction(a) + Fraction(b), "-": Fraction(a) - Fraction(b), "*": Fraction(a) * Fraction(b),
                 "/": Fraction(a) / Fraction(b)}[op]
        assert value == Fraction(rhs)


def test_operator_flip_negatives_never_score_one(problems):
    rng, made = random.Random(0), 0
    for p in problems:
        expr = V.solve(p["nums"], p["target"])
        neg = TR.flip_operator(expr, p["nums"], p["target"], rng)
        if neg is None:
            continue
        made += 1
        assert V.score(ans(neg), p["nums"], p["target"]) == 0.1
        assert sum(a != b for a, b in zip(neg, expr)) == 1 and len(neg) == len(expr)
    assert made > 900


def test_flip_skips_unary_minus():
    assert TR.flip_operator("-3 + 5", [3, 5], 2, random.Random(0)) in ("-3 - 5", "-3 * 5", "-3 / 5")
