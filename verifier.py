"""The Countdown task, standard library only: the prompt a policy reads, answer extraction, exact
scoring (paper 000 §3.1; dense: paper 001), solver and generator (the solver-written traces live in plumbing/traces.py).
Nothing here calls eval: one regex tokenizes, an explicit-stack shunting-yard parses (so 2,000
nested parentheses cannot hit Python's recursion limit) and fractions.Fraction computes exactly."""
import functools
import itertools
import operator
import random
import re
from collections import Counter
from fractions import Fraction

_TOKEN = re.compile(r"\d+|\S", re.ASCII)  # a literal, or any single non-space character
_LITERAL = re.compile(r"\d+", re.ASCII)
# longer answers score 0.1 unparsed: no Countdown answer needs more (see score)
MAX_ANSWER_CHARS = 4096
_ALLOWED = re.compile(r"[\d\s+\-*/()]*", re.ASCII)  # ASCII: '３' or '٣' are not the number 3
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "neg": 3}
# Fraction / 0 raises
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


# ---- the task as a policy reads it -------------------------------------------------------------
# TinyZero's base-model prompt, used by papers 000/002: the policy thinks in <think>, answers in
# <answer>. `compact` keeps the question and the assistant's prefix, not the preamble: with the
# embedded tokenizer it halves the prompt.
TEMPLATES = {
    "base": "A conversation between User and Assistant. The user asks a question, and the "
            "Assistant solves it. The assistant first thinks about the reasoning process in the "
            "mind and then provides the user with the answer.\nUser: Using the numbers {nums}, "
            "create an equation that equals {target}. You can use basic arithmetic operations "
            "(+, -, *, /) and each number can only be used once. Show your work in <think> "
            "</think> tags. And return the final answer in <answer> </answer> tags, for example "
            "<answer> (1 + 2) / 3 </answer>.\nAssistant: Let me solve this step by step.\n<think>",
    "compact": "User: Using the numbers {nums}, create an equation that equals {target}.\n"
               "Assistant: Let me solve this step by step.\n<think>",
}


def make_prompt(nums, target, template="base"):
    return TEMPLATES[template].format(nums=list(nums), target=target)


def extract_answer(response):
    """Text of the *last* complete <answer>...</answer> block, or None."""
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end >= 0 else -1
    return None if start < 0 else response[start + len("<answer>"):end]


def evaluate_expression(expr, numbers):
    """Exact value of `expr` if it is a valid expression whose literals are exactly `numbers` (as a
    multiset), else None. Cheap checks first so hostile input never reaches the parser."""
    # names, '.', '%', '=', '^', ...
    if len(expr) > MAX_ANSWER_CHARS or not _ALLOWED.fullmatch(expr):
        return None
    # Count the literals before tokenizing: "1+1+...+1" stops at the (n+1)-th, whatever its length.
    literals = [m.group() for m in itertools.islice(_LITERAL.finditer(expr), len(numbers) + 1)]
    if len(literals) != len(numbers) or any(len(t) > 12 for t in literals):
        return None  # wrong count, or a literal no Countdown number could be (keeps int() cheap)
    if Counter(int(t) for t in literals) != Counter(int(n) for n in numbers):
        return None
    return _shunting_yard(_TOKEN.findall(expr))


def _apply(op, values):
    b = values.pop()
    values.append(-b if op == "neg" else _OPS[op](values.pop(), b))


def _shunting_yard(tokens):
    """Parse and evaluate in one pass. `expect_operand` is the grammar state: True after an operator
    or '(' (where a literal, '(' or unary minus may come), False after a literal or ')'."""
    values, ops, expect_operand = [], [], True
    try:
        for t in tokens:
            if t.isdigit() or t == "(":
                if not expect_operand:
                    return None  # "3 4", or "3(4)": no implicit multiplication
                if t == "(":
                    ops.append(t)
                else:
                    values.append(Fraction(int(t)))
                expect_operand = t == "("
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
                if ops and ops[-1] == "neg":
                    # "- -x" is x: two minuses waiting for one operand cancel, at no arithmetic cost
                    ops.pop()
                else:
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
    """Paper 000 §3.1 reward: 1.0 correct, 0.1 answer present but wrong/invalid, 0.0 no answer. One
    departure: an answer over MAX_ANSWER_CHARS scores 0.1 unparsed, so that any input scores in <
    10 ms (a megabyte of valid nesting would take seconds to parse in Python)."""
    expr = extract_answer(response)
    return 0.0 if expr is None else 1.0 if evaluate_expression(expr, numbers) == target else 0.1


