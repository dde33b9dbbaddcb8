"""A student's submission (docs/assignment.md): run the graded tests, then pack the student's files
and a summary of their runs into one archive.

  python benchmarks/submit.py [--out submission.tar.gz] [--runs out]

The archive holds the eight files with graded functions, docs/answers.md, grades.json (each graded
function: passed or its one-line failure; the code points each earned), the tests' JUnit report,
and every summary.json and metrics.jsonl under --runs. It prints the code points and the runs it found. Exit 0 even when tests
fail: a partial submission is a submission.
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
         "docs/answers.md"]
# docs/assignment.md's code points: a function with a twin earns them when both pass
POINTS = {"verifier.score": 6, "sft.sft_loss": 6, "rloo.rloo_advantages": 4,
          "rloo.importance_weights": 3, "common.k3_kl": 3, "rloo.rloo_loss": 5,
          "grpo.grpo_advantages": 3, "grpo.grpo_loss": 5, "grpo.aggregate": 4, "ipo.ipo_loss": 3,
          "ipo.sequence_logp": 2, "ipo.rpo_nll": 2, "opd.opd_loss": 4, "rlt.reward_parts": 3,
          "rlt.rlt_reward": 2}
TWIN_OF = {"opd.rloo_advantages": "rloo.rloo_advantages", "rlt.grpo_advantages": "grpo.grpo_advantages",
           "rlt.rlt_loss": "grpo.grpo_loss"}


def grades(report):
    """{module.function: "passed" or its failure line}, from one run of tests/test_graded.py whose
    JUnit report goes to `report` (packed too)."""
    subprocess.run([sys.executable, "-m", "pytest", "tests/test_graded.py", "-n", "0", "-q",
                    "-p", "no:cacheprovider", f"--junitxml={report}"], cwd=ROOT, capture_output=True)
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


def code_points(result):
    """Points earned per graded function: all or nothing, twins included."""
    earned = {}
    for q, pts in POINTS.items():
        twins = [t for t, orig in TWIN_OF.items() if orig == q]
        earned[q] = pts if all(result.get(x) == "passed" for x in [q, *twins]) else 0
    return earned


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="submission.tar.gz", help="the archive to write")
    p.add_argument("--runs", default="out", help="where the runs' summary.json and metrics.jsonl are")
    a = p.parse_args()
    tmp = tempfile.mkdtemp()
    result = grades(os.path.join(tmp, "graded.xml"))
    if not result:
        sys.exit("error: tests/test_graded.py ran no graded test: run this from the repo's venv")
    earned = code_points(result)
    runs = sorted(glob.glob(os.path.join(ROOT, a.runs, "**", "summary.json"), recursive=True)
                  + glob.glob(os.path.join(ROOT, a.runs, "**", "metrics.jsonl"), recursive=True))
    summary = {"graded": result, "code_points": earned, "code_points_total": sum(earned.values()),
               "code_points_possible": sum(POINTS.values()),
               "runs": {os.path.relpath(r, ROOT): _pass1(r) for r in runs if r.endswith("summary.json")}}
    path = os.path.join(tmp, "grades.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    with tarfile.open(a.out, "w:gz") as tar:
        for f in FILES + [os.path.relpath(r, ROOT) for r in runs]:
            if os.path.isfile(os.path.join(ROOT, f)):
                tar.add(os.path.join(ROOT, f), arcname=f)
        tar.add(path, arcname="grades.json")
        tar.add(os.path.join(tmp, "graded.xml"), arcname="graded.xml")
    for q, status in result.items():
        print(f"{'ok  ' if status == 'passed' else 'FAIL'} {q}" + ("" if status == "passed" else f": {status}"))
    print(f"code points: {summary['code_points_total']} of {summary['code_points_possible']}")
    for r, p1 in summary["runs"].items():
        print(f"run: {r}: test pass@1 {p1}")
    if not summary["runs"]:
        print(f"no evaluation under {a.runs}/: run ./run_cpu.sh (docs/assignment.md, Runs)")
    print(f"wrote {a.out}")


def _pass1(path):
    try:
        return round(json.load(open(path))["pass_at_k"]["1"], 3)
    except (KeyError, ValueError, OSError):
        return None


if __name__ == "__main__":
    main()
