"""The instructor's grading command (course/instructor.md): a class's archives from
course/submit.py in, one grade each out, trusting nothing a student sends.

  python course/grade.py ARCHIVE... [--parts PART...] [--out grades]     # parts as handout.py's
  python course/grade.py --autograder autograder.zip --parts verifier sft rloo   # for Gradescope

Per archive, in a process of its own:
  1. Only the bodies of the graded functions of the given parts are taken from the student's files,
     into a clean copy of this repo (signatures, docstrings and every other line are ours). Nothing
     else in the archive runs or counts: not its tests, its grades.json, its summary.json.
  2. Each function meets tests/test_graded.py's visible check (its return contract first: every
     key, shape and dtype the scripts read) and the hidden cases of course/hidden_cases.py, held to
     what the reference functions here return on them, values and gradients; each under a time
     limit (--limit seconds): a hang costs that function, and the batch goes on.
  3. Each handed-out stage runs for 2 steps on the tiny model with the student's functions that
     passed; a crash is the failure of the graded function it happened in, or, outside one, of
     the one that returned last (what it returned is what the script could not use).
  4. Each stage's run is re-scored from its packed test samples with this repo's verifier: the
     test split's problems, 16 samples each, pass@1 against course/assignment.md's target. A
     summary.json that disagrees with its samples is flagged, not believed.
Writes OUT/grades.csv (a row per archive) and OUT/<submission>.txt (the feedback a student gets),
or, with --gradescope DIR, Gradescope's results.json. The student's code runs as the user running
this: grade an untrusted class in a container (course/instructor.md).
"""
import argparse
import concurrent.futures
import csv
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import traceback
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from course.handout import INSTRUCTOR, PARTS, function_node, graded  # noqa: E402
from course.submit import EXTRA, FILES, POINTS, TWIN_OF  # noqa: E402

# part -> (the pipeline stage whose test evaluation is graded, its points: course/assignment.md)
RUNS = {"sft": ("sft", 4), "rloo": ("rloo", 4), "grpo": ("grpo", 3), "ipo": ("ipo", 2), "opd": ("opd", 2)}
TEST_DATA, NUM_SAMPLES = "gen:nums=3,range=1-20,test=200,val=100", 16  # run_cpu.sh's evaluation
STAGE_LIMIT = 180  # seconds a stage's 2-step run may take (they take 7-20 s on 2 cores)
MARGIN = 0.10  # rloo and grpo: at least this much pass@1 over the student's own sft (course/assignment.md)
# the 2-step run of each part's stages: the tests' tiny settings, the shipped models
GEN = "gen:nums=3,range=1-9,test=20,val=8"
SMALL = ["--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "2", "--eval_samples", "2",
         "--eval_max_new_tokens", "8", "--overwrite"]
RL = SMALL + ["--max_steps", "2", "--batch_size", "2", "--group_size", "3", "--micro_batch", "3", "--max_response_len", "12",
              "--lr", "1e-3", "--term_grads"]
BASE, TEACHER = "pretrained/tiny-base", "pretrained/tiny-teacher"
STAGE_ARGS = {
    "sft": ["--init", BASE, *SMALL, "--max_steps", "2", "--batch_size", "4", "--micro_batch", "4", "--no-compile"],
    "ipo": ["--init", BASE, *SMALL, "--pairs", "solver", "--num_prompts", "4", "--batch_size", "2",
            "--micro_batch", "2"],  # one epoch of the solver's pairs (an untrained model has no right samples): 2 steps
    "rloo": ["--init", BASE, *RL, "--reward", "dense"],  # dense_score calls score: the verifier's both
    "grpo": ["--init", BASE, *RL, "--beta", "0.04"],
    "opd": ["--init", BASE, "--teacher", TEACHER, *RL],
    "rlt": ["--init", TEACHER, "--student", BASE, *RL, "--max_response_len", "24"],
}
# a stage key is its script's name, or SCRIPT:NAME for another run of that script with flags of its own: the
# optional part's grpo.py calls both of its functions (CISPO's surrogate of GSPO's ratio) on each of 2 passes a batch
FAMILY = ["--ratio_level", "sequence", "--loss_type", "cispo", "--num_iterations", "2"]
STAGE_ARGS["grpo:family"] = STAGE_ARGS["grpo"] + FAMILY
STAGES = {"verifier": ["rloo"], "sft": ["sft"], "ipo": ["ipo"], "rloo": ["rloo", "opd"], "grpo": ["grpo", "rlt"],
          "opd": ["opd"], "rlt": ["rlt"], "grpo_family": ["grpo:family"]}
