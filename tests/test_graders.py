"""The instructor's side of the graded exercises (course/instructor.md), left out of a handout: the
graders of tests/test_graded.py graded themselves, the handout checked for leaks and for holding
together, and the grading command (course/grade.py) tried on a class of archives.
- A blanked body fails its grader as "not written yet"; a correct function whose callee is blank
  says "calls X, which is not written yet".
- A zero stub gets a message that first says what it returned, not a mistake it did not make.
- A plausible mistake (MISTAKES, and MORE_MISTAKES where a function has several: an edit of the
  reference's source, which is why this file stays with the instructor) fails with a message that
  names the property it breaks.
- Every part's handout leaves no line of a blanked body anywhere in the student's copy, and links
  to no file it leaves out.
- A function that returns fewer keys than the scripts read fails naming the missing one; the
  reference passes its hidden cases, and a function fitted to the visible ones does not.
- grade.py grades archives whose tests, verdict and summaries were edited as if they were not.
Each builds the function from the module's source in a fresh namespace: the files are untouched."""
import ast
import importlib
import json
import os
import re
import sys

import pytest
from conftest import ROOT
from test_graded import GRADED, IDS, grade

from course.handout import INSTRUCTOR, PARTS, blank, body_lines, make, to_blank

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
    "verifier.dense_score": ("max(0.0, 1.0 - float(abs(value - target))", "(1.0 - float(abs(value - target))",
                             "the max with 0"),
    "grpo.sequence_log_ratio": ("seq.detach()", "(((logp - old_logp).exp() * mask).sum(-1, keepdim=True) "
                                "/ mask.sum(-1, keepdim=True)).log().detach()", "arithmetic mean"),  # of the ratios
    "grpo.cispo_surrogate": ("ratio.clamp(max=1 + eps_hi).detach()", "ratio.clamp(max=1 + eps_hi)", "not detached"),
}
# a function's other typical mistakes, beyond its row above: [(reference fragment, mistake, what the failure names)]
MORE_MISTAKES = {
    "grpo.sequence_log_ratio": [("seq.detach() + logp", "seq + logp", "mean not detached"),  # the mean's gradient
                                ("seq.detach() + logp - logp.detach()", "seq.detach() + 0 * logp",
                                 "OWN token's gradient")],  # the right values, no per-token gradient
    "grpo.cispo_surrogate": [("ratio.clamp(max=1 + eps_hi)", "ratio.clamp(1 - eps_hi, 1 + eps_hi)",
                              "capped above only"),  # PPO's lower clip added
                             ("ratio > 1 + eps_hi", "(ratio > 1 + eps_hi) & (A > 0)", "whatever the sign of A")],
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
    assert sorted(MISTAKES) == sorted(IDS) and set(MORE_MISTAKES) <= set(IDS)
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


def assert_named(entry, old, new, keyword):
    """entry's reference with `old` (once in it) typed as `new` fails its grader naming `keyword`."""
    reference(entry)

    def mistake(src, node):
        seg = ast.get_source_segment(src, node)
        assert seg.count(old) == 1, f"{entry.module}.{entry.function}: {old!r} must occur once in it"
        return src.replace(seg, seg.replace(old, new))
    message = failure(entry, variant(entry, mistake))
    assert message is not None and message.startswith(f"{entry.function}: ") and keyword in message, \
        f"{entry.module}.{entry.function} with {old!r} -> {new!r}: {message}"


@pytest.mark.parametrize("entry", GRADED, ids=IDS)
def test_a_wrong_function_fails_its_grader_naming_the_mistake(entry):
    assert_named(entry, *MISTAKES[f"{entry.module}.{entry.function}"])


MORE = [(q, m) for q, ms in MORE_MISTAKES.items() for m in ms]


@pytest.mark.parametrize("q,mistake", MORE, ids=[f"{q}: {m[2]}" for q, m in MORE])
def test_each_other_typical_mistake_fails_naming_itself(q, mistake):
    """GSPO's ratio with the mean not detached or no per-token gradient (its values right, its
    gradient not); CISPO's weight floored at 1 − ε too, its `capped` marks only where A > 0."""
    assert_named(next(e for e in GRADED if f"{e.module}.{e.function}" == q), *mistake)


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
    assert not [f for f in INSTRUCTOR if (out / f).exists()]
    import subprocess  # its git history is the blanked copy: one commit, nothing left to commit
    log = subprocess.run(["git", "log", "--oneline"], cwd=out, capture_output=True, text=True).stdout.splitlines()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=out, capture_output=True, text=True).stdout
    assert len(log) == 1 and not dirty, (log, dirty)


