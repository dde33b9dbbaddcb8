"""What a reader meets first holds: README's Table 1 is docs/results.json's, every result README
quotes is that run's, every link resolves, and every exercise runs as printed (for 2 steps)."""
import glob
import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from plumbing import report
from course.exercises import exercises, run
from conftest import ROOT

README = open(os.path.join(ROOT, "README.md")).read()
RESULTS = json.load(open(os.path.join(ROOT, "docs/results.json")))
RUNS = report.fresh_runs()


def section(text, title):
    """The text of `## title` up to the next `## `."""
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_table_1_is_docs_results_json_to_the_digit():
    table = README.split(report.TABLE_START + "\n", 1)[1].split("\n" + report.TABLE_END, 1)[0]
    assert table == report.readme_table(RESULTS, RUNS), \
        "README's Table 1 is not docs/results.json's: python evaluate.py --run out/cpu --publish"


def result_numbers(results):
    """Every way README may print a number of this run: a pass@k, an interval, a rate (also as a
    percentage), and the difference of two stages' pass@k."""
    out = set()
    for r in results.values():
        vals = list(r["pass_at_k"].values()) + [r["format_rate"], 1.96 * r["pass_at_1_stderr"]]
        vals += list(r.get("mistakes", {}).values()) + [r.get("arithmetic", {}).get("false_claims", 0)]
        vals += [sum(v for k, v in r.get("mistakes", {}).items() if k != "giveup")]
        vals += [s["share"] for s in r.get("strategies", {}).values()]
        out |= {f"{v:.3f}" for v in vals} | {f"{100 * v:.1f} %" for v in vals}
        out |= {f"{100 * v:.0f} %" for v in vals}
    for k in ("1", "16"):  # a difference as computed, or of the two numbers as printed
        for a in results.values():
            for b in results.values():
                x, y = a["pass_at_k"][k], b["pass_at_k"][k]
                d = {x - y, round(x, 3) - round(y, 3)}
                out |= {f"{v:+.3f}" for v in d} | {f"{abs(v):.3f}" for v in d}
    for run in RUNS:  # the fresh-clone runs' numbers, and differences within one run
        for k in ("pass@1", "pass@16"):
            out |= {f"{v:.3f}" for v in run[k].values()}
            out |= {f"{x - y:+.3f}" for x in run[k].values() for y in run[k].values()}
            out |= {f"{abs(x - y):.3f}" for x in run[k].values() for y in run[k].values()}
    return out


def test_every_fresh_run_is_in_docs_results_md():
    """docs/fresh_runs.json (README's ranges) and docs/results.md (the runs, labelled) agree: each
    run's every pass@1 and pass@16 is printed in the results.md section it names."""
    text = open(os.path.join(ROOT, "docs/results.md")).read()
    assert len(RUNS) >= 1  # a series starts anew when the models change (the tokenizer's: results.md)
    for run in RUNS:
        where = run["where"].split(", ", 1)[1]
        heads = [h for h in re.split(r"\n(?=#+ )", text) if where.lower() in h.split("\n")[0].lower()]
        assert heads, f"{run['run']}: no section of docs/results.md names {where}"
        for k in ("pass@1", "pass@16"):
            missing = [s for s, v in run[k].items() if not any(f"{v:.3f}" in h for h in heads)]
            assert not missing, f"{run['run']}: {k} of {missing} not in docs/results.md's {where} section"