# names a graded function has no need of: its body is shown to the instructor when it uses one
SUSPECT = {"os", "sys", "subprocess", "signal", "builtins", "importlib", "pytest", "test_graded", "hidden_cases",
           "__import__", "exec", "eval", "compile", "open", "globals", "setattr", "modules", "inspect"}
LESSON_MODULES = {"torch", "math", "re", "fractions", "itertools", "functools", "collections", "operator", "ast",
                  "verifier", "common"}


class Bad(Exception):
    """A submission that cannot be graded as sent: one line, and its points are 0."""


class Hang(BaseException):
    """A function over its time limit (BaseException: a student's `except Exception` keeps it)."""


# ---- 1. the student's bodies in a clean copy -------------------------------------------------------
def members(archive):
    """{name: text} of the archive's files this grader reads: the graded sources and the runs'
    summaries and samples. A path out of the archive, a link or a bad archive is Bad."""
    try:
        with tarfile.open(archive) as tar:
            out = {}
            for m in tar.getmembers():
                if m.name.startswith("/") or ".." in m.name.split("/") or m.issym() or m.islnk():
                    raise Bad(f"the archive holds {m.name!r}, a path outside it or a link")
                name = m.name.removeprefix("./")
                wanted = name in FILES or name.endswith(("/summary.json", "/samples.jsonl"))
                if wanted and m.isfile() and m.size > 50 * 2 ** 20:
                    raise Bad(f"the archive's {m.name} is {m.size >> 20} MB: more than any submission's")
                if wanted and m.isfile():
                    out[name] = tar.extractfile(m).read().decode("utf-8", "replace")
            return out
    except (tarfile.TarError, OSError, EOFError) as e:
        raise Bad(f"not a readable .tar.gz ({type(e).__name__}: {e}): make it with course/submit.py") from None


def splice(ours, theirs, name):
    """`ours` (a module's source) with function `name`'s body replaced by its body in `theirs`, our
    signature and docstring kept. -> (source, the student's body)."""
    import ast
    import textwrap
    try:
        node = function_node(theirs, name)
    except SyntaxError as e:
        raise Bad(f"its file does not parse (line {e.lineno}: {e.msg})") from None
    if node is None:
        raise Bad("no top-level function of that name in the student's file")
    body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
    student = "".join(ast.unparse(stmt) + "\n" for stmt in body)  # the code, at any indent, comments dropped
    mine = function_node(ours, name)
    keep = mine.body[1:] if ast.get_docstring(mine) is not None else mine.body
    our_lines = ours.splitlines(keepends=True)
    indent = " " * keep[0].col_offset
    spliced = textwrap.indent(student, indent, lambda line: True)
    return "".join(our_lines[:keep[0].lineno - 1] + [spliced] + our_lines[mine.end_lineno:]), student


def suspect(body):
    """The SUSPECT names a body uses, and the modules it imports beyond a lesson's: flagged, not failed."""
    import ast
    nodes = list(ast.walk(ast.parse(body)))
    names = {n.id for n in nodes if isinstance(n, ast.Name)} | {n.attr for n in nodes if isinstance(n, ast.Attribute)}
    imported = {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom) and n.module}
    return sorted(names & SUSPECT) + [f"import {m}" for m in sorted(imported - LESSON_MODULES)]


