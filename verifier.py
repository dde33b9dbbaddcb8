"""The Countdown task, standard library only: answer extraction, exact scoring, solver, generator,
solver-written search traces and operator-flip negatives.

score() is the reward of paper 000 §3.1: 1.0 for a correct equation, 0.1 for an extracted but wrong or
invalid one, 0.0 when no complete <answer>...</answer> block exists. dense_score() is paper 001's
distance-shaped variant (training only). Nothing here calls eval: expressions are tokenized with one
regex, parsed by an explicit-stack shunting-yard (so 5,000 nested parentheses cannot hit Python's
recursion limit) and evaluated with fractions.Fraction.
"""
import functools
import itertools
import random
import re
from collections import Counter
from fractions import Fraction

_TOKEN = re.compile(r"\d+|\S")  # a literal, or any single non-space character
_ALLOWED = re.compile(r"[\d\s+\-*/()]*")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "neg": 3}


def extract_answer(response):
    """Text of the *last* complete <answer>...</answer> block, or None."""
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end >= 0 else -1
    return None if start < 0 else response[start + len("<answer>"):end]


def evaluate_expression(expr, numbers):
    """Exact value of `expr` if it is a valid expression whose literals are exactly `numbers` (as a
    multiset), else None. Cheap checks first so hostile input never reaches the parser."""
    if not _ALLOWED.fullmatch(expr):  # names, '.', '%', '=', '^', unicode operators, ...
        return None
    tokens = _TOKEN.findall(expr)
    literals = [t for t in tokens if t.isdigit()]
    if len(literals) != len(numbers) or any(len(t) > 12 for t in literals):
        return None  # wrong count, or a literal no Countdown number could be (keeps int() cheap)
    if Counter(int(t) for t in literals) != Counter(int(n) for n in numbers):
        return None
    return _shunting_yard(tokens)


def _apply(op, values):
    if op == "neg":
        values.append(-values.pop())
        return
    b, a = values.pop(), values.pop()
    if op == "/" and b == 0:
        raise ZeroDivisionError
    values.append(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b)


def _shunting_yard(tokens):
    """Parse and evaluate in one pass. `expect_operand` is the grammar state: True after an operator
    or '(' (where a literal, '(' or unary minus may come), False after a literal or ')'."""
    values, ops, expect_operand = [], [], True
    try:
        for t in tokens:
            if t.isdigit():
                if not expect_operand:
                    return None  # "3 4"
                values.append(Fraction(int(t)))
                expect_operand = False
            elif t == "(":
                if not expect_operand:
                    return None  # "3(4)": implicit multiplication is not allowed
                ops.append(t)
            elif t == ")":
                if expect_operand:
                    return None  # "()" or "3+)"
                while ops and ops[-1] != "(":
                    _apply(ops.pop(), values)
                if not ops:
                    return None  # unbalanced
                ops.pop()
            elif expect_operand:
                if t != "-":
                    return None  # "**", "//", "*3", "+3" (no unary plus)
                ops.append("neg")  # unary minus: right-associative, binds tightest
            else:  # binary operator: pop everything of higher or equal precedence (left-assoc.)
                while ops and ops[-1] != "(" and _PREC[ops[-1]] >= _PREC[t]:
                    _apply(ops.pop(), values)
                ops.append(t)
                expect_operand = True
        if expect_operand:
            return None  # empty, or a trailing operator
        while ops:
            op = ops.pop()
            if op == "(":
                return None  # unbalanced
            _apply(op, values)
    except ZeroDivisionError:
        return None
    return values[0] if len(values) == 1 else None


def score(response, numbers, target):
    """Paper 000 §3.1 reward: 1.0 correct, 0.1 answer present but wrong/invalid, 0.0 no answer."""
    expr = extract_answer(response)
    if expr is None:
        return 0.0
    return 1.0 if evaluate_expression(expr, numbers) == target else 0.1


def dense_score(response, numbers, target):
    """Paper 001's shaped reward: a valid expression over exactly `numbers` with value v != target
    earns 0.1 + 0.5 * max(0, 1 - |v - target| / max(1, |target|)); otherwise as score()."""
    expr = extract_answer(response)
    if expr is None:
        return 0.0
    value = evaluate_expression(expr, numbers)
    if value is None:
        return 0.1
    if value == target:
        return 1.0
    return 0.1 + 0.5 * max(0.0, 1.0 - float(abs(value - target)) / max(1, abs(target)))


# ---- solver --------------------------------------------------------------------------------------
def _moves(a, b, restricted):
    """(value, op, left, right) for every way to combine two (value, expr) items. `restricted` is the
    Stream-of-Search generator's rule: non-negative integers only (no negative -, exact / only)."""
    (va, ea), (vb, eb) = a, b
    out = [(va + vb, "+", ea, eb), (va * vb, "*", ea, eb), (va - vb, "-", ea, eb), (vb - va, "-", eb, ea)]
    if vb != 0:
        out.append((va / vb, "/", ea, eb))
    if va != 0:
        out.append((vb / va, "/", eb, ea))
    if restricted:
        out = [m for m in out if m[0] >= 0 and m[0].denominator == 1]
    return out


def _search(items, target, restricted, path):
    """Depth-first search over pair merges. Yields (expr, path) for each solution, where path is the
    list of (left value, op, right value, result) steps taken."""
    if len(items) == 1:
        if items[0][0] == target:
            yield items[0][1], path
        return
    for i, j in itertools.combinations(range(len(items)), 2):
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        for value, op, left, right in _moves(items[i], items[j], restricted):
            step = (*_operand_values(items[i], items[j], left), op, value)
            yield from _search(rest + [(value, f"({left} {op} {right})")], target, restricted, path + [step])


