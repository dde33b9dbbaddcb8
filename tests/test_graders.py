"""The instructor's side of the graded exercises (docs/instructor.md), left out of a handout: the
graders of tests/test_graded.py graded themselves, and the handout checked for leaks.
- A blanked body fails its grader as "not written yet"; a correct function whose callee is blank
  says "calls X, which is not written yet".
- A zero stub gets a message that first says what it returned, not a mistake it did not make.
- A plausible mistake (MISTAKES: an edit of the reference's source, which is why this file stays
  with the instructor) fails with a message that names the property it breaks.
- Every part's handout leaves no line of a blanked body anywhere in the student's copy.
Each builds the function from the module's source in a fresh namespace: the files are untouched."""
import ast
import importlib
import json
import os

import pytest
from conftest import ROOT
from test_graded import GRADED, IDS, grade

from benchmarks.handout import PARTS, blank, body_lines, make, to_blank

# module.function: (reference fragment, the mistake typed in its place, what the failure must name)
MISTAKES = {
    "sft.sft_loss": ("-(logp * mask).sum()", "-logp.sum()", "only response tokens"),
    "ipo.ipo_loss": ("1.0 / (2.0 * beta)", "1.0 / beta", "1/(2β)"),
    "ipo.sequence_logp": ("mask.sum(-1).clamp(min=1)", "mask.shape[-1]", "length_norm"),
    "ipo.rpo_nll": ("-(logp_tokens_w", "(logp_tokens_w", "negative log-likelihood"),
    "rloo.rloo_advantages": ("/ (G - 1)", "/ G", "leave-one-out"),
    "opd.rloo_advantages": ("/ (G - 1)", "/ G", "leave-one-out"),
    "rloo.importance_weights": ("raw.clamp(max=clip), raw", "raw, raw", "clipped"),
    "common.k3_kl": ("log_r = other_logp - logp", "log_r = logp - other_logp", "r = other/π_θ"),
    "rloo.rloo_loss": ("pg = -w * adv", "pg = w * adv", "policy-gradient term"),
    "grpo.grpo_advantages": ("(reward.std(1, keepdim=True) + eps)", "reward.std(1, keepdim=True)", "never NaN"),
    "rlt.grpo_advantages": ("(reward.std(1, keepdim=True) + eps)", "reward.std(1, keepdim=True)", "never NaN"),
    "grpo.grpo_loss": ("torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + eps_hi) * A)", "ratio * A",
                       "clipped surrogate"),
    "rlt.rlt_loss": ("torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + epsilon) * A)", "ratio * A",
                     "clipped surrogate"),
    "grpo.aggregate": ("sum() / max(n_tokens, 1)", "sum() / mask.sum()", "add up"),
    "opd.opd_loss": ("(teacher_kl * mask).sum(-1) / n_tok", "teacher_kl.mean(-1)", "teacher KL"),
    "rlt.reward_parts": ('kl.masked_fill(expl_mask == 0, float("-inf"))', "(kl * expl_mask)", "masked zeros"),
    "rlt.rlt_reward": ("r_ss - lam * r_kl", "r_ss + lam * r_kl", "r_SS − λ·r_KL"),
    "verifier.score": ("== target else 0.1", "== target else 0.0", "present but wrong"),
}


def variant(entry, edit):
    """entry's function from its module's source, edited by edit(src, node) -> source, and run in a
    fresh namespace (blank_<module>, with the module's __file__)."""
    path = importlib.import_module(entry.module).__file__
    with open(path, encoding="utf-8") as f:
        src = f.read()
    node = next(n for n in ast.parse(src).body
                if isinstance(n, ast.FunctionDef) and n.name == entry.function)
    ns = {"__name__": f"blank_{entry.module}", "__file__": path}
    exec(compile(edit(src, node), path, "exec"), ns)
    return ns[entry.function]


def failure(entry, fn):
    """The message fn fails its grader with, or None if it passes."""
    try:
        grade(entry, fn)
    except (AssertionError, pytest.fail.Exception) as e:
        return str(e)
    return None


def reference(entry):
    """The module's own function; skips where it is not the reference (a handout, a draft)."""
    fn = getattr(importlib.import_module(entry.module), entry.function)
    if failure(entry, fn) is not None:
        pytest.skip(f"{entry.module}.{entry.function} is not the reference here: it fails its grader")
    return fn


def test_every_graded_function_has_a_mistake_and_a_part():
    assert sorted(MISTAKES) == sorted(IDS)
    parts = {q for qs in PARTS.values() for q in to_blank(qs)}
    assert set(IDS) <= parts, sorted(set(IDS) - parts)


@pytest.mark.parametrize("entry", GRADED, ids=IDS)
def test_a_blanked_function_fails_its_grader(entry):
    reference(entry)
    message = failure(entry, variant(entry, lambda src, node: blank(src, entry.function)))
    assert message is not None and message.startswith(f"{entry.function}: ") and "not written" in message, message


@pytest.mark.parametrize("entry", GRADED, ids=IDS)
def test_a_zero_stub_is_told_what_it_returned_not_a_mistake_it_did_not_make(entry):
    reference(entry)

    def stub(src, node):
        lines = src.splitlines(keepends=True)
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        return "".join(lines[:body[0].lineno - 1] + [" " * body[0].col_offset + "return 0\n"]
                       + lines[node.end_lineno:])
    message = failure(entry, variant(entry, stub))
    # what it returned comes first: "returns 0, not a tensor", or the value beside the rule it breaks
    assert message is not None and message.startswith(f"{entry.function}: returns "), message