def repo_files():
    """This repo's files, as git sees them (no venv, no out/): the instructor's, references included."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if os.path.isfile(os.path.join(ROOT, f))]


def clean_copy(dest):
    for f in repo_files():
        os.makedirs(os.path.join(dest, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))


def build(files, functions, dest):
    """The clean copy with the student's bodies of `functions` in it. -> ({q: why it could not be
    taken}, {q: the suspect names its body uses})."""
    clean_copy(dest)
    missing, flags = {}, {}
    for q in functions:
        module, _, name = q.rpartition(".")
        path = f"{module}.py"
        if path not in files:
            missing[q] = f"{path} is not in the archive"
            continue
        with open(os.path.join(dest, path)) as f:
            ours = f.read()
        try:
            source, body = splice(ours, files[path], name)
            compile(source, path, "exec")
        except Bad as e:
            missing[q] = f"{path}: {e}"
            continue
        except SyntaxError as e:
            missing[q] = f"{path}: its body does not compile here (line {e.lineno}: {e.msg})"
            continue
        with open(os.path.join(dest, path), "w") as f:
            f.write(source)
        if suspect(body):
            flags[q] = suspect(body)
    return missing, flags


# ---- 2. visible and hidden cases, each under a time limit (in the copy's own process) -------------
def expected(functions, seed, path):
    """The hidden cases of `functions` and the reference's results on them (this repo's own
    functions), saved to path for the workers: [(what, args, kwargs, result, gradients)]."""
    import importlib

    import torch
    from course.hidden_cases import cases
    out = {}
    for q in functions:
        module, _, name = q.rpartition(".")
        ref = getattr(importlib.import_module(module), name)
        out[q] = []
        for what, args, kwargs in cases(q, seed):
            result = ref(*fresh(args), **fresh(kwargs))
            out[q].append((what, args, kwargs, detached(result), gradients(ref, args, kwargs)))
    torch.save(out, path)


def fresh(x):
    """A copy of the inputs whose tensors are new leaves (requires_grad as they were)."""
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    if isinstance(x, dict):
        return {k: fresh(v) for k, v in x.items()}
    return [fresh(v) for v in x] if isinstance(x, (list, tuple)) else x


def detached(x):
    """The result with its tensors detached, each marked with whether it carried a gradient."""
    import torch
    if isinstance(x, torch.Tensor):
        return ("tensor", x.detach().clone(), x.requires_grad)
    if isinstance(x, dict):
        return {k: detached(v) for k, v in x.items()}
    return tuple(detached(v) for v in x) if isinstance(x, tuple) else x


def gradients(fn, args, kwargs):
    """d(sum of fn's first tensor result) / d(each input that requires grad), or None where the
    result carries no gradient."""
    import torch
    args, kwargs = fresh(args), fresh(kwargs)
    leaves = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor) and a.requires_grad]
    out = fn(*args, **kwargs)
    first = out[0] if isinstance(out, tuple) else out
    if not leaves or not isinstance(first, torch.Tensor) or not first.requires_grad:
        return None
    grads = torch.autograd.grad(first.sum(), leaves, allow_unused=True)
    return [torch.zeros_like(a) if g is None else g for a, g in zip(leaves, grads)]


def differs(got, want, path):
    """The first way `got` is not the reference's `want` (detached's form), as text; None if none."""
    import torch
    if isinstance(want, tuple) and want and want[0] == "tensor":
        _, value, grad = want
        if not isinstance(got, torch.Tensor):
            return f"{path} is {type(got).__name__}, not a tensor"
        if got.shape != value.shape or got.dtype != value.dtype:
            return f"{path} is {got.dtype} {tuple(got.shape)}, not {value.dtype} {tuple(value.shape)}"
        if grad != got.requires_grad:
            return f"{path} {'is detached' if grad else 'is still attached to the graph'}, unlike the reference's"
        if not (torch.allclose(got.detach(), value, rtol=1e-4, atol=1e-5, equal_nan=True) if value.is_floating_point()
                else torch.equal(got, value)):  # a mask (cispo_surrogate's `capped`): every entry
            return f"{path} should be {short(value)}, got {short(got)}"
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"{path} is {type(got).__name__}, not a dict"
        return next((d for k in want for d in [f"{path} has no key {k!r}" if k not in got
                                               else differs(got[k], want[k], f"{path}[{k!r}]")] if d), None)
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return f"{path} is not {len(want)} values"
        return next((d for i, (g, w) in enumerate(zip(got, want)) for d in [differs(g, w, f"{path}[{i}]")] if d), None)
    if isinstance(want, (int, float)) and not isinstance(got, bool) and isinstance(got, (int, float)):
        return None if abs(got - want) < 1e-9 else f"{path} should be {want!r}, got {got!r}"
    return None if got == want else f"{path} should be {want!r}, got {got!r}"


def short(t):
    text = str([round(v, 4) for v in t.detach().double().flatten().tolist()])
    return text if len(text) < 90 else text[:87] + "...]"


def worker(functions, cases_path, limit, out_path):
    """In the copy: each function's visible check and hidden cases, one JSON line each to out_path."""
    import importlib

    import pytest
    import torch
    import test_graded

    def alarm(*_):
        raise Hang()
    signal.signal(signal.SIGALRM, alarm)
    cases = torch.load(cases_path, weights_only=False)
    entries = {f"{e.module}.{e.function}": e for e in test_graded.GRADED}
    codes = {}  # (file, name) of each graded function here: whose loop a hang is in
    for q in functions:
        module, _, name = q.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), name)
            codes[(fn.__code__.co_filename, name)] = name
        except BaseException:  # noqa: BLE001  reported below, function by function
            pass
    for q in functions:
        module, _, name = q.rpartition(".")
        verdict = {"function": q}
        for kind in ("visible", "hidden"):
            signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                fn = getattr(importlib.import_module(module), name)
                if kind == "visible":
                    test_graded.grade(entries[q], fn)
                    verdict[kind] = "passed"
                else:
                    verdict[kind] = hidden(name, fn, cases[q])
            except Hang as e:
                inner = deepest(e.__traceback__, codes)
                verdict[kind] = f"{name}: " + (f"calls {inner}, which runs past the {limit:g} s limit" if inner and
                                               inner != name else f"over its {limit:g} s limit on the {kind} "
                                               "cases (a loop that never ends?)")
            except pytest.fail.Exception as e:
                verdict[kind] = str(e)
            except BaseException as e:  # noqa: BLE001  the import of the student's module, SystemExit
                verdict[kind] = f"{name}: raises {type(e).__name__}: {str(e)[:200]}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if verdict[kind] != "passed":
                break  # a function failing its visible check is not shown the hidden ones
        with open(out_path, "a") as f:
            f.write(json.dumps(verdict) + "\n")


