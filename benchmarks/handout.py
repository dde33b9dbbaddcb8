"""A course's handout: a copy of this repo (its git-tracked files) in which the named functions keep
their signature and docstring and lose their body, for students to write. tests/test_graded.py
grades each one (docs/exercises.md, "For instructors", has the list and what to assign).

  python benchmarks/handout.py ../handout rloo.rloo_advantages rloo.rloo_loss grpo.grpo_advantages
  cd ../handout && python -m pytest tests/test_graded.py -n 0    # fails, naming each one
"""
import ast
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blank(source, name):
    """`source` with the top-level function `name`'s body replaced by its docstring and
    `raise NotImplementedError`, every other line as it was."""
    fn = next((n for n in ast.parse(source).body
               if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        raise SystemExit(f"error: no top-level function {name}")
    lines = source.splitlines(keepends=True)
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    indent = " " * body[0].col_offset
    stub = f"{indent}raise NotImplementedError(\"{name}: write its body\")\n"
    return "".join(lines[:body[0].lineno - 1] + [stub] + lines[fn.end_lineno:])


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    out, names = sys.argv[1], sys.argv[2:]
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        os.makedirs(os.path.join(out, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(out, f))
    for qualified in names:
        module, _, name = qualified.partition(".")
        path = os.path.join(out, f"{module}.py")
        with open(path) as fh:
            source = fh.read()
        with open(path, "w") as fh:
            fh.write(blank(source, name))
        print(f"blanked {qualified}")
    print(f"wrote {out}: grade with `python -m pytest tests/test_graded.py -n 0` there")