def test_readme_findings_hold_in_every_fresh_run():
    """What README says holds "in every one of those runs" is computed from docs/fresh_runs.json: a
    run added there that breaks a range fails here until README says so."""
    text = section(README, "What you should see")

    def span(f):
        values = [f(r["pass@1"], r["pass@16"]) for r in RUNS]
        return min(values), max(values)
    gain = {s: span(lambda p1, p16: p1[s] - p1["sft"]) for s in ("rloo", "grpo", "ipo")}
    breadth_lost = span(lambda p1, p16: p16["sft"] - p16["rloo"])
    opd_breadth = span(lambda p1, p16: p16["opd"] - p16["rloo"])
    opd_p1 = span(lambda p1, p16: p1["opd"] - p1["rloo"])
    grpo_above = sum(r["pass@16"]["grpo"] > r["pass@16"]["rloo"] for r in RUNS)
    def rng(lo_hi, fmt="+.3f"):  # "+0.143 to +0.204", or one value where the runs agree (one run)
        lo, hi = (format(x, fmt) for x in lo_hi)
        return lo if lo == hi else f"{lo} to {hi}"
    claims = [f"RLOO {rng(gain['rloo'])}",
              f"GRPO {rng(gain['grpo'])} over SFT",
              f"({rng(gain['ipo'])})",
              f"falls below SFT's ({rng(breadth_lost, '.3f')})",
              f"(in {grpo_above} of the {len(RUNS)} runs)" if len(RUNS) > 1 else
              "GRPO's stays above RLOO's" if grpo_above else "GRPO's falls below RLOO's too",
              f"pass@16 {rng(opd_breadth)} over RLOO's",
              f"near RLOO's ({rng(opd_p1)})".replace("-", "−")]
    assert breadth_lost[0] > 0 and opd_breadth[0] > 0 and min(g[0] for g in gain.values()) > 0
    missing = [c for c in claims if c not in text]
    assert not missing, f"README's findings do not say what every fresh run shows: {missing}"


def test_every_result_in_readme_is_the_current_runs():
    """Outside the H100 walkthrough (the papers' numbers), a number with three decimals or a
    percentage with one is a result: it must be docs/results.json's, or a difference of two of its
    pass@k. The table and the findings cannot drift from the run that wrote the file."""
    text = README.replace(section(README, "One H100"), "")
    found = re.findall(r"(?<![\w.])(?:[+−-]?\d\.\d{3}|\d+\.\d %)(?![\d.])", text)
    known = result_numbers(RESULTS)
    stray = [x for x in found if x.replace("−", "-") not in known]
    assert found and not stray, f"README quotes numbers docs/results.json does not have: {stray}"


def test_install_quotes_no_result_or_time_of_its_own():
    """install.sh quotes no result or time of its own (README has them). (The instructor's key is
    held to the runs it names by the instructor's own tests, left out of a handout with the key.)"""
    install = open(os.path.join(ROOT, "install.sh")).read()
    assert not re.findall(r"\d+(?:\.\d+)? ?(?:min|s\b|x\b|×)|twice", install), "install.sh quotes a time"


def test_readme_is_a_walkthrough_not_a_log():
    lines = README.splitlines()
    assert len(lines) <= 230, f"README has {len(lines)} lines (budget 230)"
    assert "docs/pass_at_k.png" in "\n".join(lines[:40]), "the pass@k picture is within the first 40 lines"
    titles = [line[3:] for line in lines if line.startswith("## ")]
    assert titles == ["Quickstart", "What you should see", "Read the code", "One H100", "More GPUs", "Exercises",
                      "When something goes wrong", "Tests", "Files"], titles
    hashes = re.findall(r"`[0-9a-f]{7,40}`|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", README)
    assert not hashes, f"README cites commits {hashes}: history goes to docs/results.md"
    assert not re.findall(r"[Ii]ssue \d+|#\d+\b", README), "README cites issue numbers"
    relative = re.findall(r"\b(?:today|yesterday|tomorrow|this (?:week|month))\b", README, re.I)
    assert not relative, f"README dates by {relative}: name the code or the date instead"