def function_source(src, name):
    """The whole lines of function `name` in src, from `def` to its last line's comment."""
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return "".join(src.splitlines(keepends=True)[node.lineno - 1:node.end_lineno])


def fill(out, functions, bodies=None):
    """Write the handout's blanks of `functions` back as a student would: the reference's source
    typed in, or bodies[q] (a whole `def`) in its place."""
    for q in functions:
        module, _, name = q.rpartition(".")
        path = out / f"{module}.py"
        src, reference_src = path.read_text(), open(os.path.join(ROOT, f"{module}.py")).read()
        path.write_text(src.replace(function_source(src, name), (bodies or {}).get(q, "").rstrip("\n") + "\n"
                                    if q in (bodies or {}) else function_source(reference_src, name)))


def test_a_short_track_student_who_writes_two_functions_is_checked_on_the_short_tracks_parts(tmp_path):
    """The short track's handout (verifier, sft, rloo); verifier.score and sft.sft_loss written back
    as a student would; then the submit step: its local check counts the handout's parts only (10
    of 27 points, none for parts 4-7, which the handout left written), and the archive holds the
    student's files and runs, samples included, and no verdict of its own."""
    import subprocess
    import sys
    import tarfile
    out = tmp_path / "handout"
    make(str(out), ["verifier", "sft", "rloo"])
    fill(out, ["verifier.score", "sft.sft_loss"])
    ev = out / "out" / "cpu" / "eval" / "sft"
    ev.mkdir(parents=True)
    (ev / "summary.json").write_text(json.dumps({"pass_at_k": {"1": 0.3}}))
    (ev / "samples.jsonl").write_text("{}\n")
    r = subprocess.run([sys.executable, "course/submit.py", "--out", str(tmp_path / "s.tar.gz")], cwd=out,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "local check: 10 of 27 code points" in r.stdout, r.stdout
    assert "ok   verifier.score" in r.stdout and "FAIL rloo.rloo_advantages" in r.stdout
    assert "grpo." not in r.stdout and "opd.opd_loss" not in r.stdout, r.stdout
    with tarfile.open(tmp_path / "s.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"verifier.py", "sft.py", "rloo.py", "course/answers.md", "out/cpu/eval/sft/summary.json",
            "out/cpu/eval/sft/samples.jsonl"} <= names, names
    assert not [n for n in names if n.endswith(("grades.json", ".xml"))], names


def test_the_assignment_and_the_submit_step_give_the_same_points():
    """course/assignment.md's code points per function are course/submit.py's, and each part's
    total is its heading's: seven parts of 100, and the optional part's extra points over them."""
    import re
    from course.submit import POINTS
    page = open(os.path.join(ROOT, "course/assignment.md")).read()
    found = {q: int(n) for q, n in re.findall(r"`([\w.]+)`(?: and its twin[^()]*)? \((\d+)(?: points?)?\)", page)}
    assert {q: found.get(q) for q in POINTS} == POINTS
    parts = re.findall(r"^## Part \d+\. .*?\((\d+) points", page, re.M)
    assert len(parts) == 7 and sum(map(int, parts)) == 100, parts
    from course.submit import EXTRA  # the optional part: its heading's extra points are its code's and written's
    optional = page.split("\n## Optional part. ", 1)[1]
    written = re.search(r"\*\*Written\*\* \((\d+) points?\)", optional)
    assert optional.startswith(f"GSPO and CISPO ({sum(POINTS[q] for q in EXTRA) + int(written.group(1))} extra "
                               "points"), optional[:80]


# ---- the whole contract, and the hidden cases -----------------------------------------------------
@pytest.mark.parametrize("q,key", [("grpo.grpo_loss", "ratio"), ("grpo.grpo_loss", "terms"),
                                   ("rloo.rloo_loss", "kl"), ("rloo.rloo_loss", "is_weight_raw"),
                                   ("rloo.rloo_loss", "terms")])
def test_a_function_missing_a_key_its_script_reads_fails_naming_it(q, key):
    """Before, grpo_loss was checked for `clipped` and `kl` and rloo_loss for `is_weight` only, and a
    function that returned just those earned its points, then stopped its stage with a KeyError."""
    entry = next(e for e in GRADED if f"{e.module}.{e.function}" == q)
    reference(entry)

    def drop(src, node):
        seg = ast.get_source_segment(src, node)
        ret = seg[seg.rindex("return "):]
        cut = re.sub(rf'"{key}": [^,}}]+,?\s*', "", ret, count=1)
        assert cut != ret, ret
        return src.replace(seg, seg.replace(ret, cut))
    message = failure(entry, variant(entry, drop))
    assert message and message.startswith(f"{entry.function}: returns no key {key!r}"), message


def test_the_reference_passes_every_hidden_case_and_a_function_fitted_to_the_visible_ones_does_not(tmp_path):
    import torch

    from course import grade as G
    G.expected(IDS, 7, tmp_path / "cases.pt")
    cases = torch.load(tmp_path / "cases.pt", weights_only=False)
    for q in IDS:
        module, _, name = q.rpartition(".")
        assert len(cases[q]) >= 1
        assert G.hidden(name, getattr(importlib.import_module(module), name), cases[q]) == "passed", q
    import rloo

    def fitted(reward, positive_weight=1.0):  # right on the visible groups of 4, zeros elsewhere
        return rloo.rloo_advantages(reward, positive_weight) if reward.shape[1] == 4 else reward * 0
    entry = next(e for e in GRADED if (e.module, e.function) == ("rloo", "rloo_advantages"))
    fitted.__name__ = "rloo_advantages"
    assert failure(entry, fitted) is None  # the visible check passes it
    message = G.hidden("rloo_advantages", fitted, cases["rloo.rloo_advantages"])
    assert message.startswith("rloo_advantages: hidden case 1 (rewards (5, 6)") and "should be" in message, message


# ---- a handout that holds together ----------------------------------------------------------------
def local_targets(root, text, page):
    """What a page or file of `root` points at: markdown links, and (in code) docs/ and course/ paths."""
    out = [os.path.normpath(os.path.join(os.path.dirname(page), t.split("#")[0]))
           for t in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`\n]*`", "", text))
           if not re.match(r"(https?|mailto):|#", t)] if page.endswith(".md") else []
    return out + (re.findall(r"(?:docs|course)/[\w/.-]+\.(?:md|json|png|jsonl)", text) if not page.endswith(".md") else [])


@pytest.mark.parametrize("part", ["all", *PARTS])
def test_every_handout_filled_back_is_the_repo_less_the_key_and_links_to_nothing_it_leaves_out(part, tmp_path):
    """Its blanks written back with the reference bodies, each handout's code is the repo's to the
    byte, so its own suite runs what the repo's runs; and no page, test or script of it links to,
    names the path of, or opens a file it leaves out (the key, the graders' tests, the hidden
    cases, the grading tools), but the handout.json in its course/, whose left_out lists them
    (INSTRUCTOR) for its own tests/test_docs.py: a page of the copy may name them (README names the
    grading tools).
    `pytest -m slow` runs the whole filled-back handout's suite."""
    out = tmp_path / "handout"
    names = make(str(out), list(PARTS) if part == "all" else [part])
    fill(out, names)
    broken, differ = [], []
    for dirpath, _, files in os.walk(out):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), out)
            try:
                text = open(os.path.join(dirpath, f), encoding="utf-8").read()
            except UnicodeDecodeError:
                continue
            if rel.endswith(".py") and text != open(os.path.join(ROOT, rel), encoding="utf-8").read():
                differ.append(rel)
            if rel != os.path.join("course", "handout.json"):  # the list of what it leaves out
                broken += [f"{rel} -> {t}" for t in local_targets(out, text, rel) if not os.path.exists(out / t)]
            if rel.startswith("tests/"):  # no test reads or imports the instructor's side
                imported = set(re.findall(r"(?:^|\n)\s*(?:from|import)\s+(?:course\.)?(\w+)", text))
                broken += [f"{rel} names {x}" for x in INSTRUCTOR if x in text]
                broken += [f"{rel} imports {m}" for m in imported & {os.path.basename(x)[:-3] for x in INSTRUCTOR
                                                                      if x.endswith(".py")}]
    assert not differ, f"filled back, these differ from the repo's: {differ}"
    assert not broken, "\n".join(broken)
    manifest = json.load(open(out / "course" / "handout.json"))
    assert manifest["blanked"] == names and manifest["left_out"] == INSTRUCTOR


