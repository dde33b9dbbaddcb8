"""The peer, side by side: TRL's GRPOTrainer or RLOOTrainer on a checkpoint this repo wrote, loaded as a
TRL user loads it (AutoTokenizer, AutoModelForCausalLM: no code of ours between), with the recipe of
run_cpu.sh's `grpo` or `rloo` stage: the same training prompts (the compact template), reward (1 for a
solved problem, else 0: --wrong_reward 0 --no_answer_reward 0), 32 prompts x 8 rollouts a step, lr 6.7e-5
constant, temperature 0.7 (top_p 1, no top_k), 160 new tokens, grad clip 1, and the stage's KL weight
(GRPO β 0.04, ε 0.2, token-mean, TRL's "dapo"; RLOO's 0.001, which TRL puts in the reward, where rloo.py
puts it in the loss). Where TRL's algorithm differs from the stage's, TRL's stays (docs/studies/
performance.md, The peer). Needs the optional extra: pip install -e '.[trl]'.

    python benchmarks/trl_peer.py grpo --init out/cpu/sft --output_dir out/trl/grpo [--max_steps 75] [--bf16]

OUTPUT_DIR gets the trained checkpoint (python evaluate.py --model OUTPUT_DIR scores it), metrics.jsonl
(a line a step: seconds, the part spent sampling and scoring, reward, completion length) and summary.json
(the median seconds a step after the first, sampling and update apart, peak resident memory).
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import verifier  # noqa: E402  the task's scorer: TRL's reward function calls it
from plumbing.tasks import load_tasks  # noqa: E402  the prompts' source, as the scripts read it

DATA = "gen:nums=3,range=1-20,test=200,val=100"


def reward(completions, nums, target, **_):
    """run_cpu.sh's RL reward: 1 for a solved problem, 0 for anything else."""
    return [float(verifier.score(c, n, t) == 1.0) for c, n, t in zip(completions, nums, target)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trainer", choices=["grpo", "rloo"])
    p.add_argument("--init", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=75)
    p.add_argument("--bf16", action="store_true", help="train under bf16 autocast (else fp32)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    import trl
    if a.threads:
        torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.init)  # as a TRL user loads a checkpoint
    model = AutoModelForCausalLM.from_pretrained(a.init, dtype=torch.float32)
    tasks = load_tasks(DATA, "train", 32 * a.max_steps)
    data = Dataset.from_list([{"prompt": verifier.make_prompt(t["nums"], t["target"], "compact"),
                               "nums": t["nums"], "target": t["target"]} for t in tasks])
    shared = dict(output_dir=a.output_dir, max_steps=a.max_steps, learning_rate=6.7e-5,
                  lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, use_cpu=True,
                  bf16=a.bf16, num_generations=8, per_device_train_batch_size=64,
                  gradient_accumulation_steps=4,  # 256 rollouts (32 prompts x 8) an optimizer step
                  temperature=0.7, top_p=1.0, max_completion_length=160, logging_steps=1,
                  save_strategy="no", report_to=[], seed=0, shuffle_dataset=False,
                  num_iterations=1, epsilon=0.2)
    if a.trainer == "grpo":
        config = trl.GRPOConfig(**shared, beta=0.04, loss_type="dapo", scale_rewards="group",
                                weight_decay=0.0)
        Trainer = trl.GRPOTrainer
    else:
        config = trl.RLOOConfig(**shared, beta=0.001, weight_decay=1e-4)
        Trainer = trl.RLOOTrainer
    trainer = Trainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                      processing_class=tok)
    # the sampling (and scoring) part of each step: TRL's generate-and-score, timed where it runs
    sampling = {"s": 0.0}
    generate = trainer._generate_and_score_completions

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = generate(*args, **kwargs)
        sampling["s"] += time.perf_counter() - t
        return out
    trainer._generate_and_score_completions = timed
    rows = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t, sampling["s"] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, *_, **__):
            rows.append({"step": state.global_step, "time/step": time.perf_counter() - self.t,
                         "time/sample": sampling["s"]})

        def on_log(self, args, state, control, logs=None, **__):
            if rows and logs and "reward" in logs:  # not the summary logged at the end
                rows[-1].update({"train/reward": logs.get("reward"),
                                 "train/resp_len": logs.get("completions/mean_length")})
    trainer.add_callback(Clock())
    trainer.train()
    trainer.save_model(a.output_dir)  # model and tokenizer: evaluate.py --model reads it
    with open(os.path.join(a.output_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    later = rows[1:] or rows
    summary = {"trainer": f"trl {trl.__version__} {Trainer.__name__}", "init": a.init,
               "precision": "bf16" if a.bf16 else "fp32", "threads": torch.get_num_threads(),
               "steps": len(rows),
               "s_per_step": statistics.median(r["time/step"] for r in later),
               "s_sample": statistics.median(r["time/sample"] for r in later),
               "s_update": statistics.median(r["time/step"] - r["time/sample"] for r in later),
               "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
               "reward": [r.get("train/reward") for r in rows]}
    json.dump(summary, open(os.path.join(a.output_dir, "summary.json"), "w"), indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "reward"}))


if __name__ == "__main__":
    main()