def deepest(tb, codes):
    """The innermost graded function (codes: (file, name) -> name) in a traceback, or None."""
    return next((codes[(f.filename, f.name)] for f in reversed(traceback.extract_tb(tb))
                 if (f.filename, f.name) in codes), None)


def hidden(name, fn, cases):
    """'passed', or the first hidden case fn gets wrong, in one line."""
    import torch
    for i, (what, args, kwargs, want, grads) in enumerate(cases, 1):
        try:
            got = fn(*fresh(args), **fresh(kwargs))
            why = differs(got, want, "its result")
            if why is None and grads is not None:
                mine = gradients(fn, args, kwargs) or [torch.zeros_like(g) for g in grads]
                why = next((f"its gradient to input {j + 1} should be {short(w)}, got {short(g)}"
                            for j, (g, w) in enumerate(zip(mine, grads))
                            if not torch.allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True)), None)
        except Exception as e:  # noqa: BLE001
            why = f"raises {type(e).__name__}: {str(e)[:150]}"
        if why:
            return f"{name}: hidden case {i} ({what}): {why}"
    return "passed"


# ---- 3. each handed-out stage for 2 steps with the student's functions ----------------------------
def script_of(key):
    """A stage key's script: the key, or its part before the colon ("grpo:family" runs grpo.py)."""
    return key.partition(":")[0]


def run_name(key):
    """A stage as its feedback names it: `grpo.py`, or with the flags a keyed stage adds to its script's."""
    script = script_of(key)
    return " ".join([f"{script}.py", *STAGE_ARGS[key][len(STAGE_ARGS[script]):]]) if key != script else f"{key}.py"


