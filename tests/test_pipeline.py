"""run_cpu.sh's first run on a student's machine (issue 44): the cores shared among the stages side
by side (plumbing/pipeline.py), the console kept moving, a failure reported when it happens, and --compile
skipped with one line where it does not pay or cannot build."""
import importlib
import json
import os
import random
import shutil
import subprocess
import sys
import time

import pytest
import torch

from plumbing import flags
from plumbing import harness
from plumbing import machine
from plumbing.models import load_model
from plumbing import pipeline
from conftest import GEN, ROOT
import evaluate
import sft

UNITS = ["sft", "teacher", "grpo:sft", "opd:sft,teacher", "rloo:sft", "ipo:sft"]  # run_cpu.sh's
RLT_UNITS = ["sft", "teacher", "solver_student", "teacher_student:teacher", "rlt:sft,teacher,teacher_student",
             "grpo:sft", "opd:sft,teacher", "rloo:sft", "ipo:sft", "rlt_student:rlt"]  # with RLT=1


@pytest.mark.parametrize("cores,n,want", [(1, 1, [1]), (1, 3, [1, 1, 1]), (2, 1, [2]), (2, 2, [1, 1]),
                                          (8, 3, [3, 3, 2]), (12, 5, [3, 3, 2, 2, 2]), (4, 4, [1] * 4)])
def test_each_stage_side_by_side_gets_its_share_of_the_cores(cores, n, want):
    assert pipeline.shares(cores, n) == want


def plan(cores, serial=False, env=None):
    """`./run_cpu.sh --plan` on a machine with `cores` cores (CORES fakes the count): [(unit,
    threads)] of the stages that start first, and every line."""
    r = subprocess.run(["bash", "run_cpu.sh", "--plan", "/nonexistent/out"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "CORES": str(cores), "SERIAL": "1" if serial else "",
                                       "COMPILE": "", **(env or {})})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    first = [(x.split()[1], int(x.split()[4])) for x in lines if x.strip().startswith("0:00 ")]
    return first, lines


def test_more_cores_run_more_stages_at_once_and_serial_gives_one_all():
    assert plan(1)[0] == [("sft", 1)]
    assert plan(2)[0] == [("sft", 1), ("teacher", 1)]  # paper 000's table: the teacher's test beside sft
    assert plan(2, env={"COMPILE": "1"})[0] == [("sft", 2)]  # compiled, sft keeps its first threads: all
    rlt = {"RLT": "1"}  # paper 004's comparison too: its students start beside sft
    assert plan(2, env=rlt)[0] == [("sft", 1), ("teacher", 1)]
    assert plan(8, env=rlt)[0] == [("sft", 3), ("teacher", 3), ("solver_student", 2)]  # all that is ready
    for env, units in (({}, UNITS), (rlt, RLT_UNITS)):
        first, lines = plan(8, serial=True, env=env)
        assert first == [("sft", 8)] and sum(" starts on 8 threads" in x for x in lines) == len(units)
    assert not os.path.exists("/nonexistent/out")  # --plan runs nothing


def test_one_stage_more_than_cores_runs_at_once_so_no_stage_runs_alone_while_others_wait():
    """On 2 cores the three RL stages that need only sft start together on a thread each (a stage
    alone on two threads is only ~1.3x faster: the third keeps both cores busy), but never beside a
    unit others wait for (sft, RLT=1's teacher stages); on one core, one stage at a time. Broken on
    purpose: one unit a core again (grpo and opd started at 14:56, rloo at 39:06), the rule without
    its waited-for check (RLT=1's solver_student started beside sft), and without its count (a
    fourth unit started a second after the third, in a real run): each failed."""
    first, lines = plan(2)
    starts = {x.split()[1]: x.split()[0] for x in lines if " starts on " in x}
    assert starts["grpo"] == starts["opd"] == starts["rloo"] != starts["ipo"], lines
    assert all(" starts on 1 thread" in x for x in lines if x.split()[1:2] in (["grpo"], ["opd"], ["rloo"]))
    assert plan(2, env={"RLT": "1"})[0] == [("sft", 1), ("teacher", 1)]  # sft is waited for
    units = pipeline.parse_units(UNITS)  # the scheduler asks every second: never a fourth
    assert pipeline.start(units, ["grpo", "opd", "rloo", "ipo"], {}, 2, 2) == ["grpo", "opd", "rloo"]
    assert pipeline.start(units, ["ipo"], {"grpo": 0, "opd": 0, "rloo": 0}, 2, 2) == []
    assert pipeline.start(units, ["ipo"], {"grpo": 0, "opd": 0}, 2, 2) == ["ipo"]
    one = plan(1)[1]
    assert one[0].startswith("1 cores, 1 stage at once") and len({x.split()[0] for x in one[1:-1]}) == 6
    # the plan's clock: three units time-share two cores, none runs faster than on a core of its own
    steps, end = pipeline.plan(pipeline.parse_units(UNITS), 2, 2)
    work_after_sft = sum(pipeline.COST[u] for u in ("grpo", "opd", "rloo", "ipo"))
    assert end >= pipeline.COST["sft"] / 2 ** 0.63 + work_after_sft / 2