def test_every_page_quotes_the_pipelines_time_from_readmes_time_table():
    """README and the course pages say how long the pipeline runs in one wording, "about A-B min on a
    2-core machine", whose ends are the time table's fastest and slowest fresh-clone totals within a
    minute. Broken on purpose (a course page's 20-35 min, README's 20-30 without "about"), it failed."""
    totals = [int(m) + int(s) / 60 for m, s in
              re.findall(r"^\|.*\| \**(\d+) min (\d+) s\** \|$", section(README, "Quickstart"), re.M)]
    assert len(totals) >= 3, "README's time table has no totals"
    pages = ["README.md"] + [p for p in PAGES if p.startswith("course/")]
    quotes = {}
    for page in pages:  # a sentence about the pipeline that names a range of minutes
        text = " ".join(open(os.path.join(ROOT, page)).read().split())
        for sentence in re.split(r"(?<=\.)\s", text):
            if re.search(r"pipeline|run_cpu\.sh|every stage", sentence):
                quotes.setdefault(page, []).extend(
                    m.group(0) for m in re.finditer(r"(?:about )?\d+-\d+ min\w*(?: on a 2-core machine)?", sentence))
    assert {"README.md", "course/assignment.md"} <= set(quotes), quotes
    low, high = min(totals), max(totals)
    for page, found in quotes.items():
        for q in found:
            m = re.fullmatch(r"about (\d+)-(\d+) min on a 2-core machine", q)
            assert m, f"{page}: {q!r}, not \"about A-B min on a 2-core machine\""
            a, b = map(int, m.groups())
            assert abs(a - low) < 1 and abs(b - high) < 1, \
                f"{page}: {q!r}, but README's time table runs {low:.1f}-{high:.1f} min"


def test_each_exercises_lr_is_the_multiple_of_the_setups_it_says():
    """An exercise that says "N× the lr" (or the learning rate "N-fold") runs N times the setup's RL
    lr, to N's digits. Broken on purpose (exercise 1's "4× the lr" at 2e-4 over 6.7e-5), it failed."""
    base = float(re.search(r"^RL=.*?--lr (\S+)", SETUP, re.M).group(1))
    text = section(README, "Exercises")
    said = 0
    for item in re.split(r"\n(?=\d+\. \*\*)", text)[1:]:
        number = item.split(".", 1)[0]
        claims = re.findall(r"(\d+(?:\.\d+)?)(?:×|-fold| times) the (?:lr|learning rate)|"
                            r"(?:lr|learning rate) (\d+(?:\.\d+)?)(?:×|-fold| times)", item)
        for claim in (a or b for a, b in claims):
            lrs = re.findall(r"--lr (\S+)", item.split("```bash", 1)[1])
            assert lrs, f"exercise {number} says {claim}x the lr and sets none"
            ratio = float(lrs[0]) / base
            digits = len(claim.split(".")[1]) if "." in claim else 0
            assert round(ratio, digits) == float(claim), \
                f"exercise {number} says {claim}x the lr; --lr {lrs[0]} over $RL's {base:g} is {ratio:.2f}x"
            said += 1
    assert said >= 2, "README's exercises name no multiple of the lr"


def markdown_links(path, anchors=False):
    """The local targets of [text](target) in a markdown file, inline code left out: the path (the
    page itself for `#anchor`), and with anchors=True (path, anchor or None)."""
    text = re.sub(r"`[^`\n]*`", "", open(path).read())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"(https?|mailto):", target):
            file, _, anchor = target.partition("#")
            file = file or os.path.basename(path)
            yield (file, anchor or None) if anchors else file


