"""How hard each loss term pulls: one step of rloo.py and opd.py from the pipeline's SFT model (and
its teacher) under each weighting, on the same rollouts (same init and seed: same batch), reading
the per-term gradient norms the scripts log (grad/pg, grad/entropy, grad/kl). The table in
docs/studies/loss_terms.md comes from this.
    python benchmarks/loss_terms.py --init out/cpu/sft --teacher out/cpu/teacher
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import opd  # noqa: E402
import rloo  # noqa: E402
from common import trains_in_bf16  # noqa: E402

DATA = "gen:nums=3,range=1-20,test=200,val=100"
# run_cpu.sh's RL flags for one step, with a negligible evaluation
RL = ["--data", DATA, "--eval_data", DATA, "--template", "compact", "--eval_problems", "1",
      "--eval_samples", "1", "--eval_max_new_tokens", "1", "--lr", "2e-4", "--temperature", "0.7",
      "--batch_size", "32", "--micro_batch", "64", "--max_response_len", "160", "--max_steps", "1",
      "--wrong_reward", "-0.5"]
CONFIGS = [  # (name, script, flags)
    ("RLOO, λ_H 1e-3", rloo, []),
    ("RLOO, λ_H 1e-2", rloo, ["--entropy_coef", "1e-2"]),
    ("OPD, λ_H 1e-3, T 1.0", opd, []),
    ("OPD anti-collapse, λ_H 1e-2, T 1.3", opd,
     ["--entropy_coef", "1e-2", "--kd_temperature", "1.3"]),
]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--init", default="out/cpu/sft")
    p.add_argument("--teacher", default="out/cpu/teacher")
    args = p.parse_args()
    print(f"training compute: {'bf16' if trains_in_bf16('cpu') else 'fp32'}")
    print("| setting | --pg_norm | grad/pg | grad/entropy | grad/kl | entropy / pg | kl / pg |")
    print("|---|---|---|---|---|---|---|")
    for name, script, flags in CONFIGS:
        for pg_norm in ("sum", "mean"):
            with tempfile.TemporaryDirectory() as out:
                teacher = ["--teacher", args.teacher] if script is opd else []
                script.main(["--init", args.init, *RL, *teacher, *flags, "--pg_norm", pg_norm,
                             "--output_dir", out])
                row = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))][1]
            g = {k: row[f"grad/{k}"] for k in ("pg", "entropy", "kl")}
            print(f"| {name} | {pg_norm} | {g['pg']:.3g} | {g['entropy']:.2g} | {g['kl']:.2g} | "
                  f"{g['entropy'] / g['pg']:.2g} | {g['kl'] / g['pg']:.2g} |", flush=True)
    print(f"(one batch: train/accuracy {row['train/accuracy']:.3f}, train/resp_len "
          f"{row['train/resp_len']:.1f}, |A| std {row['train/adv_std']:.3f})")


if __name__ == "__main__":
    main()
