"""Does the RLT reward rank explanations by the students they make? Paper 004 §4.5, in miniature.

The teacher (004: its checkpoint right before RL) writes k explanations for each of P train
problems; rlt.py's reward scores them; within each problem they are ranked by reward. Rank j's
explanations make dataset j (one per problem, in the student format). One student is SFT'd on each
dataset from the same init with the same steps, and evaluated on the val split. 004 trained 16 7B
students and found a Pearson coefficient over 0.89 between dataset rank and student score.

    python benchmarks/rlt_correlation.py --teacher out/r/rlt_sft --student out/cpu/sft \
        --student_init out/cpu/base --out out/rlt_corr --problems 1024 --k 6
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rlt  # noqa: E402
import sft  # noqa: E402
from data import load_tasks  # noqa: E402
from models import load_frozen, load_model  # noqa: E402
from sampler import make_sampler  # noqa: E402

SPEC = "nums=3,range=1-20,test=200,val=100"


def pearson(x, y):
    x, y = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    return (x @ y / (x.norm() * y.norm())).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="the teacher before RL")
    p.add_argument("--student", required=True, help="the reward's frozen student (rlt.py --student)")
    p.add_argument("--student_init", required=True, help="what each new student is SFT'd from")
    p.add_argument("--out", required=True)
    p.add_argument("--problems", type=int, default=512)
    p.add_argument("--k", type=int, default=4, help="explanations per problem = datasets = students")
    p.add_argument("--steps", type=int, default=400, help="SFT steps per student (run_cpu.sh's "
                   "student: 400)")
    p.add_argument("--batch_size", type=int, default=64, help="per step (run_cpu.sh's student: 64)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model, tok = load_model(args.teacher)
    student = load_frozen(args.student, "cpu", tok, args.teacher)
    tasks, sols = zip(*rlt.solved(load_tasks("gen:" + SPEC, "train"), args.problems))
    sampler = make_sampler("hf", model, tok, args.teacher, args.seed)
    with torch.no_grad():  # rlt.py's embedded flags: T 0.7, 160 tokens, λ 3, α 0.01, penalty −1
        _, expl, pen = rlt.explain(sampler, model, tok, tasks, sols, args.k, "compact", 512, 0.7, 160,
                                   args.seed)
        rep = lambda xs: [x for x in xs for _ in range(args.k)]  # noqa: E731
        reward = rlt.score_explanations(model, student, tok, rep(tasks), rep(sols), expl, pen, "compact",
                                        0.01, 3.0, -1.0, 64, "cpu")[0].view(-1, args.k)  # (P, k)
    order = reward.argsort(1, descending=True)                                           # (P, k)
    rows = []
    for j in range(args.k):  # dataset j: each problem's j-th best explanation
        path = os.path.join(args.out, f"rank{j}.jsonl")
        with open(path, "w") as f:
            for i, (t, s) in enumerate(zip(tasks, sols)):
                e = expl[i * args.k + order[i, j]]
                f.write(json.dumps({"query": rlt.student_prompt(t, "compact"),
                                    "completion": rlt.student_completion(rlt.explanation_of(e)[0], s)}) + "\n")
        out = os.path.join(args.out, f"student{j}")
        sft.main(["--init", args.student_init, "--data", path, "--eval_data", "gen:" + SPEC, "--template", "compact",
                  "--num_train", str(args.problems), "--lr", "2e-3", "--batch_size", str(args.batch_size), "--micro_batch", "32",
                  "--max_steps", str(args.steps), "--eval_every", "0", "--eval_problems", "100", "--eval_samples", "4",
                  "--eval_max_new_tokens", "160", "--seed", str(args.seed), "--output_dir", out, "--overwrite"])
        last = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))][-1]
        mean_r = reward.gather(1, order[:, j:j + 1]).mean().item()
        penalized = sum(pen[i * args.k + order[i, j]] for i in range(len(tasks))) / len(tasks)
        rows.append({"rank": j, "reward": mean_r, "penalized": penalized, "val_pass@1": last["eval/pass@1"],
                     "val_pass@4": last["eval/pass@4"]})
        print(rows[-1], flush=True)
    result = {"rows": rows, "pearson_rank": pearson([-r["rank"] for r in rows], [r["val_pass@1"] for r in rows]),
              "pearson_reward": pearson([r["reward"] for r in rows], [r["val_pass@1"] for r in rows])}
    json.dump(result, open(os.path.join(args.out, "result.json"), "w"), indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
