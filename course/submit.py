"""A student's submission (course/assignment.md): pack the student's files and runs into one
archive, after a local check of the graded functions.

  python course/submit.py [--out submission.tar.gz] [--runs out]

The archive holds the eight files with graded functions, course/answers.md, and under --runs every
stage's metrics.jsonl and test evaluation (summary.json and samples.jsonl: the samples are what the
run is graded on). The instructor grades it with their own graders, visible and hidden cases, and
re-scores the samples (course/grade.py, which stays with them): nothing the student's copy
computes is a grade. What this prints is the local check, tests/test_graded.py as handed out, for
the parts of the handout (handout.json in course/). Exit 0 even when checks fail: a partial submission
is a submission.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["verifier.py", "sft.py", "ipo.py", "rloo.py", "grpo.py", "opd.py", "rlt.py", "common.py",
         "course/answers.md"]
# course/assignment.md's code points: a function with a twin earns them when both pass
POINTS = {"verifier.score": 4, "verifier.dense_score": 2, "sft.sft_loss": 6, "rloo.rloo_advantages": 4,
          "rloo.importance_weights": 3, "common.k3_kl": 3, "rloo.rloo_loss": 5,
          "grpo.grpo_advantages": 3, "grpo.grpo_loss": 5, "grpo.aggregate": 4, "ipo.ipo_loss": 3,
          "ipo.sequence_logp": 2, "ipo.rpo_nll": 2, "opd.opd_loss": 4, "rlt.reward_parts": 3,
          "rlt.rlt_reward": 2, "grpo.sequence_log_ratio": 4, "grpo.cispo_surrogate": 3}
# the optional part's (GSPO and CISPO): extra points, over the seven parts' 100, counted apart
EXTRA = {"grpo.sequence_log_ratio", "grpo.cispo_surrogate"}
TWIN_OF = {"opd.rloo_advantages": "rloo.rloo_advantages", "rlt.grpo_advantages": "grpo.grpo_advantages",
           "rlt.rlt_loss": "grpo.grpo_loss"}


def grades(report, timeout=120, only=None):
    """{module.function: "passed" or its failure line}, from one run of tests/test_graded.py (of
    function `only`, or all) whose JUnit report goes to `report`; None if it ran past `timeout`
    seconds (a function that hangs)."""
    target = f"tests/test_graded.py::test_graded[{only}]" if only else "tests/test_graded.py"
    try:
        subprocess.run([sys.executable, "-m", "pytest", target, "-n", "0", "-q",
                        "-p", "no:cacheprovider", f"--junitxml={report}"], cwd=ROOT, capture_output=True,
                       timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if not os.path.isfile(report):
        return {}
    out = {}
    for case in ET.parse(report).iter("testcase"):
        m = re.fullmatch(r"test_graded\[([\w.]+)\]", case.get("name", ""))
        if m:
            failed = case.find("failure")
            message = (failed.get("message") or "failed") if failed is not None else "passed"
            out[m.group(1)] = message.removeprefix("Failed: ")  # pytest.fail's prefix
    return out


def handed_out():
    """The graded functions of this handout's parts (handout.json in course/, which handout.py writes);
    every one in a full copy of the repo."""
    try:
        return json.load(open(os.path.join(ROOT, "course", "handout.json")))["graded"]
    except (OSError, ValueError, KeyError):
        return list(POINTS) + list(TWIN_OF)


def code_points(result, given):
    """Points per graded function of the handout: all or nothing, twins included."""
    earned = {}
    for q, pts in POINTS.items():
        if q in given:
            twins = [t for t, orig in TWIN_OF.items() if orig == q]
            earned[q] = pts if all(result.get(x) == "passed" for x in [q, *twins]) else 0
    return earned


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="submission.tar.gz", help="the archive to write")
    p.add_argument("--runs", default="out", help="where the runs' metrics.jsonl and evaluations are")
    a = p.parse_args()
    tmp = tempfile.mkdtemp()
    given = handed_out()
    result = grades(os.path.join(tmp, "graded.xml"))
    if result is None:  # a function hangs: one at a time, each with its own limit
        print("the local check ran past 2 min: checking one function at a time, 30 s each")
        result = {q: (grades(os.path.join(tmp, f"{q}.xml"), 30, q) or {}).get(q, "hangs: over 30 s") for q in given}
    result = {q: result[q] for q in given if q in result}
    if not result:
        sys.exit("error: tests/test_graded.py ran no graded test: run this from the repo's venv")
    earned = code_points(result, given)
    runs = sorted(r for name in ("summary.json", "samples.jsonl", "metrics.jsonl")
                  for r in glob.glob(os.path.join(ROOT, a.runs, "**", name), recursive=True))
    with tarfile.open(a.out, "w:gz") as tar:
        for f in FILES + [os.path.relpath(r, ROOT) for r in runs]:
            if os.path.isfile(os.path.join(ROOT, f)):
                tar.add(os.path.join(ROOT, f), arcname=f)
    for q, status in result.items():
        print(f"{'ok  ' if status == 'passed' else 'FAIL'} {q}" + ("" if status == "passed" else f": {status}"))
    extra = {q: earned.pop(q) for q in EXTRA if q in earned}  # the optional part's, over the 100
    points = [f"{sum(earned.values())} of {sum(POINTS[q] for q in earned)} code points"] if earned or not extra else []
    points += [f"{sum(extra.values())} of {sum(POINTS[q] for q in extra)} extra points (the optional part)"] if extra else []
    print(f"local check: {' and '.join(points)} on the visible cases (the instructor's grade adds hidden cases and "
          f"a 2-step run of each stage)")
    evaluations = [r for r in runs if r.endswith("summary.json")]
    for r in evaluations:
        print(f"run: {os.path.relpath(r, ROOT)}: test pass@1 {_pass1(r)}"
              + ("" if os.path.isfile(r.replace("summary.json", "samples.jsonl")) else
                 " (no samples.jsonl beside it: this run cannot be graded)"))
    if not evaluations:
        print(f"no evaluation under {a.runs}/: run ./run_cpu.sh (course/assignment.md, Runs)")
    print(f"wrote {a.out}")


def _pass1(path):
    try:
        return round(json.load(open(path))["pass_at_k"]["1"], 3)
    except (KeyError, ValueError, OSError):
        return None


if __name__ == "__main__":
    main()
