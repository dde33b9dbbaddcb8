"""The reader's path as the README promises it: one RL step readable in its script and four helper
modules, flags in at most three levels, the plain sampler short enough to read, benchmarks/ holding
only what is used, and README's file table telling each file's real length."""
import ast
import dataclasses
import importlib
import os
import re

import pytest
from conftest import ROOT

SCRIPTS = ["sft", "ipo", "rloo", "grpo", "opd", "rlt"]
RL = ["rloo", "grpo", "opd", "rlt"]
LOCAL = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}


def project_imports(name):
    """The repo's modules a file imports anywhere in it (top level or inside a function)."""
    out = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, name + ".py")).read())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.split(".")[0])
    return out & LOCAL


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_imports_at_most_five_modules_and_no_other_script(script):
    mods = project_imports(script)
    assert len(mods) <= 5, f"{script}.py imports {len(mods)} of the repo's modules: {sorted(mods)}"
    assert not mods & set(SCRIPTS), f"{script}.py imports another algorithm: {sorted(mods & set(SCRIPTS))}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_flags_come_from_at_most_three_levels(script):
    """The script's Args, the RL scripts' base, the shared base: no deeper."""
    levels = [c for c in importlib.import_module(script).Args.__mro__ if dataclasses.is_dataclass(c)]
    assert len(levels) <= 3, f"{script}.Args: {[c.__name__ for c in levels]}"


@pytest.mark.parametrize("script", RL)
def test_an_rl_step_shows_every_stage_in_its_loop(script):
    """Sample, score, advantage, log-probs, loss, backward and the optimizer step are each a line of
    the script's own loop, not a call deep in a helper."""
    tree = ast.parse(open(os.path.join(ROOT, script + ".py")).read())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For))  # `for step in run.steps()`
    calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
             for n in ast.walk(loop) if isinstance(n, ast.Call)}
    stages = {"sample": {"rollouts", "explain_fn"}, "score": {"score_rollouts", "score_fn"},
              "advantage": {f"{a}_advantages" for a in ("rloo", "grpo")}, "log-probs": {"token_stats"},
              "loss": {f"{script}_loss", "rloo_loss"}, "backward": {"backward"},
              "optimizer step": {"optimizer_step"}}
    missing = [stage for stage, names in stages.items() if not names & calls]
    assert not missing, f"{script}.py's loop does not show: {missing}"


def test_the_plain_sampler_is_short_enough_to_read_and_benchmarks_hold_only_what_is_used():
    assert len(open(os.path.join(ROOT, "sampler.py")).read().splitlines()) <= 420
    bench = os.path.join(ROOT, "benchmarks")
    files = [f for f in os.listdir(bench) if os.path.isfile(os.path.join(bench, f))]
    total = sum(len(open(os.path.join(bench, f)).read().splitlines()) for f in files)
    assert total <= 1700, f"benchmarks/ has {total} lines (budget 1,700)"
    used = "".join(open(os.path.join(ROOT, p)).read() for p in ["README.md", "run_cpu.sh"] + [
        os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")] + [
        os.path.join("tests", f) for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")] + [
        os.path.join("benchmarks", f) for f in files])
    unused = [f for f in files if not re.search(rf"\b{re.escape(os.path.splitext(f)[0])}\b",
                                                used.replace(open(os.path.join(bench, f)).read(), ""))]
    assert not unused, f"benchmarks/ files no README, guide, test or other benchmark uses: {unused}"


def test_readme_file_table_tells_each_files_length():
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text[text.index("## Files"):]
    rows = re.findall(r"^(\S+\.(?:py|sh))\s+(\d+)  ", block, re.M)
    assert len(rows) >= 20
    wrong = {f: (int(n), len(open(os.path.join(ROOT, f)).read().splitlines())) for f, n in rows
             if int(n) != len(open(os.path.join(ROOT, f)).read().splitlines())}
    assert not wrong, f"README's Files table (file: (printed, real)): {wrong}"
    listed = {f for f, _ in rows}
    assert {f"{m}.py" for m in LOCAL} <= listed, sorted({f"{m}.py" for m in LOCAL} - listed)