def stage(key, blame, argv, limit, out_path):
    """In the copy: the stage key's script's main(argv), every name bound to a function of `blame` wrapped
    so that a crash names the graded function it happened in, or else the one that returned last."""
    import importlib
    module = importlib.import_module(script_of(key))
    originals = {}
    for q in blame:
        mod, _, name = q.rpartition(".")
        originals[q] = getattr(importlib.import_module(mod), name)
    last = [None]

    def wrap(q, f):
        @functools.wraps(f)
        def wrapped(*args, **kwargs):
            out = f(*args, **kwargs)
            last[0] = q
            return out
        return wrapped
    by_id = {id(f): wrap(q, f) for q, f in originals.items()}
    for mod in list(sys.modules.values()):  # `from rloo import ...` bound copies too
        if (getattr(mod, "__file__", None) or "").startswith(ROOT):
            for k, v in list(vars(mod).items()):
                if id(v) in by_id:
                    setattr(mod, k, by_id[id(v)])
    frames = {(f.__code__.co_filename, f.__code__.co_name): q for q, f in originals.items()}

    def alarm(*_):
        raise Hang()
    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    result = {"script": key, "ok": True}
    try:
        module.main(argv)
    except BaseException as e:  # noqa: BLE001  whatever stopped it, SystemExit and Hang included
        inside = deepest(e.__traceback__, frames)
        where = next((f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}" for f in reversed(
            traceback.extract_tb(e.__traceback__)) if f.filename.startswith(ROOT)), "?")
        what = f"over {limit:g} s" if isinstance(e, Hang) else f"{type(e).__name__}: {str(e)[:200]}"
        blamed = inside or last[0]
        how = "in it" if inside else "after it returned" if blamed else "before any graded function returned"
        result = {"script": key, "ok": False, "blame": blamed,
                  "line": f"{run_name(key)} stopped {how} in 2 steps: {what} ({where})"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    with open(out_path, "a") as f:
        f.write(json.dumps(result) + "\n")


# ---- 4. the runs, re-scored from their samples ------------------------------------------------------
def targets():
    """course/assignment.md's targets, from every run in docs/fresh_runs.json: each stage's test
    pass@1 range over the runs widened by 0.03 (about one run's 95 % interval at 200 x 16) and
    rounded outward to 0.01. -> {stage: (low, high)}"""
    import math

    from plumbing.report import fresh_runs
    runs = fresh_runs()
    out = {}
    for stage in ("sft", "rloo", "grpo", "ipo", "opd"):
        values = [r["pass@1"][stage] for r in runs if stage in r["pass@1"]]
        out[stage] = (math.floor((min(values) - 0.03) * 100) / 100, math.ceil((max(values) + 0.03) * 100) / 100)
    return out


def rescore(files, stage, tasks):
    """The stage's test evaluation re-scored from its samples: (pass@1 or None, [one line each for
    what is wrong or flagged])."""
    import verifier
    found = {k: v for k, v in files.items() if k.endswith(f"eval/{stage}/samples.jsonl")}
    if not found:
        return None, [f"{stage}: no eval/{stage}/samples.jsonl in the archive (submit.py packs it from out/)"]
    name, text = sorted(found.items())[0]
    try:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        problems = [(list(r["nums"]), r["target"]) for r in rows]
        completions = [list(r["completions"]) for r in rows]
    except (ValueError, KeyError, TypeError) as e:
        return None, [f"{stage}: {name} is not evaluate.py's samples.jsonl ({type(e).__name__}: {e})"]
    want = [(t["nums"], t["target"]) for t in tasks]
    if problems != want:
        return None, [f"{stage}: the samples are not the test split's {len(want)} problems ({TEST_DATA}), "
                      f"in order: {sum(p != w for p, w in zip(problems, want)) + abs(len(problems) - len(want))} differ"]
    if any(len(c) != NUM_SAMPLES for c in completions):
        return None, [f"{stage}: every problem needs {NUM_SAMPLES} samples; one has "
                      f"{min(map(len, completions))}"]
    right = [sum(verifier.score(c, n, t) == 1.0 for c in cs) for (n, t), cs in zip(problems, completions)]
    pass1 = sum(right) / (len(right) * NUM_SAMPLES)
    notes = []
    summary = files.get(name.replace("samples.jsonl", "summary.json"))
    try:
        said = json.loads(summary)["pass_at_k"]["1"] if summary else None
    except (ValueError, KeyError, TypeError):
        said = "unreadable"
    if said is None or said == "unreadable" or abs(float(said) - pass1) > 5e-4:
        notes.append(f"{stage}: FLAGGED: its summary.json says pass@1 {said}, its samples give {pass1:.3f}: "
                     f"the samples' number is the one graded")
    return pass1, notes


def grade_runs(files, parts):
    """Run points of the given parts. -> (points, possible, {stage: pass@1}, [feedback lines])"""
    from plumbing.tasks import load_tasks
    tasks = load_tasks(TEST_DATA, "test")
    goal, points, possible, measured, lines = targets(), 0, 0, {}, []
    stages = [RUNS[p][0] for p in parts if p in RUNS]
    for stage in ["sft"] * bool(stages) + [s for s in stages if s != "sft"]:  # sft: the others' baseline
        measured[stage], notes = rescore(files, stage, tasks)
        lines += notes
    for part in parts:
        if part not in RUNS:
            continue
        stage, pts = RUNS[part]
        possible += pts
        p1, (low, high) = measured.get(stage), goal[stage]
        if p1 is None:
            lines.append(f"run {stage}: 0 of {pts}: no graded samples")
            continue
        ok, why = low <= p1 <= high, f"pass@1 {p1:.3f}, target {low:.2f}-{high:.2f}"
        sft = measured.get("sft")
        if stage in ("rloo", "grpo"):
            ok = ok and sft is not None and p1 - sft >= MARGIN
            why += f", {p1 - sft:+.3f} over your sft (at least +{MARGIN:.2f})" if sft is not None else ", no sft to compare"
        if stage == "ipo":
            ok = ok and sft is not None and p1 > sft
            why += f", {p1 - sft:+.3f} over your sft (above it)" if sft is not None else ", no sft to compare"
        points += pts if ok else 0
        lines.append(f"run {stage}: {pts if ok else 0} of {pts}: {why}")
    return points, possible, measured, lines


# ---- one submission, then the class -----------------------------------------------------------------
def grade_one(archive, parts, cases_path, limit):
    """One archive's grade: {"submission", "functions": {q: {"ok", "line", "visible"}}, "code_points",
    "code_possible", "extra_points", "extra_possible" (the optional part's, over the 100), "run_points",
    "run_possible", "runs": {stage: pass@1}, "lines", "flags"}."""
    name = os.path.basename(archive)
    name = name[:-7] if name.endswith(".tar.gz") else os.path.splitext(name)[0]
    functions = graded(parts)
    result = {"submission": name, "functions": {}, "flags": [], "lines": [], "code_points": 0,
              "code_possible": sum(POINTS[q] for q in functions if q in POINTS and q not in EXTRA), "extra_points": 0,
              "extra_possible": sum(POINTS[q] for q in functions if q in EXTRA), "run_points": 0,
              "run_possible": sum(RUNS[p][1] for p in parts if p in RUNS), "runs": {}}
    try:
        files = members(archive)
    except Bad as e:
        result["lines"].append(f"{name}: {e}")
        result["functions"] = {q: {"ok": False, "line": str(e), "visible": str(e)} for q in functions}
        return result
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "repo")
        missing, flags = build(files, functions, copy)
        result["flags"] = [f"{q} uses {', '.join(v)}: read its body" for q, v in flags.items()]
        verdicts = {q: {"visible": f"{q.rpartition('.')[2]}: {why}"} for q, why in missing.items()}
        todo = [q for q in functions if q not in missing]
        log = os.path.join(tmp, "verdicts.jsonl")
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COUNTDOWN_CPU_BF16="0")
        if todo:
            run_here(copy, ["--worker", ",".join(todo), "--cases", cases_path, "--limit", str(limit),
                            "--result", log], env, limit * 2 * len(todo) + 60)
        done = {v["function"]: v for v in read_lines(log)}
        for q in todo:
            verdicts[q] = done.get(q, {"visible": f"{q.rpartition('.')[2]}: grading stopped before it (the "
                                                  f"process was killed at the submission's limit)"})
        failed = {q: v.get("visible") if v.get("visible") != "passed" else v.get("hidden", "not graded")
                  for q, v in verdicts.items() if v.get("visible") != "passed" or v.get("hidden") != "passed"}
        # the stages, in a copy with the student's bodies of the functions that passed so far (the
        # reference's where one failed: each passing function is still run by its stage)
        passing = [q for q in functions if q not in failed]
        staged = os.path.join(tmp, "staged")
        build(files, passing, staged)
        for key in dict.fromkeys(s for p in parts for s in STAGES[p]):  # each stage once
            mine = [q for p in parts if key in STAGES[p] for q in graded([p]) if q in passing]
            if not mine:
                continue
            tag = key.replace(":", "-")  # grpo:family: stage-grpo-family.jsonl, run-grpo-family/
            slog, out_dir = os.path.join(tmp, f"stage-{tag}.jsonl"), os.path.join(tmp, f"run-{tag}")
            run_here(staged, ["--stage", key, "--blame", ",".join(passing), "--limit", str(STAGE_LIMIT),
                              "--result", slog, "--argv", json.dumps(STAGE_ARGS[key] + ["--output_dir", out_dir])],
                     env, STAGE_LIMIT + 60)
            outcome = (read_lines(slog) or [{"ok": False, "blame": None,
                                             "line": f"{run_name(key)} was killed at its time limit"}])[0]
            if not outcome["ok"] and outcome["blame"]:
                failed.setdefault(outcome["blame"], f"{outcome['blame'].rpartition('.')[2]}: {outcome['line']}")
            elif not outcome["ok"]:  # before any of the student's functions returned: ours to fix, not theirs
                result["lines"].append(f"{name}: GRADER ERROR, no points lost: {outcome['line']}")
        for q in functions:
            result["functions"][q] = {"ok": q not in failed, "line": failed.get(q, "passed"),
                                      "visible": verdicts[q].get("visible")}
        earned = {q: pts for q, pts in POINTS.items() if q in functions and all(
            result["functions"][x]["ok"] for x in [q, *[t for t, o in TWIN_OF.items() if o == q]] if x in functions)}
        result["code_points"] = sum(pts for q, pts in earned.items() if q not in EXTRA)
        result["extra_points"] = sum(pts for q, pts in earned.items() if q in EXTRA)
    result["run_points"], _, result["runs"], run_lines = grade_runs(files, parts)
    result["lines"] += run_lines
    return result


