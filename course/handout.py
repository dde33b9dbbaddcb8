"""A course's handout: a copy of this repo (its git-tracked files, the instructor's side left out:
INSTRUCTOR) in which the graded functions of the parts asked for keep their signature and docstring
and lose their body, for students to write. tests/test_graded.py checks each on the visible cases;
course/assignment.md is the students' page, course/instructor.md the key that stays with the instructor,
course/grade.py the grading on the instructor's side.

  python course/handout.py ../handout                 # every part, the optional grpo_family too
  python course/handout.py ../handout rloo grpo       # some parts (or module.function names)
  cd ../handout && python -m pytest tests/test_graded.py -n 0    # fails, naming each blank

Where a blanked body has a twin in another file (a copy, or a function that contains its lines),
the twin is blanked with it: no line of an answer is left anywhere in the copy (tests/test_graders.py
makes every part's handout and checks).
"""
import ast
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the assignment's parts (course/assignment.md): the functions a student writes in each
PARTS = {
    "verifier": ["verifier.score", "verifier.dense_score"],
    "sft": ["sft.sft_loss"],
    "ipo": ["ipo.ipo_loss", "ipo.sequence_logp", "ipo.rpo_nll"],
    "rloo": ["rloo.rloo_advantages", "rloo.importance_weights", "common.k3_kl", "rloo.rloo_loss"],
    "grpo": ["grpo.grpo_advantages", "grpo.grpo_loss", "grpo.aggregate"],
    "opd": ["opd.opd_loss"],
    "rlt": ["rlt.reward_parts", "rlt.rlt_reward"],
    # the optional part, not in the short track: extra points over the seven parts' 100 (course/submit.py's EXTRA).
    # No twin: grpo_loss calls these two, it holds none of their lines
    "grpo_family": ["grpo.sequence_log_ratio", "grpo.cispo_surrogate"],
}
# each script reads alone, so a few lessons have a twin in another script: blanked together
TWINS = {
    "rloo.rloo_advantages": ["opd.rloo_advantages"],  # OPD's Algorithm 1 takes RLOO's advantage
    "rloo.importance_weights": ["opd.opd_loss"],  # OPD's loss holds RLOO's w, its PG term, its KL
    "rloo.rloo_loss": ["opd.opd_loss"],
    "opd.opd_loss": ["rloo.rloo_loss", "rloo.importance_weights"],
    "grpo.grpo_advantages": ["rlt.grpo_advantages"],  # RLT's update is GRPO's (004 Eq. 6)
    "grpo.grpo_loss": ["rlt.rlt_loss"],
}
# the instructor's side, the one list of it: what a handout leaves out (recorded in its handout.json, where
# tests/test_docs.py reads which paths a page may name that the copy lacks), what grade.py needs to grade
# (it refuses where one is missing: a handout), what no test of the students' copy may name. The key
# (the measured answers, the rubric), the graders' own tests (with the mistakes they are graded against,
# which quote the reference code), the hidden cases, and the tools that make handouts and grade them
INSTRUCTOR = ["course/instructor.md", "tests/test_graders.py", "course/hidden_cases.py", "course/handout.py",
              "course/grade.py", "course/gradescope/setup.sh", "course/gradescope/run_autograder"]
LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def function_node(source, name):
    """The top-level `def name` of `source` (its ast node), or None."""
    return next((n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def blank(source, name):
    """`source` with the top-level function `name`'s body replaced by its docstring and
    `raise NotImplementedError`, every other line as it was."""
    fn = function_node(source, name)
    if fn is None:
        raise SystemExit(f"error: no top-level function {name}")
    lines = source.splitlines(keepends=True)
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    indent = " " * body[0].col_offset
    stub = f"{indent}raise NotImplementedError(\"{name}: write its body\")\n"
    return "".join(lines[:body[0].lineno - 1] + [stub] + lines[fn.end_lineno:])


def to_blank(asked):
    """The qualified functions a handout of `asked` (parts or module.function names) blanks: each,
    its twins and theirs."""
    out = []
    for name in asked:
        if name not in PARTS and "." not in name:
            raise SystemExit(f"error: {name!r} is no part ({', '.join(PARTS)}) and no module.function")
        todo = list(PARTS.get(name, [name]))
        while todo:  # a twin's twins too
            q = todo.pop(0)
            if q not in out:
                out.append(q)
                todo += TWINS.get(q, [])
    return out


def graded(parts):
    """The functions graded in `parts` (tests/test_graded.py's table, twins included), in its
    order: a twin blanked for a part not handed out (opd.opd_loss with RLOO's) is not among them."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_graded import GRADED
    return [f"{e.module}.{e.function}" for e in GRADED if e.part in parts]


def body_lines(source, name):
    """The code lines of function `name`'s body in `source`, stripped, with no comment: what a
    handout must not leave anywhere. Lines under 16 characters but spaces (`return adv`,
    `"terms": terms}`) are a function's shape, not its answer, and are left out."""
    fn = function_node(source, name)
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    lines = [x.split("  #")[0].strip() for x in source.splitlines()[body[0].lineno - 1:fn.end_lineno]]
    return [x for x in lines if len("".join(x.split())) >= 16 and not x.startswith("#")]


def unlinked(text, page):
    """A markdown page's text with each link to a file the handout leaves out made plain text."""
    def plain(m):
        target = os.path.normpath(os.path.join(os.path.dirname(page), m.group(2)))
        return m.group(1) if target in INSTRUCTOR else m.group(0)
    return LINK.sub(plain, text)


def make(out, asked):
    """Write the handout of `asked` to `out` (and handout.json in its course/: the parts and graded
    functions, which submit.py reads, and the paths left out, INSTRUCTOR, which tests/test_docs.py
    reads); returns the qualified functions blanked."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if f in INSTRUCTOR or not os.path.isfile(os.path.join(ROOT, f)):
            continue
        os.makedirs(os.path.join(out, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(out, f))
        if f.endswith(".md"):  # no link to the key from the student's pages
            with open(os.path.join(out, f), encoding="utf-8") as fh:
                text = fh.read()
            with open(os.path.join(out, f), "w", encoding="utf-8") as fh:
                fh.write(unlinked(text, f))
    names = to_blank(asked)
    parts = [p for p in PARTS if p in asked or any(q in PARTS[p] for q in asked)]
    with open(os.path.join(out, "course", "handout.json"), "w") as fh:
        json.dump({"parts": parts, "blanked": names, "graded": graded(parts), "left_out": INSTRUCTOR}, fh, indent=1)
    for qualified in names:
        module, _, name = qualified.rpartition(".")
        path = os.path.join(out, module.replace(".", "/") + ".py")
        with open(path) as fh:
            source = fh.read()
        with open(path, "w") as fh:
            fh.write(blank(source, name))
    # a git repository of its own, made after the blanking (no answer in its history), one commit:
    # the students' history starts there, and the suite's layout checks (git ls-files) see the copy
    # as a clone sees the repo
    git = ["git", "-c", "user.name=handout", "-c", "user.email=handout@localhost", "-c", "init.defaultBranch=main"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", f"handout: {', '.join(asked)}"]):
        subprocess.run(git + command, cwd=out, check=True, capture_output=True)
    return names


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    blanked = make(sys.argv[1], sys.argv[2:] or list(PARTS))
    print(f"blanked {len(blanked)} functions: {', '.join(blanked)}")
    print(f"wrote {sys.argv[1]}: students check with `python -m pytest tests/test_graded.py -n 0` there and "
          f"submit with course/submit.py; grade their archives here with course/grade.py")
