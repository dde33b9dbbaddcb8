"""README's exercises, run as printed: each one's commands after the section's setup lines, from the
directory that holds the first command's out/cpu, timed, their output to out/ex/NAME.log. The
numbers the instructor's key quotes are what this printed; tests/test_docs.py runs the same commands
for 2 steps each.

  python course/exercises.py              # every exercise, one after another
  python course/exercises.py 1 4          # exercises 1 and 4
"""
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exercises(readme=os.path.join(ROOT, "README.md")):
    """README's `## Exercises`: (the setup block, [(number, title, commands), ...]). The setup is
    the section's first ```bash block; every numbered, bold-titled item owns the block after it."""
    text = open(readme).read()
    section = text.split("\n## Exercises\n", 1)[1].split("\n## ", 1)[0]
    setup, *rest = re.split(r"\n(?=\d+\. \*\*)", section)
    blocks = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert len(blocks) == 1, "the Exercises section opens with one ```bash block of setup lines"
    items = []
    for item in rest:
        number, title = re.match(r"(\d+)\. \*\*(.+?)\*\*", item).groups()
        commands = re.findall(r"```bash\n(.*?)```", item, re.S)
        assert len(commands) == 1, f"exercise {number} has {len(commands)} ```bash blocks, not 1"
        items.append((int(number), title.rstrip("."), commands[0]))
    return blocks[0], items


def run(setup, commands, cwd, log, env=None):
    """Run one exercise's commands in bash after the setup lines; stop at the first failure."""
    with open(log, "w") as f:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", f"{setup}\n{commands}"], cwd=cwd,
                              env=env, stdout=f, stderr=subprocess.STDOUT).returncode


if __name__ == "__main__":
    setup, items = exercises()
    wanted = {int(a) for a in sys.argv[1:]}
    os.makedirs(os.path.join(ROOT, "out/ex"), exist_ok=True)
    # `python` in the commands is this interpreter, as in the venv README's exercises run in
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    for number, title, commands in items:
        if wanted and number not in wanted:
            continue
        log = os.path.join(ROOT, f"out/ex/{number}.log")
        t0 = time.time()
        rc = run(setup, commands, ROOT, log, env)
        wall = time.time() - t0
        print(f"== {number}. {title}: rc {rc}, {int(wall) // 60} min {int(wall) % 60:02d} s ({log})")
        # the lines that answer it: evaluate.py --compare's tables, evaluate.py's summary line
        for line in open(log).read().splitlines():
            if line.startswith(("run (steps", "out/", "pass@")) or "false" in line:
                print("   ", line)
        sys.stdout.flush()