def run_here(copy, args, env, timeout):
    """This file's worker or stage runner in the copy, killed (with its children) at `timeout`, or with
    this process however it ends (a session of its own, so it needs die_with: Ctrl-C reaches only ours)."""
    proc = subprocess.Popen([sys.executable, os.path.join(copy, "course", "grade.py"), *args, "--parent",
                             str(os.getpid())], cwd=copy, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # what it wrote before stands; the rest is reported as not graded
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def die_with(parent):
    """End this process within a second of the grader `parent` (a pid) ending, however it ends: a
    thread watches it (a parent-death signal would name the process that forked this one, which under
    the suite's warm interpreter is not the grader)."""
    import threading
    import time

    def gone():
        try:
            os.kill(parent, 0)
            with open(f"/proc/{parent}/stat") as f:  # dead but not yet reaped: Z
                return f.read().rpartition(") ")[2][:1] in ("Z", "X")
        except ProcessLookupError:
            return True
        except OSError:  # no /proc (macOS): alive
            return False

    def watch():
        while not gone():
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def read_lines(path):
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except (OSError, ValueError):
        return []


def feedback(r):
    """The text a student gets: each function's verdict, the points, each run against its target."""
    extra = f", extra {r['extra_points']} of {r['extra_possible']} (the optional part)" if r.get("extra_possible") \
        else ""
    lines = [f"{r['submission']}: code {r['code_points']} of {r['code_possible']}{extra}, "
             f"runs {r['run_points']} of {r['run_possible']}; written answers: graded by the instructor"]
    for q, v in r["functions"].items():
        lines.append(f"{'ok  ' if v['ok'] else 'FAIL'} {q}" + ("" if v["ok"] else f": {v['line']}"))
    return "\n".join(lines + r["lines"]) + "\n"


def write_csv(results, functions, path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", "code_points", "code_possible", "run_points", "run_possible", "extra_points",
                    "extra_possible", "written_points", "flags", *functions,
                    *[f"pass@1 {s}" for s in ("sft", "rloo", "grpo", "ipo", "opd")]])
        for r in results:
            w.writerow([r["submission"], r["code_points"], r["code_possible"], r["run_points"], r["run_possible"],
                        r["extra_points"], r["extra_possible"], "", "; ".join(r["flags"]),
                        *["pass" if r["functions"][q]["ok"] else "fail" for q in functions],
                        *["" if r["runs"].get(s) is None else f"{r['runs'][s]:.3f}"
                          for s in ("sft", "rloo", "grpo", "ipo", "opd")]])


