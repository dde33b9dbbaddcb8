"""run_cpu.sh's scheduler: the pipeline's units (a stage, or stages that must run in order) start as
soon as the units they need have finished, the longest remaining chain first, as many at once as
the machine has cores, and one more where nothing waits for any of them (start()); the running
units share the cores equally, at least a thread each, and when one ends its share goes to the
others (a training loop reads its thread count from a file once a step: flags.follow_threads).
While they run, the console shows each unit's commands as they start, its test pass@1 when it is
evaluated, a status line every --status_every seconds (each running stage, its step, its threads,
the time since the start) and a failure the moment it happens, with its log's last lines. Stdlib only: run_cpu.sh calls it; `./run_cpu.sh --plan` prints its schedule.

  python -m plumbing.pipeline --out OUT --cores 2 --command "bash run_cpu.sh --unit {} OUT" \
      sft teacher rloo:sft
"""
import argparse
import os
import re
import subprocess
import sys
import threading
import time

# Seconds each unit took on one fp32 thread beside another stage, its evaluations included (2 cores
# without AVX512-BF16, issue 44's run of 32b94ae; sft without --compile estimated from its 1.07 s
# step; the RL stages' 100 steps and the teacher's evaluation alone estimated from their parts;
# rloo, grpo, opd at 3/4 since they take 75 steps). Used only to rank the units and to print the plan.
COST = {"sft": 1250, "teacher": 250, "teacher_student": 550, "solver_student": 740, "rloo": 940,
        "opd": 1090, "grpo": 1090, "ipo": 250, "rlt": 660, "rlt_student": 910, "opd_anticollapse": 1150,
        "opd_longer": 1140}
# every pool a stage's process may start: OpenMP/MKL/OpenBLAS/Accelerate (torch and numpy), the
# tokenizers' Rust pool, torch.compile's compile workers
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "RAYON_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")
LOCK = threading.Lock()