def heading_anchors(path):
    """The anchors GitHub gives a markdown file's headings (code blocks left out): the heading's text
    as rendered (a link's text, no backticks or emphasis), lowercased, every character but letters,
    digits, `_`, `-` and spaces dropped, spaces to hyphens; a repeated one gets -1, -2, ..."""
    text = re.sub(r"^(```|~~~).*?^\1", "", open(path).read(), flags=re.M | re.S)
    seen, out = {}, set()
    for title in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out | set(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", text))


def test_heading_anchors_follow_githubs_slugs():
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
        f.write("# A page\n## RLOO (`rloo.py`) — paper 000 Eq. 3, Table 5\n```bash\n# a comment\n```\n"
                "## The task (`verifier.py`)\n## Notes\n## Notes\n### See [the code](x.py), §3.1.3\n")
    try:
        assert heading_anchors(f.name) == {"a-page", "rloo-rloopy--paper-000-eq-3-table-5", "the-task-verifierpy",
                                           "notes", "notes-1", "see-the-code-313"}
    finally:
        os.unlink(f.name)


def test_every_link_in_readme_and_docs_resolves():
    """Every link of README and the pages under docs/ and course/ reaches a file, and its #anchor, into
    a markdown file, one of that file's headings (GitHub's slug of it); every docs/ or course/ path a
    script or tool names exists, but in a handout one it leaves out on purpose (left_out(): its
    handout.json lists them). Broken on purpose (an anchor into docs/algorithms.md that names no
    heading), it failed."""
    pages = [os.path.join(ROOT, "README.md")] + [p for d in ("docs", "course")
                                                 for p in glob.glob(os.path.join(ROOT, d, "**/*.md"), recursive=True)]
    broken = [f"{os.path.relpath(p, ROOT)}: {t}" for p in pages for t in markdown_links(p)
              if not os.path.exists(os.path.join(os.path.dirname(p), t))]
    broken += [f"{os.path.relpath(p, ROOT)}: {t}#{a} (no such heading)" for p in pages
               for t, a in markdown_links(p, anchors=True) if a and t.endswith(".md")
               and os.path.exists(os.path.join(os.path.dirname(p), t))
               and a not in heading_anchors(os.path.join(os.path.dirname(p), t))]
    code = [p for pattern in ("*.py", "*.sh", "tests/*.py", "benchmarks/**/*", "course/**/*", "pretrained/*/README.md")
            for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
            if os.path.isfile(p) and "__pycache__" not in p]
    broken += [f"{os.path.relpath(p, ROOT)}: {t}" for p in code
               for t in re.findall(r"(?:docs|course)/[\w/.-]+\.(?:md|json|png|jsonl)", open(p).read())
               if not os.path.exists(os.path.join(ROOT, t)) and t not in left_out()]
    assert len(pages) > 10 and not broken, f"links to nothing: {broken}"


def test_every_study_opens_with_its_question_and_answer():
    """After its title and the line saying which base it was measured on (when it has one), a study's
    first two lines are its question and its answer."""
    pages = [p for p in glob.glob(os.path.join(ROOT, "docs/studies/*.md")) if not p.endswith("README.md")]
    lines = {os.path.basename(p): open(p).read().splitlines()[1:4] for p in pages}
    lines = {n: ls[1:] if ls[0].startswith("*Measured on") else ls[:2] for n, ls in lines.items()}
    bad = [n for n, (q, a) in lines.items() if not (q.startswith("**Question:**") and a.startswith("**Answer:**"))]
    assert len(pages) >= 9 and not bad, f"studies that do not open with their question and answer: {bad}"


def test_every_study_says_which_base_it_was_measured_on():
    """A study's numbers hold for the models it ran on: every page under docs/studies/ but its index
    and tokenizer.md (the page of the current base) says in its first 5 lines which base it was
    measured on (a line with "Measured on"), so a reader does not take them for the current models'.
    Broken on purpose (the line removed from strategies.md), it failed."""
    pages = [p for p in glob.glob(os.path.join(ROOT, "docs/studies/*.md"))
             if os.path.basename(p) not in ("README.md", "tokenizer.md")]
    bad = [os.path.basename(p) for p in pages
           if not any("Measured on" in line for line in open(p).read().splitlines()[:5])]
    assert len(pages) >= 9 and not bad, f"studies that do not say which base they were measured on: {bad}"


def test_the_grpo_family_study_quotes_no_kl_figure_its_tables_do_not_hold():
    """docs/studies/grpo_family.md's KL to π_ref is a column of its μ = 2 table only: a sentence of
    its prose about the KL quotes a figure of three decimals only where a table holds it. Broken on
    purpose (Dr. GRPO's KL at μ = 1, 0.013 against 0.019, in no table), it failed."""
    text = open(os.path.join(ROOT, "docs/studies/grpo_family.md")).read()
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    rows = [line for line in text.splitlines() if line.startswith("|")]
    held = {x for row in rows for x in re.findall(r"(?<![\d.])\d\.\d{3}(?![\d.])", row)}
    prose = " ".join(line for line in text.splitlines() if not line.startswith("|"))
    quoted = [(x, sentence) for sentence in re.split(r"(?<=[.;:])\s", prose) if re.search(r"\bKL\b", sentence)
              for x in re.findall(r"(?<![\w.])\d\.\d{3}(?![\d.])", sentence)]
    assert any("KL" in row for row in rows), "the page has no table of the KL"
    stray = [f"{x}: {sentence[:100]}" for x, sentence in quoted if x not in held]
    assert quoted and not stray, f"KL figures in no table of the page: {stray}"


# README's exercises at toy size: each command as printed, then these flags, which win (argparse
# keeps the last), in a copy of out/cpu made of the shipped models
TOY = """#!/usr/bin/env bash
script=$1; shift
case $script in
  sft.py) extra=(--max_steps 2 --eval_every 2 --save_every 1 --batch_size 4 --micro_batch 4
                 --eval_problems 2 --eval_samples 2 --eval_max_new_tokens 8 --no-compile);;
  rloo.py|grpo.py|opd.py) extra=(--max_steps 2 --eval_every 2 --save_every 1 --batch_size 2
                 --group_size 3 --micro_batch 4 --max_response_len 12 --eval_problems 2
                 --eval_samples 2 --eval_max_new_tokens 8);;
  evaluate.py) extra=(--num_problems 2 --num_samples 16 --max_new_tokens 8 --steps 1-100000);;
  *) exec "$PY" "$script" "$@";;
esac
exec "$PY" "$ROOT/$script" "$@" "${extra[@]}"
"""
SETUP, ITEMS = exercises()


@pytest.fixture(scope="module")
def out_cpu(tmp_path_factory):
    """A directory whose out/cpu has what the exercises read: the shipped base (standing in for
    sft too), the teacher, a metrics.jsonl for rloo and grpo, the SFT model's test summary."""
    d = tmp_path_factory.mktemp("exercises")
    for name, src in (("base", "tiny-base"), ("sft", "tiny-base"), ("teacher", "tiny-teacher")):
        shutil.copytree(os.path.join(ROOT, "pretrained", src), d / "out/cpu" / name)
    for name in ("rloo", "grpo"):
        rows = [{"step": s, "train/reward": 0.3, "train/zero_adv_groups": 0.2} for s in range(1, 51)]
        os.makedirs(d / "out/cpu" / name)
        (d / "out/cpu" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "out/cpu/path.env").write_text("export COUNTDOWN_CPU_BF16=0\nexport SFT_CPU_BF16=0\n")
    os.makedirs(d / "out/cpu/eval/sft")
    (d / "out/cpu/eval/sft/summary.json").write_text(json.dumps(RESULTS["sft"]))
    (d / "bin").mkdir()
    (d / "bin/python").write_text(TOY)
    (d / "bin/python").chmod(stat.S_IRWXU)
    return d


@pytest.mark.parametrize("number,title,commands", ITEMS, ids=[f"{n}" for n, _, _ in ITEMS])
def test_each_readme_exercise_runs_as_printed_for_2_steps(number, title, commands, out_cpu):
    env = dict(os.environ, PATH=f"{out_cpu / 'bin'}:{os.environ['PATH']}", PY=sys.executable, ROOT=ROOT)
    log = out_cpu / f"{number}.log"
    rc = run(SETUP, commands, out_cpu, log, env)
    text = log.read_text()
    assert rc == 0, f"exercise {number} ({title}) failed:\n{text[-3000:]}"
    assert "run (steps" in text, f"exercise {number} prints no evaluate.py --compare table"
    rows = [line for line in text.splitlines() if line.startswith("out/ex/")]
    assert rows, f"exercise {number} compares none of its own runs"
    assert not [r for r in rows if re.search(r"\s-(\s|$)", r)], \
        f"exercise {number} compares a key its runs do not log:\n{text[-1500:]}"


def one_step_rows():
    """docs/one_step.md's table rows: (file, function) in the order the page lists them."""
    text = open(os.path.join(ROOT, "docs/one_step.md")).read()
    return re.findall(r"^\| \d+ \| `([\w/]+\.py)` \| `([\w.]+)` \|", text, re.M)


def test_readme_and_one_step_follow_the_step_the_code_runs(tiny_ckpt, tmp_path, monkeypatch):
    """README's "Read the code" and docs/one_step.md say which files and functions one RL step runs
    through, and that the update is computed in rloo.py, common.py and verifier.py. One default CPU
    step of rloo.py (the shared forward, the fast decoder), followed with sys.setprofile: the files
    it enters are the ones README names; docs/one_step.md's rows are entered in the page's order,
    every function of rloo.py, common.py and verifier.py the step enters is a row, and every file
    it enters is named there; from the end of its sampling to its non-finite check (forward, loss,
    backward, clip) it enters no repo file but the lesson's, the forward's fast path and precision,
    and the run's sums and finite check. Broken on purpose: README without `traces.py`, the loss's
    k3 moved to plumbing/ (both failed before this page); two rows of docs/one_step.md swapped, and
    one row (`common.py` `pack`) deleted, each failed."""
    import rloo
    from conftest import GEN
    from plumbing import harness
    text = section(README, "Read the code")
    named = {f if "/" in f or os.path.exists(os.path.join(ROOT, f)) else f"plumbing/{f}"  # plumbing/'s by name
             for f in re.findall(r"`([\w/]+\.py)`", text) if not f.startswith("benchmarks/")}  # a benchmark cited
    seen, order, phase = {}, [], {"now": None}

    def profile(frame, event, arg):
        f = frame.f_code.co_filename
        if phase["now"] and f.startswith(ROOT + os.sep) and not f.startswith((
                os.path.join(ROOT, ".venv"), os.path.join(ROOT, "tests"))):
            rel = os.path.relpath(f, ROOT)
            seen.setdefault("step" if phase["now"] == "after" else phase["now"], set()).add(rel)
            name = frame.f_code.co_qualname
            if phase["now"] != "after" and event == "call" and "<" not in name and (rel, name) not in order:
                order.append((rel, name))  # to the non-finite check: docs/one_step.md's span
    steps, sampled, finite = harness.Run.steps, harness.Run.sampled, harness.Run.finite

    def traced_steps(run):
        for step in steps(run):
            phase["now"] = "step"
            sys.setprofile(profile)
            yield step
            sys.setprofile(None)

    def traced_sampled(run):
        sampled(run)
        phase["now"] = "update"

    def traced_finite(run, *a):
        ok = finite(run, *a)
        phase["now"] = "after"  # log, evaluate, save: README's files, not docs/one_step.md's rows
        return ok
    monkeypatch.setattr(harness.Run, "steps", traced_steps)
    monkeypatch.setattr(harness.Run, "sampled", traced_sampled)
    monkeypatch.setattr(harness.Run, "finite", traced_finite)
    try:
        rloo.main(["--init", tiny_ckpt, "--data", GEN, "--eval_data", GEN, "--template", "compact",
                   "--eval_problems", "2", "--eval_samples", "1", "--eval_max_new_tokens", "4", "--batch_size", "2",
                   "--group_size", "4", "--max_response_len", "8", "--max_steps", "1", "--output_dir", str(tmp_path)])
    finally:
        sys.setprofile(None)
    touched = seen["step"] | seen["update"]
    assert touched == named, f"the step runs through {sorted(touched)}; README names {sorted(named)}"
    # distributed.py: in one process a lookup that finds no DDP wrapper and sums nothing over ranks
    assert seen["update"] <= {"rloo.py", "common.py", "verifier.py", "plumbing/harness.py", "plumbing/checkpoints.py",
                              "plumbing/models.py", "plumbing/distributed.py", "plumbing/shared_prompts.py"}, \
        sorted(seen["update"])
    assert {"rloo.py", "common.py"} <= seen["update"]
    rows = one_step_rows()
    assert len(rows) >= 30, rows
    where = {call: i for i, call in enumerate(order)}
    missing = [r for r in rows if r not in where]
    assert not missing, f"docs/one_step.md lists calls the step never makes: {missing}"
    out_of_order = [(a, b) for a, b in zip(rows, rows[1:]) if where[a] > where[b]]
    assert not out_of_order, f"docs/one_step.md's order is not the step's: {out_of_order}"
    lesson = [c for c in order if c[0] in ("rloo.py", "common.py", "verifier.py") and c not in rows]
    assert not lesson, f"the step enters lesson functions docs/one_step.md does not list: {lesson}"
    unnamed = {f for f, _ in order} - {f for f, _ in rows}
    assert not unnamed, f"docs/one_step.md names no row of {sorted(unnamed)}"


# ---- every name a page uses exists -----------------------------------------------------------------
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for pattern in ("docs/**/*.md", "course/**/*.md")
                               for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))