def test_a_users_omp_num_threads_is_the_core_count():
    env = {k: v for k, v in os.environ.items() if k != "CORES"}
    r = subprocess.run(["bash", "run_cpu.sh", "--plan", "/nonexistent/out"], cwd=ROOT, capture_output=True,
                       text=True, env={**env, "OMP_NUM_THREADS": "3"})
    assert r.returncode == 0 and r.stdout.startswith("3 cores"), r.stdout + r.stderr


def test_the_plan_puts_the_longest_chain_first():
    steps, end = pipeline.plan(pipeline.parse_units(RLT_UNITS), 2, 2)
    order = [u for _, u, _ in steps]
    assert order[:2] == ["sft", "teacher"] and order.index("rlt") < order.index("ipo")
    # one core: the sum of the costs; two: less than half again as long
    assert pipeline.plan(pipeline.parse_units(RLT_UNITS), 1, 1)[1] == sum(pipeline.COST[u.split(":")[0]]
                                                                          for u in RLT_UNITS)
    assert end < 0.6 * pipeline.plan(pipeline.parse_units(RLT_UNITS), 1, 1)[1]


# run_cpu.sh's python, faked: each call's arguments to $CALLS, an evaluation's summary.json, a stage's dir
FAKE_PY = r"""#!/usr/bin/env bash
[[ $1 == -c ]] && exec "$REAL_PYTHON" "$@"
echo "$*" >> "$CALLS"
while [[ $# -gt 0 ]]; do case $1 in
  --out) mkdir -p "$2"; echo '{"pass_at_k": {"1": 0.5, "16": 0.9}, "pass_at_1_stderr": 0.01}' > "$2/summary.json";;
  --output_dir) mkdir -p "$2";;
  --export) mkdir -p "$(dirname "$2")"; touch "$2";;
esac; shift; done
"""


def test_a_rerun_evaluates_only_what_changed_and_rlt_adds_the_students(tmp_path):
    fake, out, calls = tmp_path / "python", tmp_path / "out", tmp_path / "calls"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "CALLS": str(calls),
           "RLT": "", "RLT_CONTROL": "", "FORCE": ""}

    def unit(name, **extra):
        """`run_cpu.sh --unit NAME`: its console and the scripts it ran"""
        calls.write_text("")
        r = subprocess.run(["bash", "run_cpu.sh", "--unit", name, str(out)], cwd=ROOT, capture_output=True,
                           text=True, env={**env, **extra})
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout, [x.split()[0] for x in calls.read_text().splitlines()]

    o, c = unit("teacher")  # paper 000's table: the shipped teacher evaluated, no student
    assert c == ["evaluate.py"] and "teacher: test pass@1 0.500" in o
    teacher = out / "teacher" / "wall_seconds"
    os.utime(out / "eval" / "teacher" / "summary.json", ns=(teacher.stat().st_mtime_ns,) * 2)  # one tick
    o, c = unit("teacher")  # again: evaluated as it finished (the same timestamp), so nothing runs
    assert c == [] and "teacher: evaluated" in o
    o, c = unit("teacher_student", RLT="1")  # RLT=1: the teacher's accepted samples, its student
    assert c == ["evaluate.py", "sft.py", "evaluate.py"]
    summary, wall = out / "eval" / "teacher_student" / "summary.json", out / "teacher_student" / "wall_seconds"
    os.utime(summary, (time.time() - 60,) * 2)  # the stage finished again after its evaluation
    o, c = unit("teacher_student", RLT="1")
    assert c == ["evaluate.py"] and "teacher_student: finished" in o
    assert unit("teacher_student", RLT="1")[1] == [] and wall.exists()
    # RLT's unit (004 §A.1): the warm-up is the teacher's accepted samples of 2,000 other training problems,
    # rewritten as teacher examples; the reward's student is teacher_student unless RLT_STUDENT says sft
    o, c = unit("rlt", RLT="1")
    assert c == ["evaluate.py", "sft.py", "rlt.py"]
    export, warmup, teacher = calls.read_text().splitlines()
    assert "--split train --num_problems 2000 --skip_problems 2000" in export and f"--model {out}/teacher " in export
    warm = f"{out}/teacher/warmup.jsonl"
    assert f"--export {warm}" in export and f"--data rlt:{warm}" in warmup and f"--init {out}/sft " in warmup
    assert f"--init {out}/rlt_sft --student {out}/teacher_student " in teacher
    for d in ("rlt", "rlt_sft"):
        (out / d / "wall_seconds").unlink()
    o, c = unit("rlt", RLT="1", RLT_STUDENT="sft")  # the warm-up's data is kept; the stages run again
    assert c == ["sft.py", "rlt.py"] and f"--student {out}/sft " in calls.read_text().splitlines()[1]


