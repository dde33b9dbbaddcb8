"""Tables and plots of evaluations: what evaluate.py prints for one checkpoint, paper 000's Tables
1-2 and results.json for a whole run_cpu.sh pipeline, and the pass@k and training-curve PNGs.

  python evaluate.py --run out/cpu      # results.json, Tables 1-2, pass_at_k.png and rl_curves.png
  python evaluate.py --run out/cpu --publish   # and copy them to docs/, README's Table 1 redrawn
  python evaluate.py --plot out/eval/sft,out/eval/rloo --out pass_at_k.png   # pass@k-vs-k curves
  python evaluate.py --compare out/cpu/rloo,out/ex/dense --keys train/zero_adv_groups --steps 1-10
                                      # runs (or evaluations) side by side: what one change did
"""
import json
import os
import platform
import shutil
import subprocess
from math import nan

from plumbing.flags import CountdownError
from plumbing.tasks import read_jsonl
from plumbing.traces import MISTAKES, STRATEGIES

# the pipeline's stages in run_cpu.sh's order; any other eval dir is listed after them
STAGES = ["sft", "teacher", "rloo", "opd", "grpo", "ipo", "opd_anticollapse", "opd_longer",
          "teacher_student", "rlt_student", "rlt0_student", "solver_student"]
# pass_at_k.png: one panel a comparison, so that no line hides another (stages not named: "other")
COMPARISONS = {"preference and RL from SFT": ["sft", "teacher", "ipo", "rloo", "grpo"],
               "on-policy distillation (and ANTICOLLAPSE=1)": ["sft", "teacher", "rloo", "opd",
                                                               "opd_anticollapse", "opd_longer"],
               "students of explanations and traces": ["teacher_student", "rlt_student",
                                                       "rlt0_student", "solver_student"]}
RL_STAGES = ["rloo", "grpo", "opd", "opd_anticollapse", "opd_longer"]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo's
# README's Table 1: what each stage is, then its numbers from results.json (tests/test_docs.py
# checks that README's table is this function's output for docs/results.json, digit for digit)
WHAT = {"sft": "SFT from the base, 700 steps on the unverified traces",
        "teacher": "SFT on the same traces verified, 2,000 steps (shipped)",
        "rloo": "RLOO from `sft`", "grpo": "GRPO from `sft`, KL β 0.04",
        "opd": "RLOO from `sft` + forward KL to `teacher`", "ipo": "IPO from `sft` on its own samples",
        "teacher_student": "SFT on the teacher's accepted samples",
        "rlt_student": "SFT on RLT's explanations", "solver_student": "SFT on the solver's clean traces"}
TABLE_START = "<!-- Table 1: written by `python evaluate.py --run out/cpu --publish` -->"
TABLE_END = "<!-- end of Table 1 -->"


