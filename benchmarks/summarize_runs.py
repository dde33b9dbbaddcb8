"""One markdown row per RL run dir from its metrics.jsonl: val pass@1 / pass@4 at the start and
the end, the training accuracy of the first and last 5 steps, the mean share of zero-advantage
groups (paper 001's flatline), truncated rollouts, and the curriculum's last level and pool.

    python benchmarks/summarize_runs.py out/cpu/rloo out/exp/rloo_tiers ...
"""
import json
import os
import sys


def row(run):
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r for r in rows if "train/accuracy" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    probe = os.path.join(run, "probe.jsonl")
    rates = [json.loads(line)["solve_rate"] for line in open(probe)] if os.path.exists(probe) else []
    wall = os.path.join(run, "wall_seconds")
    return [os.path.basename(run.rstrip("/")), len(steps),
            f"{evals[0]['eval/pass@1']:.3f} → **{evals[-1]['eval/pass@1']:.3f}**",
            f"{evals[0]['eval/pass@4']:.2f} → {evals[-1]['eval/pass@4']:.2f}",
            f"{mean(steps[:5], 'train/accuracy'):.2f} → {mean(steps[-5:], 'train/accuracy'):.2f}",
            f"{mean(steps, 'train/zero_adv_groups'):.3f}",
            f"{mean(steps[-5:], 'train/cut'):.2f}",
            f"{steps[-1]['train/curriculum_level']:.0f} / {steps[-1]['train/pool']:.0f}"
            if "train/curriculum_level" in steps[-1] else "—",
            f"{sum(0 < r < 1 for r in rates)} of {len(rates)}" if rates else "—",
            open(wall).read().strip() if os.path.exists(wall) else "—"]


if __name__ == "__main__":
    head = ["run", "steps", "val pass@1 (start → end)", "val pass@4", "train acc (first 5 → last 5)",
            "zero-adv groups", "cut at budget (last 5)", "tier / pool", "probed: sometimes", "wall s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for run in sys.argv[1:]:
        print("| " + " | ".join(map(str, row(run))) + " |")