FAKE = r"""
name=$1; out=$2; mkdir -p "$out/logs"; log=$out/logs/$name.log
echo "== $name: training (log: $log)"
echo "threads at start $OMP_NUM_THREADS" >> "$log"
case $name in
  short) for i in 1 2 3; do echo "step $i/3" >> "$log"; sleep 0.3; done;;
  long)  for i in $(seq 1 100); do echo "step $i/100" >> "$log"; sleep 0.1
           [[ $(cat "$COUNTDOWN_THREADS_FILE") == 2 && -f $out/short.done ]] && break; done
         echo "threads at end $(cat "$COUNTDOWN_THREADS_FILE")" >> "$log";;
  broken) echo "ValueError: something the user can read" >> "$log"; exit 3;;
esac
touch "$out/$name.done"
"""


def test_the_scheduler_hands_cores_on_reports_a_failure_at_once_and_keeps_the_console_moving(tmp_path):
    """On 2 cores `long` and `short` start on one thread each; when `short` ends, `broken` takes
    its slot and fails at once: it is reported with its log's last line while `long` still runs,
    its core goes to `long` (read from its threads file), and `after:broken` never runs. The
    status lines name each running stage and its step."""
    (tmp_path / "fake.sh").write_text(FAKE)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "plumbing.pipeline", "--out", str(tmp_path), "--cores", "2",
                        "--status_every", "0.5", "--command", f"bash {tmp_path}/fake.sh {{}} {tmp_path}",
                        "long", "short", "broken", "after:broken"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    out = r.stdout
    assert r.returncode == 1 and time.time() - t0 < 30, out + r.stderr
    assert "threads at start 1" in (tmp_path / "logs" / "long.log").read_text()
    assert "threads at end 2" in (tmp_path / "logs" / "long.log").read_text()  # short's core
    assert "error: broken failed (exit 3)" in out and "ValueError: something the user can read" in out
    assert out.index("error: broken failed") < out.index("== long: done")  # reported when it fails
    assert "not run: after" in out and not (tmp_path / "after.done").exists()
    status = [x for x in out.splitlines() if x.startswith("-- ")]
    assert status and any("long " in x and "/100 (" in x for x in status)


def test_a_training_loop_follows_its_thread_file(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    path = tmp_path / "threads"
    path.write_text("1")
    monkeypatch.setenv("COUNTDOWN_THREADS_FILE", str(path))
    try:
        flags.follow_threads()
        assert torch.get_num_threads() == 1
        path.write_text("2")
        flags.follow_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def sft_compile(tmp_path, env):
    r = subprocess.run([sys.executable, "sft.py", "--init", "tiny", "--tiny_hidden", "32", "--tiny_layers", "1",
                        "--data", GEN, "--eval_data", GEN, "--eval_problems", "2", "--eval_samples", "1",
                        "--eval_max_new_tokens", "8", "--batch_size", "2", "--micro_batch", "2", "--max_steps", "2",
                        "--compile", "--output_dir", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True,
                       # the child keeps this process's ATEN_CPU_CAPABILITY, so that it reads the capability
                       # the assertions below read (an AVX2 cap standing in for the common CPU kind)
                       env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), **env})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def test_sft_compile_runs_eager_with_one_line_without_a_cpp_compiler(tmp_path):
    """run_cpu.sh's SFT stage on a machine with no C++ compiler (a bare Ubuntu/WSL; macOS without
    libomp): one line, then eager steps, not inductor's InvalidCxxCompiler traceback."""
    out = sft_compile(tmp_path, {"CXX": "/nonexistent/g++"})
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert "--compile: skipped, no working C++ compiler" in out, out
    else:  # a CPU where the compile is skipped before the compiler is looked for
        assert "--compile: skipped on this" in out, out
    assert "step 2/2" in out