def shares(cores, n):
    """Threads for each of n units running at once on `cores` cores: an equal share, the remainder
    to the first ones, at least one each."""
    return [max(1, cores // n + (i < cores % n)) for i in range(n)]


def parse_units(specs):
    """['name:dep,dep', ...] -> {name: [deps]}; a unit's deps must be named before it."""
    units = {}
    for spec in specs:
        name, _, deps = spec.partition(":")
        deps = [d for d in deps.split(",") if d]
        for d in deps:
            if d not in units:
                raise SystemExit(f"error: unit {name} needs {d}, which is not an earlier unit")
        units[name] = deps
    return units


def rank(units):
    """Each unit's cost plus the longest chain of units waiting for it: the critical path first."""
    memo = {}

    def r(u):
        if u not in memo:
            memo[u] = COST.get(u, 600) + max([r(v) for v, d in units.items() if u in d], default=0)
        return memo[u]
    return {u: r(u) for u in units}


def ready(units, done, started, ranks, blocked=()):
    """The units whose deps are done and that have not started, the highest rank first."""
    return sorted((u for u in units if u not in started and u not in blocked
                   and all(d in done for d in units[u])), key=lambda u: -ranks[u])


def start(units, ready_units, running, cores, max_running):
    """Which of the ready units (best first) to start beside the `running` ones: up to max_running
    in all, and on 2+ cores one more where it and every running unit are units nothing waits for
    (the RL stages after sft). A stage alone on two threads is only ~1.3x faster than on one (its
    sampling, a token at a time, gains 1.13x), so the last of them would run alone, its cores half
    idle; a third time-sharing two cores keeps both at work to the end (docs/studies/performance.md).
    Time-sharing slows every unit that shares, so a unit others wait for never does."""
    new = list(ready_units[:max(0, max_running - len(running))])
    waited_for = {d for deps in units.values() for d in deps}
    extra = ready_units[len(new):len(new) + 1]
    if (cores > 1 and max_running == cores and len(running) + len(new) == cores and extra
            and not waited_for & {*running, *new, *extra}):
        new += extra
    return new


def blocked_by(units, failed):
    """Every unit that waits, directly or not, for a failed one."""
    out = set()
    for name, deps in units.items():  # deps come first, so one pass sees every chain
        if any(d in failed or d in out for d in deps):
            out.add(name)
    return out


def plan(units, cores, max_running):
    """The schedule if each unit takes its COST on one thread and 2^0.63 = 1.55x less on two (the
    SFT step's measured gain, issue 44), and units beyond the cores time-share them: [(start s,
    unit, threads)], end s."""
    ranks, t, left, done, out = rank(units), 0.0, {}, set(), []
    while len(done) < len(units):
        new = start(units, ready(units, done, set(done) | set(left), ranks), left, cores, max_running)
        left.update({u: float(COST.get(u, 600)) for u in new})  # one-thread seconds of work left
        out += [(t, u, shares(cores, len(left))[len(left) - len(new) + i])
                for i, u in enumerate(new)]
        busy = min(1.0, cores / len(left))  # more units than cores: each runs part of the time
        speed = {u: busy * n ** 0.63 for u, n in zip(left, shares(cores, len(left)))}
        first = min(left, key=lambda u: left[u] / speed[u])
        dt = left[first] / speed[first]
        t += dt
        for u in left:
            left[u] -= dt * speed[u]
        del left[first]
        done.add(first)
    return out, t


def say(line):
    with LOCK:
        print(line, flush=True)


def clock(s):
    return f"{int(s) // 60}:{int(s) % 60:02d}"


class Unit:
    """One unit's process: its thread share (in its env at the start, in a file after), its
    console lines, and the stage it is in."""

    def __init__(self, name, cmd, out, threads):
        self.name, self.stage, self.t0 = name, name, time.time()
        self.threads_file = os.path.join(out, ".threads", name)
        self.set_threads(threads)
        env = {**os.environ, "COUNTDOWN_THREADS_FILE": self.threads_file,
               **{v: str(threads) for v in THREAD_VARS}}
        self.proc = subprocess.Popen(cmd, shell=True, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.reader = threading.Thread(target=self.echo, daemon=True)
        self.reader.start()

    def set_threads(self, n):
        os.makedirs(os.path.dirname(self.threads_file), exist_ok=True)
        with open(self.threads_file + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(self.threads_file + ".tmp", self.threads_file)  # never half a number
        self.threads = n

    def echo(self):
        """The unit's own lines (its commands, its test results) to the console as they come;
        run_cpu.sh's `== NAME: training` / `== NAME: evaluating` say which stage it is in."""
        for line in self.proc.stdout:
            m = re.match(r"== (\S+): (training|evaluating)", line)
            if m:
                self.stage = m.group(1) + (" eval" if m.group(2) == "evaluating" else "")
            say(line.rstrip("\n"))

    def status(self, out):
        """'rloo 23/50 (1t)' or 'sft eval 40% (2t)': the stage, its last logged step or its
        evaluation's progress bar (from OUT/logs/STAGE.log), its threads."""
        name, _, evaluating = self.stage.partition(" ")
        path, where = os.path.join(out, "logs", name + ".log"), []
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 20_000))  # the tail is enough
                where = re.findall(rb"sampling: +(\d+%)" if evaluating else rb"step (\d+/\d+)",
                                   f.read())
        except OSError:
            pass
        return f"{self.stage}{' ' + where[-1].decode() if where else ''} ({self.threads}t)"


def run(units, cores, max_running, cmd, out, status_every):
    """Run the units; 0 if all finished, 1 if one failed (the others that do not need it go on:
    their work is kept for the next run)."""
    ranks, t0, last = rank(units), time.time(), time.time()
    running, done, failed = {}, set(), []
    while True:
        for name, u in list(running.items()):
            rc = u.proc.poll()
            if rc is None:
                continue
            u.reader.join()
            del running[name]
            if rc == 0:
                done.add(name)
                say(f"== {name}: done in {clock(time.time() - u.t0)} "
                    f"({clock(time.time() - t0)} into the pipeline)")
                continue
            failed.append(name)
            log = os.path.join(out, "logs", u.stage.split()[0] + ".log")
            say(f"error: {name} failed (exit {rc}) in {u.stage}; the last lines of {log}:")
            try:
                with open(log, errors="replace") as f:
                    say("".join(f.readlines()[-15:]).rstrip())
            except OSError:
                pass
        new = start(units, ready(units, done, set(running) | done | set(failed), ranks,
                                 blocked_by(units, failed)), running, cores, max_running)
        share = shares(cores, len(running) + len(new)) if running or new else []
        for u, n in zip(running.values(), share):
            if u.threads != n:
                u.set_threads(n)  # a finished unit's cores to the ones still running
        for name, n in zip(new, share[len(running):]):
            running[name] = Unit(name, cmd.replace("{}", name), out, n)
        if not running:
            break
        if time.time() - last >= status_every:
            last = time.time()
            say(f"-- {time.strftime('%H:%M:%S')} +{clock(last - t0)} | "
                + " | ".join(u.status(out) for u in running.values())
                + f" | {len(done)}/{len(units)} done")
        time.sleep(1)
    if failed:
        left = [n for n in units if n not in done and n not in failed]
        say(f"error: {', '.join(failed)} failed" + (f"; not run: {', '.join(left)}" if left else "")
            + ". Fix it and run the same command again: finished stages are kept")
        return 1
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("units", nargs="+", help="name or name:dep,dep ..., deps named first")
    p.add_argument("--out", required=True, help="the pipeline's dir (stage logs in OUT/logs)")
    p.add_argument("--cores", type=int, required=True, help="the cores to share")
    p.add_argument("--command", default="", help="how to run a unit; {} stands for its name")
    p.add_argument("--serial", action="store_true", help="one unit at a time, with every core")
    p.add_argument("--plan", action="store_true", help="print the schedule; run nothing")
    p.add_argument("--status_every", type=float, default=30, help="seconds between status lines")
    args = p.parse_args(argv)
    if args.cores < 1:
        raise SystemExit(f"error: --cores must be at least 1, not {args.cores}")
    units = parse_units(args.units)
    max_running = 1 if args.serial else args.cores
    if args.plan:
        steps, end = plan(units, args.cores, max_running)
        extra = " (one more where nothing waits for them)" if max_running > 1 else ""
        print(f"{args.cores} cores, {max_running} stage{'s' * (max_running > 1)} at once{extra} "
              "(times: one fp32 run's, to order the units)")
        for t, u, n in steps:
            print(f"  {clock(t):>6}  {u} starts on {n} thread{'s' * (n > 1)}")
        print(f"  {clock(end):>6}  all done")
        return 0
    try:
        return run(units, args.cores, max_running, args.command, args.out, args.status_every)
    except KeyboardInterrupt:  # Ctrl-C reached every stage too (one process group)
        say("interrupted: finished stages are kept, a stage killed halfway resumes from its last "
            "state; run the same command again")
        return 130


if __name__ == "__main__":
    sys.exit(main())