def dense_score(response, numbers, target):
    """Paper 001's shaped reward: a valid expression over exactly `numbers` with value v != target
    earns 0.1 + 0.5 * max(0, 1 - |v - target| / max(1, |target|)); otherwise as score(), which it
    calls."""
    sparse = score(response, numbers, target)
    if sparse != 0.1:  # no answer, or the target
        return sparse
    value = evaluate_expression(extract_answer(response), numbers)
    if value is None:  # an answer, but not a valid expression over exactly `numbers`
        return 0.1
    return 0.1 + 0.5 * max(0.0, 1.0 - float(abs(value - target)) / max(1, abs(target)))


# ---- solver and generator ----------------------------------------------------------------------
def _moves(a, b, restricted):
    """(value, op, left, right) per way to merge two (value, expr) items; `restricted`: the
    generator's rule, non-negative integers only (a - b only if a >= b, exact /), computed on
    ints where the items hold ints (the traces' solver: 3x faster than Fractions), in one order."""
    x, y = a[0], b[0]
    if restricted:
        return ([(x + y, "+", a, b), (x * y, "*", a, b)] + ([(x - y, "-", a, b)] if x >= y else [])
                + ([(y - x, "-", b, a)] if y >= x else [])
                + ([(x // y, "/", a, b)] if y and x % y == 0 else [])
                + ([(y // x, "/", b, a)] if x and y % x == 0 else []))
    return [(x + y, "+", a, b), (x * y, "*", a, b), (x - y, "-", a, b), (y - x, "-", b, a)] + (
        [(x / y, "/", a, b)] if y else []) + ([(y / x, "/", b, a)] if x else [])


def _search(items, target, restricted, path=()):
    """Depth-first over pair merges; yields (expr, path of (left, op, right, result, values
    left))."""
    if len(items) == 1:
        if items[0][0] == target:
            yield items[0][1], path
        return
    for i, j in itertools.combinations(range(len(items)), 2):
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        for value, op, left, right in _moves(items[i], items[j], restricted):
            step = (left[0], op, right[0], value, [x[0] for x in rest] + [value])
            yield from _search(rest + [(value, f"({left[1]} {op} {right[1]})")], target, restricted,
                               path + (step,))


def solve(numbers, target, restricted=False):
    """An expression over exactly `numbers` equal to `target` (it scores 1.0), or None."""
    for expr, _ in _search([(Fraction(n), str(n)) for n in numbers], target, restricted):
        return expr[1:-1] if len(numbers) > 1 else expr  # drop the redundant outer parentheses
    return None


@functools.lru_cache(maxsize=200_000)
def _solvable(values, target):
    """Is `target` reachable from sorted `values` under the generator's rule? Integers, cached,
    early exit."""
    if len(values) == 1:
        return values[0] == target
    if len(values) == 2:  # the leaves, unrolled: most calls end here
        a, b = values
        return (target in (a + b, a * b, abs(a - b)) or (b > 0 and a == target * b)
                or (a > 0 and b == target * a))
    for i, j in itertools.combinations(range(len(values)), 2):
        a, b, rest = values[i], values[j], values[:i] + values[i + 1:j] + values[j + 1:]
        merged = [a + b, a * b, abs(a - b)]
        merged += ([a // b] if b and a % b == 0 else []) + ([b // a] if a and b % a == 0 else [])
        if any(_solvable(tuple(sorted(rest + (v,))), target) for v in merged):
            return True
    return False


def generate_splits(sizes, seed=0, num_numbers=(3, 4), num_range=(1, 99), target_range=(10, 100),
                    balanced=True):
    """Disjoint splits of distinct problems, e.g. sizes={"test": 500, "train": 10000}, as the
    Stream-of-Search generator: uniform numbers and target, kept if solvable. The count balanced
    (001's 3/4 mix; a uniform draw keeps mostly 4-number ones): each draw takes the count its split
    holds fewest of, a tie drawn uniformly (`balanced` False: always uniform, the tiny tokenizer's
    corpus). Splits fill in order (test first: it stays put when train grows); a small space runs
    dry after 5,000 rejections in a row, the rest short."""
    rng, seen, out, misses = random.Random(seed), set(), {name: [] for name in sizes}, 0
    for name, n in sizes.items():
        have = dict.fromkeys(num_numbers, 0)  # this split's problems of each count
        while len(out[name]) < n and misses < 5000:
            fewest = [c for c in num_numbers if have[c] == min(have.values()) or not balanced]
            nums = [rng.randint(*num_range) for _ in range(rng.choice(fewest))]
            key = (tuple(sorted(nums)), rng.randint(*target_range))
            if key in seen or not _solvable(*key):
                misses += 1
                continue
            misses = 0
            seen.add(key)
            have[len(nums)] += 1
            out[name].append({"nums": nums, "target": key[1]})
    return out