def test_sft_compile_is_skipped_where_it_was_measured_slower(tmp_path):
    out = sft_compile(tmp_path, {"ATEN_CPU_CAPABILITY": "avx2"})
    assert "--compile: skipped on this AVX2 CPU" in out and "step 2/2" in out


def test_compile_pays_on_avx512_with_a_compiler(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert harness.compile_pays("cpu") and harness.compile_pays("cuda")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not harness.compile_pays("cpu")


def test_the_path_probe_keeps_each_kinds_faster_precision(tmp_path, monkeypatch, capsys):
    """plumbing/machine.py: each candidate timed in alternating rounds after a warm-up, each round
    on new shapes, the faster precision kept for SFT steps and for RL updates apart, written for
    run_cpu.sh and said in one line; a candidate 2x slower in the warm-up is not timed again; the
    user's setting wins for both."""
    monkeypatch.delenv("COUNTDOWN_CPU_BF16", raising=False)
    cost = {("sft", True): 0.5, ("sft", False): 0.3, ("rl", True): 1.0, ("rl", False): 2.0}
    calls = []

    def fake(kind):  # SFT faster in fp32, RL in bf16 (as on the Xeon with AMX)
        def step(model, frozen_or_batch, *rest):
            bf16 = rest[-1]
            calls.append((kind, bf16, frozen_or_batch if kind == "sft" else rest[0]))
            time.sleep(cost[kind, bf16] / 100)
        return step

    monkeypatch.setattr(machine, "sft_step", fake("sft"))
    monkeypatch.setattr(machine, "rl_step", fake("rl"))
    monkeypatch.setattr(machine, "sft_shapes", lambda tok, flags, n: [f"step {i}" for i in range(n)])
    out = tmp_path / "path.env"
    machine.main(["--init", "tiny", "--cores", "2", "--out", str(out), "--", "--data", "gen:x"])
    line = capsys.readouterr().out
    assert out.read_text().endswith("export COUNTDOWN_CPU_BF16=1\nexport SFT_CPU_BF16=0\n")
    assert line.count("\n") == 1 and "SFT in fp32 (a step " in line and " in bf16, 2 threads)" in line
    assert "RL in bf16 (an update 0.08 s, 0.16 in fp32, 1 thread)" in line
    assert calls.count(("rl", False, 150)) == calls.count(("rl", True, 150)) == 1  # the warm-up's shape
    rounds = {c[2] for c in calls if c[0] == "sft"}
    assert len(rounds) >= 3 and len({c[2] for c in calls if c[0] == "rl"}) == len(rounds)  # new shapes
    cost.update({("sft", True): 5.0, ("rl", True): 10.0})  # emulated bf16: dropped after its warm-up
    calls.clear()
    machine.main(["--init", "tiny", "--cores", "2", "--out", str(out)])
    assert out.read_text().endswith("_BF16=0\nexport SFT_CPU_BF16=0\n") and "RL in fp32" in capsys.readouterr().out
    assert [c[:2] for c in calls].count(("sft", True)) == 1 and [c[:2] for c in calls].count(("rl", True)) == 1
    assert [c[:2] for c in calls].count(("sft", False)) >= 2
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "1")  # the user's choice: nothing is timed
    monkeypatch.setattr(machine, "measure", None)
    machine.main(["--init", "tiny", "--out", str(out)])
    assert out.read_text().endswith("_BF16=1\nexport SFT_CPU_BF16=1\n")
    assert "as COUNTDOWN_CPU_BF16 says" in capsys.readouterr().out


