"""Tables and plots of evaluations: what evaluate.py prints for one checkpoint, paper 000's Tables
1-2 and results.json for a whole run_cpu.sh pipeline, and the pass@k and training-curve PNGs.

  python report.py --run out/cpu      # results.json, Tables 1-2, pass_at_k.png and rl_curves.png
  python report.py --plot out/eval/sft,out/eval/rloo --out pass_at_k.png   # pass@k-vs-k curves
"""
import json
import os
from dataclasses import dataclass
from math import nan

from common import CountdownError, arg, cli, parse_args
from data import read_jsonl
from traces import STRATEGIES

# the pipeline's stages in run_cpu.sh's order; any other eval dir is listed after them
STAGES = ["sft", "teacher", "ipo", "rloo", "grpo", "opd", "opd_anticollapse", "opd_longer",
          "rlt_student", "rlt0_student", "solver_student"]


@dataclass
class Args:
    run: str = arg("", "a pipeline dir (run_cpu.sh): gather DIR/eval/*/summary.json into "
                       "results.json, print paper 000's Tables 1-2, draw pass_at_k.png and "
                       "rl_curves.png")
    plot: str = arg("", "comma-separated eval dirs: draw their pass@k-vs-k curves to --out")
    out: str = arg("pass_at_k.png", "the PNG of --plot")


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


def plot(run_dirs, out_png):
    """pass@k-vs-k curves of several eval dirs on one chart (paper 000 Fig. 2)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in run_dirs:
        path = os.path.join(d, "summary.json")
        if not os.path.isfile(path):
            raise CountdownError(f"{d} has no summary.json: run evaluate.py --out {d} first")
        pk = json.load(open(path))["pass_at_k"]
        ax.plot([int(k) for k in pk], list(pk.values()), marker="o",
                label=os.path.basename(os.path.normpath(d)))
    ax.set(xscale="log", xlabel="k (samples)", ylabel="pass@k", ylim=(0, 1),
           title="pass@k on held-out problems")
    ax.set_xticks([int(k) for k in pk], labels=list(pk))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
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
            + f"{'format':>8}{'step err':>9}{'false':>7}"
            + "".join(f"{s[:4] + ' %':>8}{s[:4] + '@1':>8}" for s in STRATEGIES) + f"{'wall s':>8}")
    print(f"Table 1 ({first['num_problems']} held-out problems x {first['num_samples']} samples; "
          "step err: share of wrong `a op b = v` steps, false: of `found` verdicts after a try "
          "whose last value is not the target; per strategy (traces.py): its share of the samples "
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
              + "".join(f"{st.get(s, {}).get('share', nan):>8.3f}"
                        f"{_num(st.get(s, {}).get('pass@1')):>8.3f}" for s in STRATEGIES)
              + f"{wall if wall is not None else '-':>8}")
    budgets = list(first.get("verification", {}).get("budgets", {}))
    print("\nTable 2 (test-time self-verification: sample until the verifier accepts, at most N; "
          "accuracy at N, and the samples drawn on average at N = "
          f"{first['num_samples']})\n{'stage':<18}" + "".join(f"{'N=' + N:>8}" for N in budgets)
          + f"{'avg n':>8}")
    for n, r in results.items():
        row = r.get("verification", {}).get("budgets", {})
        print(f"{n:<18}" + "".join(f"{row[N]['accuracy'] if N in row else nan:>8.3f}"
                                   for N in budgets) + f"{r['best_of_n']['avg_samples']:>8.2f}")
    plot([os.path.join(evals, n) for n in names], os.path.join(out, "pass_at_k.png"))
    plot_training(out)
    print(f"\nwrote {out}/results.json, {out}/pass_at_k.png, {out}/rl_curves.png")


def plot_training(out):
    """Per-step training reward and accuracy of the RL stages, the share of their rollouts that work
    backward (the selection RL makes), and RLT's r_SS, training and held-out (004 Fig. 3)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = [(n, k, k) for k in ("train/reward", "train/accuracy", "train/strategy/backward")
              for n in ("rloo", "grpo", "opd", "opd_anticollapse", "opd_longer")]
    curves += [("rlt", "train/r_ss", "train"), ("rlt", "eval/r_ss", "held-out")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for ax, key, title in zip(axes, ["train/reward", "train/accuracy", "train/strategy/", "r_ss"],
                              ["training reward", "training accuracy", "share of rollouts "
                               "working backward", "RLT: r_SS of explanations (Eq. 3)"]):
        for n, k, label in curves:
            if key in k and os.path.isfile(os.path.join(out, n, "metrics.jsonl")):
                rows = [r for r in read_jsonl(os.path.join(out, n, "metrics.jsonl"), ["step"])
                        if k in r]
                ax.plot([r["step"] for r in rows], [r[k] for r in rows],
                        label=n if n != "rlt" else label,
                        marker="o" if k.startswith("eval") else None)
        ax.set(xlabel="step", title=title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "rl_curves.png"), dpi=110)


def main():
    args = parse_args(Args)
    if bool(args.run) == bool(args.plot):
        raise CountdownError("give one of --run DIR (a pipeline's tables and plots) or --plot "
                             "DIR,DIR,... (pass@k curves)")
    if args.run:
        return report(args.run)
    plot(args.plot.split(","), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    cli(main)