def readme_table(results, runs=()):
    """Markdown Table 1 of a results.json: pass@1 with its 95 % interval, pass@16, the share of
    samples that answer, give up, or carry another mistake kind, the stage's training time; and,
    given `runs` (docs/fresh_runs.json's), each stage's pass@1 range over those fresh-clone runs."""
    span = bool(runs)
    rows = ["| stage | what it is | pass@1 (± 95 %) | pass@16 | answers | give-ups | other "
            "mistakes | training |" + (f" pass@1, {len(runs)} fresh run{'s' * (len(runs) != 1)} |" if span else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|" if span else "")]
    for n, r in results.items():
        m, wall = r.get("mistakes", {}), r.get("wall_seconds")
        other = sum(v for k, v in m.items() if k != "giveup")
        wall = "shipped" if wall == 0 else "—" if wall is None else f"{wall // 60}:{wall % 60:02d}"
        seen = [x["pass@1"][n] for x in runs if n in x["pass@1"]]
        rows.append(f"| `{n}` | {WHAT.get(n, '')} | {r['pass_at_k']['1']:.3f} ± "
                    f"{1.96 * r['pass_at_1_stderr']:.3f} | {r['pass_at_k']['16']:.3f} | "
                    f"{100 * r['format_rate']:.1f} % | {100 * m.get('giveup', 0):.1f} % | "
                    f"{100 * other:.1f} % | {wall} |"
                    + (f" {_span(seen)} |" if seen else " — |" if span else ""))
    return "\n".join(rows)


def _span(xs):
    return f"{min(xs):.3f}" if min(xs) == max(xs) else f"{min(xs):.3f}–{max(xs):.3f}"


def fresh_runs(docs=os.path.join(ROOT, "docs")):
    """docs/fresh_runs.json's runs, or none."""
    path = os.path.join(docs, "fresh_runs.json")
    return json.load(open(path))["runs"] if os.path.isfile(path) else []


def publish(out, docs=os.path.join(ROOT, "docs"), readme=os.path.join(ROOT, "README.md")):
    """Copy a run's results.json and PNGs to docs/ and put its Table 1 between README's markers; a
    run on the 3/4 mix (NUMBERS=3to4, its results_by_size.json) writes docs/studies/results_3to4.json."""
    if os.path.isfile(os.path.join(out, "results_by_size.json")):
        return publish_lane(out, os.path.join(docs, "studies", "results_3to4.json"))
    for f in ["results.json", "pass_at_k.png", "rl_curves.png"]:
        shutil.copyfile(os.path.join(out, f), os.path.join(docs, f))
    text = open(readme).read()
    if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1:
        raise CountdownError(f"{readme} has no Table 1 markers ({TABLE_START} ... {TABLE_END})")
    head, rest = text.split(TABLE_START)
    table = readme_table(json.load(open(os.path.join(docs, "results.json"))), fresh_runs(docs))
    open(readme, "w").write(f"{head}{TABLE_START}\n{table}\n{TABLE_END}{rest.split(TABLE_END)[1]}")
    print(f"wrote {docs}/results.json, {docs}/pass_at_k.png, {docs}/rl_curves.png, Table 1 of {readme}")


def publish_lane(out, path):
    """The 3/4 lane's results: per stage pass@1 and pass@16 over all, 3 and 4 numbers, the problems of
    each, the stage's wall seconds, and where they were measured (commit, CPU, training path)."""
    results, counts = (json.load(open(os.path.join(out, f))) for f in ("results.json", "results_by_size.json"))
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.isfile("/proc/cpuinfo") else platform.processor()
    env = os.path.join(out, "path.env")
    lane = {"about": f"NUMBERS=3to4 ./run_cpu.sh into {out}: commit {commit.stdout.strip() or 'unknown'}, {cpu}, "
                     f"{os.cpu_count()} cores; " + (open(env).readline().lstrip("# ").strip()
                                                    if os.path.isfile(env) else "training path not recorded")}
    for n, r in results.items():
        lane[n] = {**{k: {c: round(x, 4) for c, x in d.items()} for k, d in counts[n].items()},
                   "problems": {"all": r["num_problems"], **{c: p["num_problems"] for c, p in r["by_size"].items()}},
                   "wall_seconds": r["wall_seconds"]}
    json.dump(lane, open(path, "w"), indent=1)
    print(f"wrote {path}")


def _num(x):
    return nan if x is None else x


def format_table(summary):
    """One evaluation (evaluate.py's summary.json) as the console table: pass@k overall and by
    problem size, best-of-n, and the arithmetic diagnostics."""
    pk, n = summary["pass_at_k"], summary["num_samples"]
    lines = [f"{summary['num_problems']} problems x {n} samples | pass@1 {pk['1']:.3f} ± "
             f"{1.96 * summary['pass_at_1_stderr']:.3f} (95%) | format rate "
             f"{summary['format_rate']:.3f} | best-of-{n} {summary['best_of_n']['accuracy']:.3f} "
             f"at {summary['best_of_n']['avg_samples']:.2f} samples/problem",
             "arithmetic: {step_error:.1%} of {steps} steps wrong; {false_claims:.1%} of {claims} "
             "`found` verdicts after a value that is not the target"
             .format(**summary["arithmetic"]),
             "mistakes (traces.mistake_of): " + " | ".join(
                 f"{k} {v:.1%}" for k, v in summary.get("mistakes", {}).items()),
             "strategies: " + " | ".join(
                 f"{name} {s['share']:.1%} of samples, pass@1 "
                 + ("-" if s["pass@1"] is None else f"{s['pass@1']:.3f}")
                 for name, s in summary.get("strategies", {}).items()),
             "          " + "".join(f"{'pass@' + k:>10}" for k in pk),
             f"{'all':<10}" + "".join(f"{v:>10.3f}" for v in pk.values())]
    for size, s in summary["by_size"].items():
        lines.append(f"{size + ' nums':<10}" +
                     "".join(f"{s['pass_at_k'].get(k, nan):>10.3f}" for k in pk) +
                     f"   ({s['num_problems']} problems)")
    return "\n".join(lines)


def format_verification(v, title):
    """Table 2's left half: realized accuracy and samples drawn per budget N, overall and by
    size."""
    sizes = "".join(f"{s + ' nums':>12}" for s in v["by_size"])
    lines = [title, f"{'N':>4}{'accuracy':>10}{'avg n':>8}" + sizes]
    for N, row in v["budgets"].items():
        lines.append(f"{N:>4}{row['accuracy']:>10.3f}{row['avg_samples']:>8.2f}"
                     + "".join(f"{v['by_size'][s][N]['accuracy']:>12.3f}" for s in v["by_size"]))
    return "\n".join(lines)


def plot(run_dirs, out_png, panels=None):
    """pass@k-vs-k curves of eval dirs (paper 000 Fig. 2): one chart, or with `panels` ({title:
    [stage names]}, matched to the dirs' names) one chart a comparison."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_name = {os.path.basename(os.path.normpath(d)): d for d in run_dirs}
    for d in run_dirs:
        if not os.path.isfile(os.path.join(d, "summary.json")):
            raise CountdownError(f"{d} has no summary.json: run evaluate.py --out {d} first")
    if panels:
        named = {n for names in panels.values() for n in names}
        panels = {t: [n for n in names if n in by_name] for t, names in panels.items()}
        panels["other"] = [n for n in by_name if n not in named]
        panels = {t: names for t, names in panels.items() if names}
    else:
        panels = {"pass@k on held-out problems": list(by_name)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, names) in zip(axes[0], panels.items()):
        for n in names:
            pk = json.load(open(os.path.join(by_name[n], "summary.json")))["pass_at_k"]
            ax.plot([int(k) for k in pk], list(pk.values()), marker="o", label=n,  # a stage's
                    color=f"C{list(by_name).index(n) % 10}")  # colour is the same in every panel
        ax.set(xscale="log", xlabel="k (samples)", ylabel="pass@k", ylim=(0, 1), title=title)
        ax.set_xticks([int(k) for k in pk], labels=list(pk))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def report(out):
    """OUT/results.json = {stage: summary.json + wall_seconds}; Table 1 (pass@k, by problem size)
    and Table 2 (best-of-N with the verifier: accuracy and expected samples drawn, Eq. 5) of
    paper 000."""
    evals = os.path.join(out, "eval")
    found = [n for n in sorted(os.listdir(evals) if os.path.isdir(evals) else [])
             if os.path.isfile(os.path.join(evals, n, "summary.json"))]
    names = [n for n in STAGES if n in found] + [n for n in found if n not in STAGES]
    if not names:
        raise CountdownError(f"{out}/eval has no */summary.json: run ./run_cpu.sh {out} first")
    results = {}
    for n in names:
        results[n] = json.load(open(os.path.join(evals, n, "summary.json")))
        wall = os.path.join(out, n, "wall_seconds")
        results[n]["wall_seconds"] = int(open(wall).read()) if os.path.isfile(wall) else None
    json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=1)
    first = results[names[0]]
    ks = list(first["pass_at_k"])
    sizes = list(first["by_size"]) if len(first["by_size"]) > 1 else []  # a column each if mixed
    head = (f"{'stage':<18}{'pass@1':>15}" + "".join(f"{'pass@' + k:>9}" for k in ks[1:])
            + "".join(f"{s + ' nums@1':>11}" for s in sizes)
            + f"{'answer':>8}{'step err':>9}{'false':>7}" + "".join(f"{k[:5]:>7}" for k in MISTAKES)
            + "".join(f"{s[:4] + ' %':>8}{s[:4] + '@1':>8}" for s in STRATEGIES) + f"{'wall s':>8}")
    print(f"Table 1 ({first['num_problems']} held-out problems x {first['num_samples']} samples; "
          "step err: share of wrong `a op b = v` steps, false: of `found` verdicts after a try "
          "whose last value is not the target; slip ... malfo: each mistake kind's share of the "
          "samples (traces.mistake_of); per strategy (plumbing/traces.py): its share of the samples "
          f"and their pass@1)\n{head}")
    for n, r in results.items():
        # summaries written before the arithmetic block: nan (evaluate.py --recompute adds it)
        pk, a, wall = r["pass_at_k"], r.get("arithmetic", {}), r["wall_seconds"]
        st = r.get("strategies", {})
        print(f"{n:<18}{pk['1']:>8.3f} ±{1.96 * r['pass_at_1_stderr']:.3f}"
              + "".join(f"{pk[k]:>9.3f}" for k in ks[1:])
              + "".join(f"{r['by_size'][s]['pass_at_k']['1']:>11.3f}" for s in sizes)
              + f"{r['format_rate']:>8.3f}{a.get('step_error', nan):>9.3f}"
              + f"{a.get('false_claims', nan):>7.3f}"
              + "".join(f"{r.get('mistakes', {}).get(k, nan):>7.3f}" for k in MISTAKES)
              + "".join(f"{st.get(s, {}).get('share', nan):>8.3f}"
                        f"{_num(st.get(s, {}).get('pass@1')):>8.3f}" for s in STRATEGIES)
              + f"{wall if wall is not None else '-':>8}")
    if sizes:  # a mixed test set (run_cpu.sh's NUMBERS=3to4): pass@1 and pass@k on all and each count
        by_count = by_operands(results, ks[-1])
        json.dump(by_count, open(os.path.join(out, "results_by_size.json"), "w"), indent=1)
        print(f"\nBy operand count (pass@1, pass@{ks[-1]}; mistakes: each kind's share of the samples)")
        print(f"{'stage':<18}{'count':>6}{'problems':>9}{'pass@1':>8}{'pass@' + ks[-1]:>9}{'answer':>8}"
              + "".join(f"{k[:5]:>7}" for k in MISTAKES))
        for n, r in results.items():
            for s in ["all"] + sizes:
                part = r if s == "all" else r["by_size"][s]
                print(f"{n if s == 'all' else '':<18}{s:>6}{part['num_problems']:>9}"
                      f"{by_count[n]['pass@1'][s]:>8.3f}{by_count[n]['pass@' + ks[-1]][s]:>9.3f}"
                      f"{part.get('format_rate', nan):>8.3f}"
                      + "".join(f"{part.get('mistakes', {}).get(k, nan):>7.3f}" for k in MISTAKES))
    budgets = list(first.get("verification", {}).get("budgets", {}))
    print("\nTable 2 (test-time self-verification: sample until the verifier accepts, at most N; "
          "accuracy at N, and the samples drawn on average at N = "
          f"{first['num_samples']})\n{'stage':<18}" + "".join(f"{'N=' + N:>8}" for N in budgets)
          + f"{'avg n':>8}")
    for n, r in results.items():
        row = r.get("verification", {}).get("budgets", {})
        print(f"{n:<18}" + "".join(f"{row[N]['accuracy'] if N in row else nan:>8.3f}"
                                   for N in budgets) + f"{r['best_of_n']['avg_samples']:>8.2f}")
    plot([os.path.join(evals, n) for n in names], os.path.join(out, "pass_at_k.png"), COMPARISONS)
    plot_training(out)
    print(f"\nwrote {out}/results.json{', results_by_size.json' if sizes else ''}, {out}/pass_at_k.png, "
          f"{out}/rl_curves.png")


def by_operands(results, k):
    """{stage: {"pass@1": {"all", "3", "4"}, "pass@K": {...}}}: each stage's pass@1 and pass@k over
    the whole test set and over each operand count's problems (run_cpu.sh's NUMBERS=3to4)."""
    return {n: {f"pass@{j}": {"all": r["pass_at_k"][j],
                              **{s: part["pass_at_k"][j] for s, part in r["by_size"].items()}}
                for j in ("1", k)} for n, r in results.items()}


def flat_summary(s):
    """An evaluation's summary.json under the names metrics.jsonl gives the same numbers."""
    row = {f"eval/pass@{k}": v for k, v in s["pass_at_k"].items()}
    row.update({f"eval/mistake/{k}": v for k, v in s.get("mistakes", {}).items()})
    row.update({f"eval/{k}": v for k, v in s.get("arithmetic", {}).items() if not isinstance(v, dict)})
    row["eval/format_rate"] = s["format_rate"]
    return row


def compare(dirs, keys, first, last):
    """One line per run: each train/ or time/ key averaged over steps FIRST..LAST, each eval/ key
    at the last step <= LAST that logged it; an evaluation dir gives its summary's numbers."""
    print(f"{'run (steps ' + str(first) + '-' + str(last) + ')':<32}" + "".join(f"{k:>24}" for k in keys))
    for d in dirs:
        if os.path.isfile(os.path.join(d, "summary.json")):
            row = flat_summary(json.load(open(os.path.join(d, "summary.json"))))
        else:
            rows = [r for r in read_jsonl(os.path.join(d, "metrics.jsonl"), ["step"])
                    if first <= r["step"] <= last]
            row = {}
            for k in keys:
                vals = [r[k] for r in rows if k in r]
                if vals:
                    row[k] = vals[-1] if k.startswith("eval/") else sum(vals) / len(vals)
        print(f"{d:<32}" + "".join(f"{row[k]:>24.3f}" if k in row else f"{'-':>24}" for k in keys))


def moving_mean(xs, w=5):
    """The mean of each value and the w - 1 before it (fewer at the start)."""
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1])
            for i in range(len(xs))]