def test_the_path_probe_times_real_steps_within_its_budget(monkeypatch):
    """The probe's own steps on the tiny model (the SFT stage's traces from its flags, RL rows, its
    frozen twin): both precisions timed, in a fraction of the ~30 s it may spend, and the caller's
    precision left as it was (unset: run_cpu.sh's probe)."""
    monkeypatch.delenv("COUNTDOWN_CPU_BF16", raising=False)
    model, tok = load_model("tiny")
    model.train()
    flags = ["--data", "gen:nums=3,range=1-20,test=20,val=10", "--template", "compact", "--batch_size", "8",
             "--micro_batch", "4", "--micro_batch_tokens", "512"]
    steps = machine.sft_shapes(tok, flags, 3)  # row lengths, cut as sft.py cuts its rows
    assert len(steps) == 3 and all(sum(map(len, s)) == 8 for s in steps) and steps[0] != steps[1]
    for micro in steps:
        rows = [k for m in micro for k in m]
        assert rows == sorted(rows) and all(len(m) <= 4 and (len(m) == 1 or len(m) * max(m) <= 512) for m in micro)
    prompts, write = machine.sft_data("gen:nums=3,range=1-20,test=20,val=10", "train", 24, "compact", 200,
                                      mistakes=machine.parse_mixes("random", machine.LLM_MISTAKES)[1])
    responses = write(random.Random(0))  # the first step's rows as sft.py cuts them
    assert steps[0] == [a.sum(1).tolist() for _, a, _ in sft.micro_batches(
        tok, prompts[:8], responses[:8], 4, 512, 1024, "cpu", 512)]
    assert all(default is None or getattr(sft.Args(), name) == default for name, _, default in machine.SFT_FLAGS)
    t0 = time.time()
    times = machine.measure(model, harness.frozen_copy(model), steps, 2, 1, budget_s=0)
    assert set(times) == {("sft", True), ("sft", False), ("rl", True), ("rl", False)}
    assert all(t > 0 for t in times.values()) and time.time() - t0 < 30
    assert all(p.grad is None for p in model.parameters())  # nothing left over for a real step
    assert "COUNTDOWN_CPU_BF16" not in os.environ


