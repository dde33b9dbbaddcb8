"""Solver-written search traces for SFT, in named strategies a sample's text shows, the base
stage's plain arithmetic, and paper 001's operator-flip negatives. Standard library only.

A trace is the text after the prompt's '<think>': tries, a step a line ('3+5=8, left 7 8.'), each
ending in a verdict ('7*8=56. Target 60, back.' / 'found.'), then '</think>' and the verified
answer. Strategies (`--strategies` in sft.py mixes them): `random`, tries at random until one hits
(what the model did before there were strategies), and `backward`, working back from the target
(see backward_chaining)."""
import functools
import itertools
import random
import re
from fractions import Fraction

from verifier import _OPS, _moves, _search, _solvable, evaluate_expression, extract_answer


def _steps_text(steps):
    """'3+5=8, left 7 8.\n7*8=56.': a step a line, no spaces around the operators. Written for the
    tokenizer the tiny model shares with Qwen2.5 (plumbing/models.py): its pre-tokenizer cuts a
    space from the digit after it, so '3 + 5 = 8' costs 7 tokens where '3+5=8' costs 5, and '.\n'
    is one token where '. ' and the digit's space are two. As written before (spaces, steps joined
    by '. '), a completion cost 1.26x the tokens; so, 1.04x (docs/studies/tokenizer.md)."""
    return "\n".join(f"{a}{op}{b}={v}"
                     + (f", left {' '.join(map(str, rest))}." if len(rest) > 1 else ".")
                     for a, op, b, v, rest in steps)


@functools.lru_cache(maxsize=50_000)
def _solutions(numbers, target):
    """Up to 16 solver paths; cached because SFT writes a new trace for every problem every
    epoch."""
    return list(
        itertools.islice(_search([(n, str(n)) for n in numbers], target, True), 16))  # ints


def random_path(numbers, rng):
    """A random legal path of pair merges down to one value: (expr, steps)."""
    items, steps = [(n, str(n)) for n in numbers], []  # ints: _moves' fast path
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        value, op, left, right = rng.choice(_moves(items[i], items[j], True))
        items = ([x for k, x in enumerate(items) if k not in (i, j)]
                 + [(value, f"({left[1]} {op} {right[1]})")])
        steps.append((left[0], op, right[0], value, [x[0] for x in items]))
    return items[0][1], steps


def arith_text(problems, rng):
    """Plain arithmetic for the base stage: one random path per problem (its numbers), a step a line,
    written exactly as the traces write their steps ('3+5=8, left 7 8.\n7*8=56.')."""
    return "\n".join(_steps_text(random_path(nums, rng)[1]) for nums in problems)


def closest_miss(numbers, target, rng, tries=8):
    """The closest miss of `tries` random legal paths, (expr, steps), or None if all hit (or one
    number)."""
    paths = (random_path(numbers, rng) for _ in range(tries))
    misses = [p for p in paths if p[1] and p[1][-1][3] != target]
    return min(misses, key=lambda p: abs(p[1][-1][3] - target)) if misses else None


def near_miss(numbers, target, rng, tries=8):
    """closest_miss's steps: the dead end that makes a trace's check exact, since a miss far off can
    be told by magnitude alone."""
    miss = closest_miss(numbers, target, rng, tries)
    return miss and miss[1]


def random_tries(numbers, target, rng, dead_ends=0.0, near_misses=0.0):
    """Strategy `random`, a Stream-of-Search-style trace: tries computed to the end, each a solver
    path with probability 1 / (1 + dead_ends), else a dead end (a near miss with probability
    `near_misses`, else a random path), until one's value is the target. No cap: the dead ends are
    geometric with mean <= dead_ends, so only the check tells when to stop. Each try writes the
    target by its value, then the verdict ('=70. Target 60, back.'). Without near misses a model
    learns "found" = "close" (docs/studies/arithmetic.md). A model cannot tell a solver path from a random
    one before it computes it, so what it learns is: try at random until one hits."""
    solutions = _solutions(tuple(numbers), target)
    lines = []
    while True:
        if rng.random() * (1 + dead_ends) < 1:
            expr, path = rng.choice(solutions)
        elif (near_misses and rng.random() < near_misses
              and (miss := near_miss(numbers, target, rng))):
            expr, path = None, miss  # a near miss never finds, so its expression is never written
        else:
            expr, path = random_path(numbers, rng)
        # the verdict follows the target, written by the value
        found = (path[-1][3] if path else numbers[0]) == target
        lines.append(f"{_steps_text(path)} Target {target}, {'found' if found else 'back'}.")
        if found:
            return lines, expr[1:-1] if path else expr