@pytest.mark.parametrize("entry", GRADED, ids=IDS)
def test_a_wrong_function_fails_its_grader_naming_the_mistake(entry):
    reference(entry)
    old, new, keyword = MISTAKES[f"{entry.module}.{entry.function}"]

    def mistake(src, node):
        seg = ast.get_source_segment(src, node)
        assert seg.count(old) == 1, f"{entry.module}.{entry.function}: {old!r} must occur once in it"
        return src.replace(seg, seg.replace(old, new))
    message = failure(entry, variant(entry, mistake))
    assert message is not None and message.startswith(f"{entry.function}: ") and keyword in message, \
        f"{entry.module}.{entry.function} with {old!r} -> {new!r}: {message}"


def test_a_correct_function_whose_callee_is_blank_says_so():
    """rloo_loss calls k3_kl and importance_weights: with one of them blank, the correct rloo_loss
    fails naming that callee, not itself."""
    import common
    import rloo
    entry = next(e for e in GRADED if (e.module, e.function) == ("rloo", "rloo_loss"))
    k3 = next(e for e in GRADED if (e.module, e.function) == ("common", "k3_kl"))
    blank_k3 = variant(k3, lambda src, node: blank(src, "k3_kl"))
    saved = common.k3_kl, rloo.k3_kl
    try:
        common.k3_kl = rloo.k3_kl = blank_k3
        message = failure(entry, rloo.rloo_loss)
    finally:
        common.k3_kl, rloo.k3_kl = saved
    assert message == "rloo_loss: calls k3_kl, which is not written yet", message


@pytest.mark.parametrize("part", ["all", *PARTS])
def test_a_handout_gives_no_answer_away(part, tmp_path):
    """Every line of every blanked body (twins too) is gone from every text file of the student's
    copy: the scripts, the package, the tests, the docs. The instructor's key is not in it."""
    out = tmp_path / "handout"
    names = make(str(out), list(PARTS) if part == "all" else [part])
    answers = {}
    for q in names:
        module, _, name = q.rpartition(".")
        source = open(os.path.join(ROOT, module.replace(".", "/") + ".py")).read()
        answers.update({line: q for line in body_lines(source, name)})
    leaks = []
    for dirpath, _, files in os.walk(out):
        for f in files:
            path = os.path.join(dirpath, f)
            try:
                text = open(path, encoding="utf-8").read()
            except UnicodeDecodeError:  # weights, pictures
                continue
            for n, line in enumerate(text.splitlines(), 1):
                code = line.split("  #")[0].strip()
                if code in answers:
                    leaks.append(f"{os.path.relpath(path, out)}:{n} holds {answers[code]}'s {code!r}")
    assert not leaks, "\n".join(leaks)
    assert not (out / "docs" / "instructor.md").exists() and not (out / "tests" / "test_graders.py").exists()


def test_a_student_who_writes_two_functions_and_submits_gets_their_points(tmp_path):
    """The whole handout; verifier.score and sft.sft_loss written back as a student would (their
    reference bodies typed in); then the submit step: 12 code points, the two passed, the rest
    not written, and the archive holds the student's files and the grades."""
    import subprocess
    import sys
    import tarfile
    out = tmp_path / "handout"
    make(str(out), list(PARTS))
    def function(src, name):
        return ast.get_source_segment(src, next(n for n in ast.parse(src).body
                                                if isinstance(n, ast.FunctionDef) and n.name == name))
    for module, name in (("verifier", "score"), ("sft", "sft_loss")):
        path = out / f"{module}.py"
        src, reference_src = path.read_text(), open(os.path.join(ROOT, f"{module}.py")).read()
        path.write_text(src.replace(function(src, name), function(reference_src, name)))
    r = subprocess.run([sys.executable, "benchmarks/submit.py", "--out", str(tmp_path / "s.tar.gz")], cwd=out,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "code points: 12 of 55" in r.stdout, r.stdout
    with tarfile.open(tmp_path / "s.tar.gz") as tar:
        names = set(tar.getnames())
        grades = json.load(tar.extractfile("grades.json"))
    assert {"verifier.py", "sft.py", "rloo.py", "docs/answers.md", "grades.json"} <= names, names
    assert grades["graded"]["verifier.score"] == grades["graded"]["sft.sft_loss"] == "passed"
    assert "not written yet" in grades["graded"]["rloo.rloo_advantages"]
    assert grades["graded"]["rloo.rloo_loss"].startswith("rloo_loss: ")


def test_the_assignment_and_the_submit_step_give_the_same_points():
    """docs/assignment.md's code points per function are benchmarks/submit.py's, and each part's
    total is its heading's."""
    import re
    from benchmarks.submit import POINTS
    page = open(os.path.join(ROOT, "docs/assignment.md")).read()
    found = {q: int(n) for q, n in re.findall(r"`([\w.]+)`(?: and its twin[^()]*)? \((\d+)(?: points?)?\)", page)}
    assert {q: found.get(q) for q in POINTS} == POINTS
    parts = re.findall(r"^## Part \d+\. .*?\((\d+) points", page, re.M)
    assert len(parts) == 7 and sum(map(int, parts)) == 100, parts