def gradescope(r):
    """Gradescope's results.json: per function its points (all or nothing, published with the
    grades: they include the hidden cases) and its visible verdict at once (0 points); each run. The
    optional part's points are extra credit: a max_score of 0, so they add over the assignment's total."""
    tests = []
    for q, v in r["functions"].items():
        tests.append({"name": f"{q}: the visible check", "score": 0, "max_score": 0, "output": v["visible"],
                      "visibility": "visible"})
        if q in POINTS:
            twins = [t for t, o in TWIN_OF.items() if o == q and t in r["functions"]]
            earned = all(r["functions"][x]["ok"] for x in [q, *twins])
            tests.append({"name": q + (f" (with {', '.join(twins)})" if twins else "")
                          + (" (extra credit: the optional part)" if q in EXTRA else ""), "score": POINTS[q] if earned
                          else 0, "max_score": 0 if q in EXTRA else POINTS[q], "visibility": "after_published",
                          "output": "passed: visible and hidden cases, the 2-step run" if earned else
                          "; ".join(r["functions"][x]["line"] for x in [q, *twins] if not r["functions"][x]["ok"])})
    for line in r["lines"]:
        m = re.match(r"run (\w+): (\d+) of (\d+): (.*)", line)
        tests.append({"name": f"run {m.group(1)}", "score": int(m.group(2)), "max_score": int(m.group(3)),
                      "output": m.group(4), "visibility": "after_published"} if m else
                     {"name": "runs", "score": 0, "max_score": 0, "output": line, "visibility": "visible"})
    return {"tests": tests, "output": "Written answers are graded by the instructor; points for code and runs "
                                      "show when grades are published."}