def _operand_values(a, b, left):
    return (a[0], b[0]) if left == a[1] else (b[0], a[0])


def solve(numbers, target, restricted=False):
    """An expression over exactly `numbers` equal to `target` (scores 1.0), or None."""
    items = [(Fraction(n), str(n)) for n in numbers]
    for expr, _ in _search(items, Fraction(target), restricted, []):
        return expr[1:-1] if len(numbers) > 1 else expr  # drop the redundant outer parentheses
    return None


# ---- generator -----------------------------------------------------------------------------------
def generate_splits(sizes, seed=0, num_numbers=(3, 4), num_range=(1, 99), target_range=(10, 100)):
    """Disjoint splits of distinct problems, e.g. sizes={"test": 500, "val": 200, "train": 10000}.
    Like the Stream-of-Search generator behind Countdown-Tasks-3to4: draw the count of numbers, the
    numbers and the target uniformly, keep the draw if the target is reachable using every number with
    +, non-negative -, * and exact /. Splits are filled in the order given, so with the same seed and
    knobs the first splits (put the test set first) do not change when a later one grows. No
    (sorted numbers, target) appears twice, in or across splits. A small problem space runs dry: after
    5,000 rejections in a row the remaining splits are returned short instead of looping for ever."""
    rng, seen, out, misses = random.Random(seed), set(), {name: [] for name in sizes}, 0
    for name, n in sizes.items():
        while len(out[name]) < n and misses < 5000:
            nums = [rng.randint(*num_range) for _ in range(rng.choice(num_numbers))]
            target = rng.randint(*target_range)
            key = (tuple(sorted(nums)), target)
            if key in seen or not _solvable(key[0], target):
                misses += 1
                continue
            misses = 0
            seen.add(key)
            out[name].append({"nums": nums, "target": target})
    return out


def _merges(values):
    """(rest, merged value) for each pair of the tuple `values` and each value the generator's rule
    allows for it: non-negative integers only, a+b, a*b, |a-b|, exact a/b."""
    for i, j in itertools.combinations(range(len(values)), 2):
        a, b = values[i], values[j]
        rest = values[:i] + values[i + 1:j] + values[j + 1:]
        merged = {a + b, a * b, abs(a - b)} | ({a // b} if b and a % b == 0 else set()) | ({b // a} if a and b % a == 0 else set())
        for v in merged:
            yield tuple(sorted(rest + (v,)))


@functools.lru_cache(maxsize=100_000)
def _reachable(values):
    """Every value reachable from the sorted tuple `values` using all of them. Cached: small
    sub-tuples repeat a lot across draws."""
    if len(values) == 1:
        return frozenset(values)
    return frozenset().union(*(_reachable(t) for t in _merges(values)))


def _solvable(values, target):
    """target reachable from `values`? Early exit for 4+ numbers, whose full sets are large."""
    if len(values) <= 3:
        return target in _reachable(values)
    return any(_solvable(t, target) for t in _merges(values))


# ---- solver-written traces (SFT data) and hard negatives -----------------------------------------
def _fmt(v):
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def _random_path(numbers, rng):
    """A random sequence of legal merges down to one value: a 'try' that may or may not hit."""
    items, steps = [Fraction(n) for n in numbers], []
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        value, op, left, _ = rng.choice(_moves((items[i], "i"), (items[j], "j"), restricted=True))
        a, b = (items[i], items[j]) if left == "i" else (items[j], items[i])
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [value]
        steps.append((a, b, op, value, list(items)))
    return steps


def _steps_text(steps):
    return " ".join(f"{_fmt(a)} {op} {_fmt(b)} = {_fmt(v)}" + (f", left {' '.join(map(_fmt, rest))}." if len(rest) > 1 else ".")
                    for a, b, op, v, rest in steps)


def make_trace(numbers, target, rng=None, max_dead_ends=0):
    """A Stream-of-Search-style trace, the text after the prompt's '<think>': up to `max_dead_ends`
    failed tries (each computed to the end, then abandoned with 'back'), then the solver's path, then
    '</think>' and the answer. None if the problem has no solution."""
    rng = rng or random.Random(0)
    solutions = list(itertools.islice(_search([(Fraction(n), str(n)) for n in numbers], Fraction(target), True, []), 64))
    if not solutions:
        return None
    expr, path = rng.choice(solutions)
    lines = []
    for _ in range(rng.randint(0, max_dead_ends)):
        steps = _random_path(numbers, rng)
        if steps[-1][3] != target:
            lines.append(f"{_steps_text(steps)} Not {target}, back.")
    rest, steps = [Fraction(n) for n in numbers], []
    for a, b, op, v in path:  # replay the solver's path to list what is left after each step
        rest.remove(a)
        rest.remove(b)
        rest.append(v)
        steps.append((a, b, op, v, list(rest)))
    lines.append(f"{_steps_text(steps)} Found {target}.")
    return " " + "\n".join(lines) + f"\n</think>\n<answer>{expr[1:-1]}</answer>"


def flip_operator(expr, numbers, target, rng=None):
    """Paper 001's hard negative: the verified equation with one operator flipped so that its value
    changes (it still uses exactly the given numbers, so it scores 0.1). None if no flip changes it."""
    rng = rng or random.Random(0)
    spots = [i for i, c in enumerate(expr) if c in "+-*/" and not (c == "-" and _unary_at(expr, i))]
    for i in rng.sample(spots, len(spots)):
        for new in rng.sample([o for o in "+-*/" if o != expr[i]], 3):
            candidate = expr[:i] + new + expr[i + 1:]
            value = evaluate_expression(candidate, numbers)
            if value is not None and value != target:
                return candidate
    return None


def _unary_at(expr, i):
    before = expr[:i].rstrip()
    return not before or before[-1] in "+-*/("