def plot_training(out, window=5):
    """What RL changes, step by step (a batch of 32 prompts is noise to the eye: each curve is a
    moving mean over `window` steps with the raw values faint, the in-loop val pass@1 as dots):
    training accuracy, the share of rollouts with a mistake, RLOO's and GRPO's rollouts by mistake
    kind (what RL removes), the share working backward (what it selects), and RLT's r_SS (004
    Fig. 3)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    logs = {n: read_jsonl(os.path.join(out, n, "metrics.jsonl"), ["step"])
            for n in RL_STAGES + ["rlt"] if os.path.isfile(os.path.join(out, n, "metrics.jsonl"))}
    mistakes = {f"train/mistake/{k}": k for k in MISTAKES}
    panels = [("training accuracy (dots: val pass@1)", {n: {"train/accuracy": n} for n in logs
                                                       if n != "rlt"}),
              ("rollouts with a mistake, any kind", {n: {"mistakes": n} for n in logs if n != "rlt"}),
              ("RLOO's rollouts by mistake kind", {"rloo": mistakes}),
              ("GRPO's rollouts by mistake kind", {"grpo": mistakes}),
              ("rollouts working backward", {n: {"train/strategy/backward": n} for n in logs
                                             if n != "rlt"}),
              ("RLT: r_SS of explanations (Eq. 3; dots: held-out)", {"rlt": {"train/r_ss": "rlt"}})]
    panels = [p for p in panels if "rlt" in logs or "rlt" not in p[1]]  # RLT's with RLT=1 only
    dots = {"train/accuracy": "eval/pass@1", "train/r_ss": "eval/r_ss"}  # the held-out points
    fig, axes = plt.subplots(2, 3, figsize=(17, 7.5))
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (title, series) in zip(axes.flat, panels):
        for n, keys in series.items():
            rows = [r for r in logs.get(n, []) if "train/accuracy" in r or "train/r_ss" in r]
            steps = [r["step"] for r in rows]
            for key, label in keys.items() if rows else ():
                ys = [sum(r.get(m, 0.0) for m in mistakes) if key == "mistakes" else
                      r.get(key, nan) for r in rows]
                line, = ax.plot(steps, moving_mean(ys, window), label=label)
                ax.plot(steps, ys, color=line.get_color(), alpha=0.2, lw=0.8)
                if key in dots:
                    pts = [r for r in logs[n] if dots[key] in r]
                    ax.plot([r["step"] for r in pts], [r[dots[key]] for r in pts], "o",
                            color=line.get_color(), ms=5)
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "rl_curves.png"), dpi=110)