def _subgoals(target, c):
    """What the other two numbers must make for a last step with `c` to reach `target`: (rank,
    value, how it is computed, the closing step, the answer). Rank orders the subgoals of all c:
    the target's factorizations first (target / c, when exact), then target - c, target + c, and
    c - target when c is larger (rare here: targets start at 10)."""
    t, out = target, [(2, target + c, f"{target}+{c}", f"{{v}}-{c}", f"{{e}}-{c}")]
    if t % c == 0:
        out.append((0, t // c, f"{t}/{c}", f"{{v}}*{c}", f"{{e}}*{c}"))
    if t >= c:
        out.append((1, t - c, f"{t}-{c}", f"{{v}}+{c}", f"{{e}}+{c}"))
    else:
        out.append((3, c - t, f"{c}-{t}", f"{c}-{{v}}", f"{c}-{{e}}"))
    return out


def backward_chaining(numbers, target, rng):
    """Strategy `backward` (Gandhi et al., 2025, "Cognitive Behaviors that Enable Self-Improving
    Reasoners": working backwards from the goal; paper 000 §5's teacher works back from the
    target's factorizations). For 3 numbers, one line a subgoal: a last number c and a value the
    other two must make ('Need 60/5=12:'), then the pair's results (a + b, a * b, larger -
    smaller, larger / smaller when exact) until one is that value: the closing step and 'found',
    else 'back' and the next subgoal. Subgoals come factorizations first, then target - c, then
    target + c, each over c in the prompt's order (this order solves 79 % of problems within the
    pipeline's 160 tokens; c by c, 62 %). Each result is checked against the one number at the
    line's start, as a random try's value is against the target: a first version checked it
    against a list of needs, which the tiny model missed 7 times in 10 (docs/studies/strategies.md).
    Deterministic, so `rng` only serves the random tries that end a problem no subgoal solves (3 %
    here: its last step divides by c or by the pair's value). None if it has not 3 numbers."""
    if len(numbers) != 3:
        return None
    goals = []
    for k, c in enumerate(numbers):
        a, b = [n for i, n in enumerate(numbers) if i != k]
        hi, lo = max(a, b), min(a, b)
        pair = [(a + b, f"{a}+{b}"), (a * b, f"{a}*{b}"), (hi - lo, f"{hi}-{lo}")]
        pair += [(hi // lo, f"{hi}/{lo}")] if lo and hi % lo == 0 else []
        goals += [(rank, k, need, how, close, answer, pair)
                  for rank, need, how, close, answer in _subgoals(target, c)]
    lines = []
    for _, _, need, how, close, answer, pair in sorted(goals, key=lambda g: g[:2]):
        tried = []
        for v, text in pair:
            tried.append(f"{text}={v}")
            if v == need:  # the closing step on a line of its own, as a random try's steps
                lines.append(f"Need {how}={need}: {','.join(tried)}.\n"
                             f"{close.format(v=v)}={target}. Target {target}, found.")
                return lines, answer.format(e=f"({text})")
        # the results joined by ',' alone: ', ' costs a token more before a digit (_steps_text)
        lines.append(f"Need {how}={need}: {','.join(tried)}, back.")
    more, answer = random_tries(numbers, target, rng)
    return lines + more, answer


STRATEGIES = ("random", "backward")  # random_tries, backward_chaining


def parse_mix(text, names=STRATEGIES, rates=False):
    """'random:0.7,backward:0.3' -> {'random': 0.7, 'backward': 0.3}; ValueError, one line, else.
    With `rates` (the mistakes' 'slip:0.3,giveup:0.2'): probabilities summing to at most 1, and
    'none' is {}."""
    if rates and text.strip() in ("none", "0", ""):
        return {}
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition(":")
        try:
            mix[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"weight {weight!r} is not a number in {text!r}") from None
        if name.strip() not in names or mix[name.strip()] < 0:
            raise ValueError(f"unknown {'mistake' if rates else 'strategy'} or negative weight "
                             f"{part!r} in {text!r}: "
                             f"choose among {', '.join(names)}")
    if not rates and sum(mix.values()) <= 0:
        raise ValueError(f"weights {text!r} sum to 0")
    if rates and sum(mix.values()) > 1 + 1e-9:
        raise ValueError(f"rates {text!r} sum to {sum(mix.values()):g}, more than 1")
    return mix


def strategy_of(response):
    """The strategy a trace (or a model's sample) opens with, read from its text: 'backward' if its
    first line is a subgoal ('Need ...'), 'random' if it opens with a step 'a op b = v', else
    'other'."""
    first = response.lstrip()
    if first.startswith("Need "):
        return "backward"
    return "random" if re.match(r"\d+ ?[-+*/] ?\d+ ?= ?\d", first) else "other"


def strategy_stats(texts, scores):
    """{strategy: {"share": of the texts, "pass@1": of its texts that scored 1.0}} for every
    strategy (and 'other', if any text opens with neither); pass@1 is None where share is 0."""
    names = [strategy_of(t) for t in texts]
    out = {}
    for name in [*STRATEGIES, *(["other"] if "other" in names else [])]:
        mine = [float(s) == 1.0 for n, s in zip(names, scores) if n == name]
        out[name] = {"share": len(mine) / max(len(texts), 1),
                     "pass@1": sum(mine) / len(mine) if mine else None}
    return out


def strategy_metrics(prefix, stats):
    """strategy_stats as log metrics. PREFIX/strategy/NAME: each search strategy's share of the
    samples (a student watches RL select one); PREFIX/strategy_acc/NAME: how many of them solve."""
    out = {}
    for name, s in stats.items():
        out[f"{prefix}/strategy/{name}"] = s["share"]
        if s["pass@1"] is not None:
            out[f"{prefix}/strategy_acc/{name}"] = s["pass@1"]
    return out


# ---- mistakes: what an LLM's traces get wrong -----------------------------------------------------
# The real SFT set (Gandhi et al., 2025, "Cognitive Behaviors that Enable Self-Improving Reasoners":
# Countdown traces written by Claude 3.5 Sonnet) is ~37 % correct: its mean score under the 1.0 / 0.1
# scorer is 0.43, so every wrong trace still answers. The embedded analog: a solver trace whose last
# line (the one that finds) is replaced by one of these mistakes, each readable back from the text
# (mistake_of). The split among kinds is our guess at an LLM's; the total is the real set's.
MISTAKES = ("slip", "reuse", "giveup", "malformed")


def _slip(numbers, target, rng):
    """An arithmetic slip that 'hits': a near miss whose last step is written with the target's value
    and claimed found ('5 * 13 = 60. Target 60, found.'); it answers the miss."""
    miss = closest_miss(numbers, target, rng)
    if miss:
        expr, steps = miss
        a, op, b, _, rest = steps[-1]
        return f"{_steps_text(steps[:-1] + [(a, op, b, target, rest)])} Target {target}, found.", expr
    return None


def _giveup(numbers, target, rng):
    """Giving up: the closest try, its value written right, 'back', and then answered anyway."""
    miss = closest_miss(numbers, target, rng)
    return miss and (f"{_steps_text(miss[1])} Target {target}, back.", miss[0])


def _reuse(numbers, target, rng):
    """A number left out or used twice, in a path that does reach the target."""
    n = list(numbers)
    variants = [n[:i] + n[i + 1:] for i in range(len(n))]  # one left out
    variants += [n[:i] + [n[j]] + n[i + 1:] for i in range(len(n)) for j in range(len(n))
                 if n[j] != n[i]]  # n[j] twice, n[i] never
    variants += [n + [x] for x in n]  # one used twice, the others once
    for v in rng.sample(variants, len(variants)):
        # the generator's cached integer check first: most variants have no path, and proving it
        # by _solutions' full search was 3/4 of an SFT epoch's trace writing (the same rule)
        if _solvable(tuple(sorted(v)), target) and (solutions := _solutions(tuple(v), target)):
            expr, steps = rng.choice(solutions)
            return f"{_steps_text(steps)} Target {target}, found.", expr
    return None


def with_mistake(numbers, target, lines, answer, kind, rng):
    """(lines, answer) with the finding line replaced by mistake `kind`; `malformed` keeps the
    search and writes the answer as an equation ('(3 + 5) * 7 = 56'), which the scorer rejects. A
    kind the problem cannot have (every try hits; no variant reaches the target) becomes
    `malformed`."""
    made = kind != "malformed" and {"slip": _slip, "giveup": _giveup, "reuse": _reuse}[kind](
        numbers, target, rng)
    if not made:
        return lines, f"{answer} = {target}"
    line, expr = made
    return lines[:-1] + [line], expr[1:-1]  # a path's expression is parenthesized whole


def mistake_of(response, numbers, target):
    """The mistake a sample's text shows (the kinds with_mistake writes), None if it is right or has
    no complete answer: `malformed`, an answer that is no expression; `reuse`, an expression over
    other numbers than the prompt's; else (the value wrong) `slip` if the search's last verdict is
    'found', `giveup` if not."""
    answer = extract_answer(response)
    if answer is None:
        return None
    value = evaluate_expression(answer, numbers)
    if value == target:
        return None
    if value is None:
        own = [int(x) for x in re.findall(r"\d+", answer)][:8]
        return "reuse" if own and evaluate_expression(answer, own) is not None else "malformed"
    return "slip" if response.split("</think>")[0].rstrip().endswith("found.") else "giveup"


def mistake_shares(texts, tasks):
    """{kind: share of the samples showing it} (tasks: one {nums, target} a text): logged as
    train/mistake/KIND and eval/mistake/KIND, so a student watches RL remove what SFT imitated."""
    kinds = [mistake_of(x, t["nums"], t["target"]) for x, t in zip(texts, tasks)]
    return {k: kinds.count(k) / max(len(kinds), 1) for k in MISTAKES}


# a step as the traces write it, a op b = v ('3+5=8'; spaces allowed, as a model may write them)
_STEP = re.compile(r"(\d+) ?([-+*/]) ?(\d+) ?= ?(\d+)")
# a try's last written value, then its verdict
_CLAIM = re.compile(r"= ?(\d+)\. Target \d+, found\.")


def arithmetic(completions, targets):
    """Does a model fail by search, by arithmetic or by checking? The share of written steps `a op b
    = v` whose v is wrong (by operator too), and of `found` verdicts after a try whose last
    written value is not the target (a wrong step that happens to give it is the step's error,
    not the claim's)."""
    def wrong(a, op, b, v):
        return op == "/" and b == "0" or _OPS[op](Fraction(int(a)), int(b)) != int(v)
    steps = [m.groups() for c in completions for m in _STEP.finditer(c)]
    claims = [int(m.group(1)) != t
              for c, t in zip(completions, targets) for m in _CLAIM.finditer(c)]
    rate = lambda xs: sum(wrong(*x) for x in xs) / max(len(xs), 1)  # noqa: E731
    return {"steps": len(steps), "step_error": rate(steps), "claims": len(claims),
            "false_claims": sum(claims) / max(len(claims), 1),
            "step_error_by_op": {op: rate([s for s in steps if s[1] == op]) for op in "+-*/"}}


def make_trace(numbers, target, rng=None, dead_ends=0.0, near_misses=0.0, mix=None, mistakes=None):
    """A trace, the text after the prompt's '<think>', ending in a verified answer: the strategy
    drawn from `mix` ({name: weight}; None: random tries only, the same rng stream as before there
    were strategies). dead_ends and near_misses shape the random tries. With `mistakes` ({kind:
    rate}, rates summing to at most 1) the trace carries one of them with that probability, and
    its answer is then wrong (the unverified source). None if the problem has no solution."""
    rng = rng or random.Random(0)
    if not _solutions(tuple(numbers), target):
        return None
    name = "random"
    if mix and len(mix) > 1:
        name = rng.choices(list(mix), weights=list(mix.values()))[0]
    elif mix:
        name = next(iter(mix))
    out = backward_chaining(numbers, target, rng) if name == "backward" else None
    lines, answer = out or random_tries(numbers, target, rng, dead_ends, near_misses)
    if mistakes:  # drawn only when asked: the clean traces' rng stream stays as it was
        u, kind = rng.random(), None
        for k, rate in mistakes.items():
            u -= rate
            if u < 0:
                kind = k
                break
        if kind:
            lines, answer = with_mistake(numbers, target, lines, answer, kind, rng)
    # no space after '<think>' and none in the answer: each cost a token (_steps_text)
    answer = answer.replace(" ", "")
    return "\n".join(lines) + f"\n</think>\n<answer>{answer}</answer>"


def flip_operator(expr, numbers, target, rng=None):
    """Paper 001's hard negative: the verified equation with one operator flipped so that its value
    changes (it still uses exactly the given numbers, so it scores 0.1). None if no flip changes
    it."""
    rng = rng or random.Random(0)
    # binary operators, not unary minus
    spots = [m.start(1) for m in re.finditer(r"[\d)]\s*([-+*/])", expr)]
    for i in rng.sample(spots, len(spots)):
        for new in rng.sample([o for o in "+-*/" if o != expr[i]], 3):
            candidate = expr[:i] + new + expr[i + 1:]
            value = evaluate_expression(candidate, numbers)
            if value is not None and value != target:
                return candidate
    return None
