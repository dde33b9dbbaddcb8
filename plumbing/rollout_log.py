"""A step's rollouts, readable: with --log_rollouts N the RL scripts write N groups a step to
rollouts.jsonl beside metrics.jsonl (the problem, each completion with its score, reward,
advantage, importance weight ρ_i = π/μ of the whole rollout and the weights' version that sampled
it), and this prints two steps of a run side by side:

    python -m plumbing.rollout_log out/grpo 1 75 [--group 0] [--width 60]
"""
import argparse
import json
import math
import os
import textwrap


def keep_steps(path, last):
    """A resumed run's log: drop what was written after the restored step `last`."""
    if last and os.path.isfile(path):
        keep = [x for x in open(path) if x.strip() and json.loads(x)["step"] <= last]
        open(path, "w").writelines(keep)


def append(path, step, samples, tasks, scores, reward, adv, log_rho, n_groups):
    """The first n_groups groups of the step's batch: samples (Rollouts), tasks (B), scores
    (B*G,), reward (B, G), adv (B*G,), log_rho {row: log ρ_i} (StepStats.sampler_gap)."""
    G = len(samples.completion_ids) // len(tasks)
    with open(path, "a") as f:
        for k, task in enumerate(tasks[:n_groups]):
            rows = range(k * G, (k + 1) * G)
            f.write(json.dumps({
                "step": step, "group": k, "nums": task["nums"], "target": task["target"],
                "version": [samples.versions[r] for r in rows] if samples.versions else None,
                "completions": [samples.texts[r] for r in rows],
                "finished": [samples.finished[r] for r in rows],
                "score": [float(scores[r]) for r in rows],
                "reward": [round(float(x), 4) for x in reward[k]],
                "advantage": [round(float(adv[r]), 4) for r in rows],
                "is_weight": [round(math.exp(min(log_rho[r], 50)), 4) if r in log_rho else None
                              for r in rows]}) + "\n")


def read(run_dir, step, group):
    for line in open(os.path.join(run_dir, "rollouts.jsonl")):
        row = json.loads(line)
        if row["step"] == step and row["group"] == group:
            return row
    raise SystemExit(f"error: no group {group} of step {step} in {run_dir}/rollouts.jsonl "
                     f"(written with --log_rollouts N)")


def column(row, width):
    """One step's group as lines of `width` characters."""
    out = [f"step {row['step']}: {row['nums']} -> {row['target']}"]
    for i, text in enumerate(row["completions"]):
        v = row["version"][i] if row["version"] else "?"
        out.append(f"#{i} score {row['score'][i]:g} A {row['advantage'][i]:+.2f} "
                   f"w {row['is_weight'][i]} v{v}")
        out += textwrap.wrap(text.replace("\n", " | "), width) or [""]
        out.append("")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="two steps of a run's rollouts side by side")
    p.add_argument("run_dir")
    p.add_argument("step_a", type=int)
    p.add_argument("step_b", type=int)
    p.add_argument("--group", type=int, default=0, help="which logged group of each step")
    p.add_argument("--width", type=int, default=60)
    a = p.parse_args(argv)
    left, right = (column(read(a.run_dir, s, a.group), a.width) for s in (a.step_a, a.step_b))
    for i in range(max(len(left), len(right))):
        x = left[i] if i < len(left) else ""
        print(f"{x:<{a.width}}  |  {right[i] if i < len(right) else ''}")


if __name__ == "__main__":
    main()