def test_the_sft_stages_train_in_the_precision_measured_for_sft_steps(tmp_path):
    """run_cpu.sh runs sft.py stages with path.env's SFT_CPU_BF16 and every other command with its
    COUNTDOWN_CPU_BF16 (the RL updates' precision)."""
    fake, out, calls = tmp_path / "python", tmp_path / "out", tmp_path / "calls"
    fake.write_text(FAKE_PY.replace('echo "$*" >>', 'echo "$* bf16=$COUNTDOWN_CPU_BF16" >>'))
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "CALLS": str(calls),
           "RLT": "1", "RLT_CONTROL": "", "FORCE": "", "COUNTDOWN_CPU_BF16": "1", "SFT_CPU_BF16": "0"}
    r = subprocess.run(["bash", "run_cpu.sh", "--unit", "teacher_student", str(out)], cwd=ROOT,
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = [(x.split()[0], x.split()[-1]) for x in calls.read_text().splitlines()]
    assert ran == [("evaluate.py", "bf16=1"), ("sft.py", "bf16=0"), ("evaluate.py", "bf16=1")]


@pytest.mark.parametrize("bf16", ["1", "0"])
def test_the_rl_stages_share_each_prompts_forward_on_either_precision(tmp_path, bf16):
    """The RL stages' micro-batches: a backward every 128 rollouts (16 whole groups), their rows in
    forwards of 32 in bf16 and of 16 in fp32 (the faster update side by side on each,
    docs/studies/performance.md), in all three. Broken on purpose (--micro_batch 32 back in
    run_cpu.sh; 32 rows in fp32), it failed."""
    fake, out, calls = tmp_path / "python", tmp_path / "out", tmp_path / "calls"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "CALLS": str(calls),
           "RLT": "", "RLT_CONTROL": "", "FORCE": "", "COUNTDOWN_CPU_BF16": bf16}
    for unit in ("rloo", "grpo", "opd"):
        r = subprocess.run(["bash", "run_cpu.sh", "--unit", unit, str(out)], cwd=ROOT, capture_output=True,
                           text=True, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
    trained = [x.split() for x in calls.read_text().splitlines() if x.split()[0] != "evaluate.py"]
    assert [x[0] for x in trained] == ["rloo.py", "grpo.py", "opd.py"]
    assert all(x[x.index("--micro_batch") + 1] == "128" and x[x.index("--forward_rows") + 1] == ("32" if bf16 == "1" else "16")
               and x[x.index("--max_steps") + 1] == "75" for x in trained)  # the default's 75 (the 3to4 lane: 50)


LANE_SHRINK = {"--max_steps": "2", "--batch_size": "8", "--micro_batch": "8", "--micro_batch_tokens": "512",
               "--forward_rows": "4", "--eval_problems": "2", "--eval_samples": "2", "--eval_max_new_tokens": "8",
               "--max_response_len": "16", "--num_prompts": "8", "--epochs": "1", "--num_problems": "4",
               "--num_samples": "2", "--max_new_tokens": "16", "--eval_every": "2", "--save_every": "2",
               "--data": "gen:nums=3-4,range=1-9,test=8,val=4", "--eval_data": "gen:nums=3-4,range=1-9,test=8,val=4"}


def test_the_3to4_lane_runs_every_stage_of_table_1_for_two_steps(tmp_path, monkeypatch):
    """NUMBERS=3to4 ./run_cpu.sh (issue 77): every stage of paper 000's Table 1 on the balanced 3/4-number
    mix, from the lane's own shipped base and teacher, with 400 test problems and 256-token responses
    into its own folder. Each command as the script writes it, then run for real for 2 steps on tiny
    sizes and the small 1-9 mix (LANE_SHRINK: its training split is drawn in ~1 s, the lane's 1-20 one in
    ~50), evaluated on 4 test problems: both counts in every evaluation."""
    fake, calls = tmp_path / "python", tmp_path / "calls"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "CALLS": str(calls), "RLT": "",
           "RLT_CONTROL": "", "FORCE": "", "NUMBERS": "3to4"}
    out = tmp_path / "out" / "cpu_3to4"  # the lane's own folder, as the script's default names it
    commands = []
    for unit in ("sft", "teacher", "rloo", "grpo", "opd", "ipo"):
        calls.write_text("")
        r = subprocess.run(["bash", "run_cpu.sh", "--unit", unit, str(out)], cwd=ROOT, capture_output=True,
                           text=True, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        commands += [x.split() for x in calls.read_text().splitlines()]
    assert [c[0] for c in commands] == ["sft.py", "evaluate.py", "evaluate.py", "rloo.py", "evaluate.py", "grpo.py",
                                        "evaluate.py", "opd.py", "evaluate.py", "ipo.py", "evaluate.py"]
    data = "gen:nums=3-4,range=1-20,test=400,val=200"
    for c in commands:
        assert c[c.index("--data") + 1] == data and "160" not in c, c
        budget = "--max_new_tokens" if c[0] in ("evaluate.py", "ipo.py") else "--max_response_len"
        assert c[0] == "sft.py" or c[c.index(budget) + 1] == "256", c
        assert c[0] != "evaluate.py" or c[c.index("--num_problems") + 1] == "400", c
        assert c[0] not in ("rloo.py", "grpo.py", "opd.py") or c[c.index("--max_steps") + 1] == "50", c
    script = open(os.path.join(ROOT, "run_cpu.sh")).read()
    assert 'OUT=${1:-out/cpu${LANE:+_$LANE}}' in script and "pretrained/tiny-base${LANE:+-$LANE}" in script
    # the stages for real, in this process (a new python each cost the suite ~5 s), from the lane's shipped
    # base as `base` copies it (the teacher unit copied its teacher). IPO's pairs need right and wrong samples,
    # which 2 SFT steps and 16 tokens never give: IPO starts from the teacher with room to answer
    assert (out / "teacher" / "model.safetensors").exists()
    shutil.copytree(os.path.join(ROOT, "pretrained", "tiny-base-3to4"), out / "base")
    for c in commands:
        argv = [LANE_SHRINK.get(c[i - 1], x) for i, x in enumerate(c) if i]
        if c[0] == "ipo.py":
            argv += ["--init", str(out / "teacher"), "--max_new_tokens", "160"]
        if c[0] == "evaluate.py":
            monkeypatch.setattr(sys, "argv", c[:1] + argv)
            evaluate.main()
        else:
            importlib.import_module(c[0][:-3]).main(argv)
    for stage in ("sft", "teacher", "rloo", "grpo", "opd", "ipo"):
        summary = json.load(open(out / "eval" / stage / "summary.json"))
        assert set(summary["by_size"]) == {"3", "4"} and summary["num_problems"] == 4