TOP = ("benchmarks", "course", "docs", "plumbing", "pretrained", "tests", ".ci")
# flags of the tools around the scripts (pip, torchrun, docker), not of this repo's
OTHERS = {"--nproc_per_node", "--no-compile", "--index-url", "--dry-run", "--ignore-installed", "--report",
          "--network", "--rm", "--help"}


def repo_flags():
    """Every --flag of the repo's commands: the scripts' Args dataclasses (each field, with dashes,
    and --no-x for a bool), the argparse flags of plumbing/, benchmarks/ and course/, run_cpu.sh's."""
    import dataclasses
    import importlib
    out = set()
    for name in ("sft", "ipo", "rloo", "grpo", "opd", "rlt", "evaluate"):
        for f in dataclasses.fields(importlib.import_module(name).Args):
            for n in {f.name, f.name.replace("_", "-")}:
                out |= {f"--{n}", f"--no-{n}"} if f.type in (bool, "bool") else {f"--{n}"}
    for p in glob.glob(os.path.join(ROOT, "*", "*.py")) + glob.glob(os.path.join(ROOT, "*", "*", "*.py")):
        if os.sep + "." not in os.path.relpath(p, ROOT):
            out |= set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", open(p).read()))
            out |= set(re.findall(r"add_argument\([^)]*?\"(--[\w-]+)\"", open(p).read()))
            out |= set(re.findall(r"\"(--[\w-]+)\" in sys\.argv", open(p).read()))
    for p in glob.glob(os.path.join(ROOT, "*.sh")) + glob.glob(os.path.join(ROOT, "*", "*.sh")):
        for arm, quoted in re.findall(r"(--[\w-]+)\)|= \"(--[\w-]+)\"", open(p).read()):
            out.add(arm or quoted)  # a `case` arm (--plan) ...) or a test ([ "$1" = "--torchrun" ])
    return out