@pytest.mark.slow
def test_the_whole_handout_filled_back_passes_its_own_suite(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "handout"
    fill(out, make(str(out), list(PARTS)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"], cwd=out,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]


# ---- the grading command, tried on a class ----------------------------------------------------------
def samples_of(right_per_problem):
    """The test split's problems, 16 samples each, the first right_per_problem(i) right (the solver's
    answer), the others a wrong one: evaluate.py's samples.jsonl, and its pass@1."""
    import verifier
    from course.grade import NUM_SAMPLES, TEST_DATA
    from plumbing.tasks import load_tasks
    rows, right = [], 0
    for i, t in enumerate(load_tasks(TEST_DATA, "test")):
        c = right_per_problem(i)
        good = f" tries.\n</think>\n<answer>{verifier.solve(t['nums'], t['target'])}</answer>"
        bad = f" tries.\n</think>\n<answer>{' + '.join(map(str, t['nums']))} + 1</answer>"
        completions = [good] * c + [bad] * (NUM_SAMPLES - c)
        rows.append({"nums": t["nums"], "target": t["target"], "completions": completions,
                     "scores": [1.0] * c + [0.1] * (NUM_SAMPLES - c)})
        right += c
    return "".join(json.dumps(r) + "\n" for r in rows), right / (len(rows) * NUM_SAMPLES)


HANG = '''def sft_loss(logp, mask):
    """mine"""
    while True:
        pass
'''
CRASH_LATER = '''def dense_score(response, numbers, target):
    """mine: right on every case, a KeyError in a branch no case takes (a 1 among the numbers and
    a target over 40: the rloo stage's first problem)"""
    if 1 in numbers and target > 40:
        return {}["a branch never tried"]
    sparse = score(response, numbers, target)
    if sparse != 0.1:
        return sparse
    value = evaluate_expression(extract_answer(response), numbers)
    if value is None:
        return 0.1
    return 0.1 + 0.5 * max(0.0, 1.0 - float(abs(value - target)) / max(1, abs(target)))
'''


def test_grading_a_class_trusts_no_verdict_summary_or_test_the_students_send(tmp_path):
    """The short track's first two parts handed out; five archives graded in one command:
    alice, written honestly; bob, the same work with tests/test_graded.py gutted and a grades.json
    claiming every point; carol, the same work with its summary.json raised to 0.9; dave, whose
    sft_loss hangs and whose dense_score passes every case but crashes the rloo stage in a branch
    no case takes; and a file that is no archive. alice, bob and carol get the same grade (carol flagged),
    dave loses the two functions with one line each, the broken file costs only its own points."""
    import csv
    import subprocess
    import sys
    import tarfile
    out = tmp_path / "handout"
    make(str(out), ["verifier", "sft"])
    fill(out, ["verifier.score", "verifier.dense_score", "sft.sft_loss"])
    samples, pass1 = samples_of(lambda i: 4 + (i % 4 == 0))  # 0.266: inside sft's target
    ev = out / "out" / "cpu" / "eval" / "sft"
    ev.mkdir(parents=True)
    (ev / "samples.jsonl").write_text(samples)
    (ev / "summary.json").write_text(json.dumps({"pass_at_k": {"1": pass1}}))
    files = ["verifier.py", "sft.py", "course/answers.md", "out/cpu/eval/sft/samples.jsonl", "out/cpu/eval/sft/summary.json"]

    def pack(name, extra=()):
        with tarfile.open(tmp_path / f"{name}.tar.gz", "w:gz") as tar:
            for f in [*files, *extra]:
                tar.add(out / f, arcname=f)
        return str(tmp_path / f"{name}.tar.gz")
    archives = [pack("alice")]
    (out / "tests" / "test_graded.py").write_text("def test_graded():\n    pass\n")
    (out / "grades.json").write_text(json.dumps({"code_points_total": 55, "graded": {}}))
    archives.append(pack("bob", ["tests/test_graded.py", "grades.json"]))
    (ev / "summary.json").write_text(json.dumps({"pass_at_k": {"1": 0.9}}))
    archives.append(pack("carol"))
    (ev / "summary.json").write_text(json.dumps({"pass_at_k": {"1": pass1}}))
    fill(out, ["sft.sft_loss", "verifier.dense_score"], {"sft.sft_loss": HANG, "verifier.dense_score": CRASH_LATER})
    archives.append(pack("dave"))
    (tmp_path / "eve.tar.gz").write_bytes(b"not an archive")
    archives.append(str(tmp_path / "eve.tar.gz"))
    r = subprocess.run([sys.executable, "course/grade.py", *archives, "--parts", "verifier", "sft", "--out",
                        str(tmp_path / "grades"), "--limit", "3", "--jobs", "2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["submission"]: row for row in csv.DictReader(open(tmp_path / "grades" / "grades.csv"))}
    assert list(rows) == ["alice", "bob", "carol", "dave", "eve"], r.stdout
    same = lambda row: {k: v for k, v in row.items() if k not in ("submission", "flags")}  # noqa: E731
    assert same(rows["alice"]) == same(rows["bob"]) == same(rows["carol"]), rows
    assert rows["alice"]["code_points"] == "12" and rows["alice"]["code_possible"] == "12", rows["alice"]
    assert rows["alice"]["run_points"] == "4" and rows["alice"]["run_possible"] == "4"
    assert rows["alice"]["pass@1 sft"] == f"{pass1:.3f}" and rows["alice"]["written_points"] == ""
    carol = (tmp_path / "grades" / "carol.txt").read_text()
    assert "FLAGGED" in carol and "says pass@1 0.9" in carol, carol
    dave = (tmp_path / "grades" / "dave.txt").read_text()
    assert rows["dave"]["code_points"] == "4" and rows["dave"]["verifier.score"] == "pass", dave
    assert "FAIL sft.sft_loss: sft_loss: over its 3 s limit" in dave, dave
    assert "FAIL verifier.dense_score: dense_score: rloo.py stopped in it in 2 steps: KeyError" in dave, dave
    assert rows["eve"]["code_points"] == "0" and "not a readable .tar.gz" in r.stdout, r.stdout


def test_a_killed_grader_takes_its_workers_along(tmp_path):
    """Grading killed midway (a job's time limit, a kill) leaves no worker behind: a hanging sft_loss
    at a 60 s limit keeps a worker busy (in a session of its own); the grader killed, the worker ends
    within seconds, not at its limit. Real interpreters, so that each process's command line is its own."""
    import signal
    import subprocess
    import tarfile
    import time
    out = tmp_path / "handout"
    make(str(out), ["verifier", "sft"])
    fill(out, ["verifier.score", "verifier.dense_score", "sft.sft_loss"], {"sft.sft_loss": HANG})
    with tarfile.open(tmp_path / "dave.tar.gz", "w:gz") as tar:
        for f in ["verifier.py", "sft.py", "course/answers.md"]:
            tar.add(out / f, arcname=f)
    real = os.environ.get("WARM_PYTHON_REAL", sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARM_PYTHON")}
    grades = tmp_path / "grades"
    grader = subprocess.Popen([real, "course/grade.py", str(tmp_path / "dave.tar.gz"), "--parts", "verifier", "sft",
                               "--out", str(grades), "--limit", "60"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def workers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = open(f"/proc/{pid}/cmdline").read().split("\0")
            except OSError:
                continue
            if "--worker" in argv and str(grades) in " ".join(argv):
                found.append(int(pid))
        return found
    try:
        for _ in range(600):
            if workers() or grader.poll() is not None:
                break
            time.sleep(0.1)
        assert workers(), "no worker started"
        time.sleep(2)  # in the hanging function
        grader.kill()
        grader.wait()
        for _ in range(100):
            if not workers():
                return
            time.sleep(0.1)
        pytest.fail(f"the grader's workers {workers()} outlived it")
    finally:
        grader.kill()
        for pid in workers():
            os.kill(pid, signal.SIGKILL)


def test_gradescope_results_follow_its_format_and_the_autograder_zip_holds_the_key(tmp_path):
    """results.json as Gradescope reads it (tests with name, score, max_score, output, visibility;
    points after publishing, the visible verdict at once), and the zip its autograder is built from."""
    import subprocess
    import sys
    import zipfile

    from course.grade import gradescope
    r = {"submission": "s", "code_points": 4, "code_possible": 12, "run_points": 4, "run_possible": 4,
         "functions": {"verifier.score": {"ok": True, "line": "passed", "visible": "passed"},
                       "verifier.dense_score": {"ok": False, "line": "dense_score: hidden case 2 (...): ...",
                                                "visible": "passed"},
                       "sft.sft_loss": {"ok": False, "line": "sft_loss: over its 20 s limit", "visible":
                                        "sft_loss: over its 20 s limit"}},
         "lines": ["run sft: 4 of 4: pass@1 0.266, target 0.22-0.32"], "flags": [], "runs": {"sft": 0.266}}
    res = gradescope(r)
    assert set(res) <= {"score", "tests", "output", "visibility", "stdout_visibility", "execution_time"}
    for t in res["tests"]:
        assert {"name", "score", "max_score", "output", "visibility"} <= set(t), t
        assert isinstance(t["name"], str) and isinstance(t["output"], str)
        assert isinstance(t["score"], (int, float)) and isinstance(t["max_score"], (int, float))
        assert t["visibility"] in ("hidden", "after_due_date", "after_published", "visible") and t["score"] <= t["max_score"]
    assert sum(t["max_score"] for t in res["tests"]) == 16 and sum(t["score"] for t in res["tests"]) == 8
    assert all(t["visibility"] == "after_published" for t in res["tests"] if t["max_score"])
    hidden_fail = next(t for t in res["tests"] if t["name"] == "verifier.dense_score: the visible check")
    assert hidden_fail["output"] == "passed" and hidden_fail["visibility"] == "visible"  # nothing of a hidden case
    z = subprocess.run([sys.executable, "course/grade.py", "--autograder", str(tmp_path / "a.zip"), "--parts",
                        "verifier", "sft"], cwd=ROOT, capture_output=True, text=True)
    assert z.returncode == 0, z.stderr
    names = zipfile.ZipFile(tmp_path / "a.zip").namelist()
    assert {"setup.sh", "run_autograder", "parts.txt", "countdown/course/grade.py",
            "countdown/course/hidden_cases.py", "countdown/install.sh"} <= set(names)
    assert zipfile.ZipFile(tmp_path / "a.zip").read("parts.txt").decode().split() == ["verifier", "sft"]


def test_the_assignments_targets_are_every_fresh_runs_widened():
    """course/assignment.md's targets are course/grade.py's (every run in docs/fresh_runs.json,
    widened by 0.03, rounded outward), its fresh-run ranges are the runs', and their count too."""
    from course.grade import TEST_DATA, targets
    from plumbing.report import fresh_runs
    assert f'DATA="{TEST_DATA}"' in open(os.path.join(ROOT, "run_cpu.sh")).read()  # the split the runs are graded on
    page = open(os.path.join(ROOT, "course/assignment.md")).read()
    runs = fresh_runs()
    assert f"spread of the {len(runs)} fresh-clone runs" in " ".join(page.split())
    for stage, (low, high) in targets().items():
        values = [r["pass@1"][stage] for r in runs]
        row = next(line for line in page.splitlines() if line.startswith(f"| `{stage}` |"))
        assert f"{min(values):.3f} – {max(values):.3f}" in row and f"{low:.2f} – {high:.2f}" in row, (stage, row)


def test_the_instructors_key_quotes_runs_it_can_name():
    """course/instructor.md's rows of a pipeline's own evaluations (`out/cpu/eval/...`) quote pass@k
    of a run in docs/fresh_runs.json, its "runs" or its "earlier" ones (the key was measured on the
    base before the tokenizer's change), or the current one (the exercises start from a fresh clone's
    out/cpu); its mistake shares are that run's own, from its summary.json, not kept in the repo.
    Broken on purpose (the key's sft pass@1 0.277 made 0.299, in no run), it failed."""
    runs = json.load(open(os.path.join(ROOT, "docs/fresh_runs.json")))
    current = json.load(open(os.path.join(ROOT, "docs/results.json")))
    known = {f"{v:.3f}" for r in runs["runs"] + runs.get("earlier", {}).get("runs", [])
             for k in ("pass@1", "pass@16") for v in r[k].values()}
    known |= {f"{v:.3f}" for r in current.values() for v in r["pass_at_k"].values()}
    rows = [line for line in open(os.path.join(ROOT, "course/instructor.md")).read().splitlines()
            if line.startswith("| `out/cpu/eval/")]
    found = [x for line in rows for x in re.findall(r"(?<![\w.])\d\.\d{3}(?![\d.%])", line)]
    assert rows and found and not [x for x in found if x not in known], found


@pytest.mark.slow
def test_the_reference_files_earn_every_code_point_every_stage_running(tmp_path):
    """The repo's own files as a submission of every part: 55 of 55, and the optional part's 7 extra
    of 7, each stage's 2-step run (sft, ipo, rloo, grpo, opd, rlt, and grpo:family, grpo.py with GSPO's
    ratio and CISPO's surrogate) going through with grade.py's flags."""
    import csv
    import subprocess
    import sys
    import tarfile
    from course.submit import FILES
    with tarfile.open(tmp_path / "key.tar.gz", "w:gz") as tar:
        for f in FILES:
            tar.add(os.path.join(ROOT, f), arcname=f)
    r = subprocess.run([sys.executable, "course/grade.py", str(tmp_path / "key.tar.gz"), "--out", str(tmp_path / "g")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(csv.DictReader(open(tmp_path / "g" / "grades.csv")))
    assert (row["code_points"], row["code_possible"]) == ("55", "55"), (tmp_path / "g" / "key.txt").read_text()
    assert (row["extra_points"], row["extra_possible"]) == ("7", "7"), (tmp_path / "g" / "key.txt").read_text()
    assert "GRADER ERROR" not in r.stdout, r.stdout  # each stage's flags run


def test_the_optional_parts_stage_calls_both_of_its_functions(tmp_path, monkeypatch):
    """grade.py's stage of the optional part, grpo:family, is grpo.py's grpo stage with GSPO's ratio
    and CISPO's surrogate on (both at once: grpo_loss takes CISPO's weight of GSPO's s_i): its 2 steps
    call the student's two functions, every pass, or a body that crashes the script would pass."""
    import grpo
    from course.grade import STAGE_ARGS, STAGES, run_name, script_of
    assert STAGES["grpo_family"] == ["grpo:family"] and script_of("grpo:family") == "grpo"
    assert STAGE_ARGS["grpo:family"][:len(STAGE_ARGS["grpo"])] == STAGE_ARGS["grpo"]
    assert run_name("grpo:family") == "grpo.py --ratio_level sequence --loss_type cispo --num_iterations 2"
    calls = {"sequence_log_ratio": 0, "cispo_surrogate": 0}
    for name in calls:
        def counted(*args, _real=getattr(grpo, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(grpo, name, counted)
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")  # as grade.py runs its stages
    monkeypatch.chdir(ROOT)  # the shipped models, by the relative paths grade.py's copy has
    grpo.main(STAGE_ARGS["grpo:family"] + ["--output_dir", str(tmp_path / "run")])
    assert calls["sequence_log_ratio"] == calls["cispo_surrogate"] >= 2 * 2, calls  # 2 steps x 2 passes, at least


@pytest.mark.parametrize("q", ["sft.sft_loss", "rloo.rloo_loss", "grpo.grpo_loss", "grpo.aggregate", "opd.opd_loss"])
def test_a_loss_returned_detached_fails_its_contract(q):
    """The right values with no gradient: backward() would never reach the model."""
    entry = next(e for e in GRADED if f"{e.module}.{e.function}" == q)
    ref = reference(entry)

    def detached(*args, **kwargs):
        out = ref(*args, **kwargs)
        return (out[0].detach(), *out[1:]) if isinstance(out, tuple) else out.detach()
    detached.__name__ = entry.function
    message = failure(entry, detached)
    assert message and message.startswith(f"{entry.function}: returns ") and "detached" in message, message