def autograder(path, parts):
    """Gradescope's autograder zip: setup.sh and run_autograder at its root, this repo (the key
    included: Gradescope keeps it from students) in countdown/, the parts in parts.txt."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in ("setup.sh", "run_autograder"):
            z.write(os.path.join(ROOT, "course", "gradescope", f), f)
        z.writestr("parts.txt", " ".join(parts) + "\n")
        for f in repo_files():
            z.write(os.path.join(ROOT, f), f"countdown/{f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archives", nargs="*", help="submission archives (submit.py's .tar.gz)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), help=f"the parts handed out: {' '.join(PARTS)}")
    p.add_argument("--out", default="grades", help="where grades.csv and the feedback go")
    p.add_argument("--limit", type=float, default=20.0, help="seconds a function's cases may take")
    p.add_argument("--jobs", type=int, default=1, help="submissions graded at once (a core or two each)")
    p.add_argument("--seed", type=int, default=20261129, help="the hidden cases' draw (keep it from the class)")
    p.add_argument("--gradescope", help="grade Gradescope's submission dir; write OUT/results.json")
    p.add_argument("--autograder", help="write Gradescope's autograder zip here and stop")
    for flag in ("--worker", "--stage", "--blame", "--cases", "--result", "--argv", "--parent"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.parent:
        die_with(int(a.parent))
    if a.worker:
        return worker(a.worker.split(","), a.cases, a.limit, a.result)
    if a.stage:
        return stage(a.stage, [q for q in a.blame.split(",") if q], json.loads(a.argv), a.limit, a.result)
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        sys.exit(f"error: no part {bad[0]!r}: the parts are {' '.join(PARTS)}")
    if a.autograder:
        autograder(a.autograder, a.parts)
        return print(f"wrote {a.autograder}: upload it as the assignment's autograder (course/instructor.md)")
    missing = [f for f in INSTRUCTOR if not os.path.isfile(os.path.join(ROOT, f))]
    if missing:
        sys.exit(f"error: this is a handout (no {', '.join(missing)}): grade from the instructor's repo")
    archives = a.archives
    if a.gradescope:
        archives = [pack_dir(a.gradescope)]
    if not archives:
        sys.exit("error: name the archives to grade (python course/grade.py submissions/*.tar.gz)")
    os.makedirs(a.out, exist_ok=True)
    cases_path = os.path.join(a.out, ".hidden_cases.pt")
    expected(graded(a.parts), a.seed, cases_path)
    results = []
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:  # each grades in processes of its own
        graded_ones = pool.map(lambda x: grade_one(x, a.parts, cases_path, a.limit), archives)
        for r in graded_ones:
            results.append(r)
            with open(os.path.join(a.out, f"{r['submission']}.txt"), "w") as f:
                f.write(feedback(r))
            print(f"{r['submission']}: code {r['code_points']}/{r['code_possible']}, runs {r['run_points']}/"
                  f"{r['run_possible']}" + (f", extra {r['extra_points']}/{r['extra_possible']}" if r["extra_possible"]
                                            else "")
                  + "".join(f"; {x}" for x in r["lines"] if x.startswith(r["submission"]))
                  + (f"; flagged: {'; '.join(r['flags'])}" if r["flags"] else ""), flush=True)
    os.remove(cases_path)
    if a.gradescope:
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(gradescope(results[0]), f, indent=1)
        return print(f"wrote {os.path.join(a.out, 'results.json')}")
    write_csv(results, graded(a.parts), os.path.join(a.out, "grades.csv"))
    print(f"wrote {os.path.join(a.out, 'grades.csv')} and a feedback .txt per submission")


def pack_dir(submission):
    """Gradescope's submission dir as one archive: the .tar.gz the student uploaded, or the files."""
    tars = [os.path.join(submission, f) for f in sorted(os.listdir(submission)) if f.endswith(".tar.gz")]
    if tars:
        return tars[0]
    path = os.path.join(tempfile.mkdtemp(), "submission.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for dirpath, _, names in os.walk(submission):
            for n in names:
                full = os.path.join(dirpath, n)
                if not os.path.islink(full):
                    tar.add(full, arcname=os.path.relpath(full, submission))
    return path


if __name__ == "__main__":
    main()