def left_out():
    """The instructor's paths a student's handout leaves out, from the handout.json in its course/ (the
    handout tool's one list of them); none in the repo itself, which has no handout.json."""
    path = os.path.join(ROOT, "course", "handout.json")
    return set(json.load(open(path)).get("left_out", [])) if os.path.exists(path) else set()


def test_every_path_and_flag_a_page_names_exists():
    """README and every page under docs/ and course/ name only files that exist (a repo path, or a
    bare `x.py` somewhere in the repo) and only flags some command of the repo takes (its --help).
    In a handout, a name of a path it leaves out on purpose (the instructor's, left_out()) is the
    repo's, not a broken one: a student's correct copy passes. Broken on purpose (README naming
    `benchmarks/rl_levers.sh`, a page naming `--mu_trainer`; a handout with no left_out list, whose
    README names the grading tools), it failed."""
    flags, bad, absent = repo_flags(), [], left_out()
    files = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "**", "*"), recursive=True)
             if ".venv" not in p} | {os.path.basename(p) for p in absent}
    for page in PAGES:
        text = re.sub(r"https?://\S+", "", open(os.path.join(ROOT, page)).read())
        for path in re.findall(rf"(?<![\w/.~$-])((?:{'|'.join(map(re.escape, TOP))})/[\w./-]*[\w/])", text):
            if not os.path.exists(os.path.join(ROOT, path)) and \
                    not any(x == path or x.startswith(path.rstrip("/") + "/") for x in absent):  # or its folder
                bad.append(f"{page}: {path}")
        for name in re.findall(r"(?<![\w/.~$-])([\w-]+\.(?:py|sh))\b", text):
            if name not in files:
                bad.append(f"{page}: {name}")
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text):
            if flag not in flags | OTHERS:
                bad.append(f"{page}: {flag}")
    assert not bad, f"names that do not exist: {sorted(set(bad))}"
