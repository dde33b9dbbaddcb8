"""The flags and the command line of every script: Args in two levels (TrainArgs for every trainer,
RLArgs for the RL ones; a script's Args adds its own), each field with its --help, one-line errors,
seeds, thread counts. Nothing here knows an algorithm."""
import argparse
import dataclasses
import os
import random
import sys
from dataclasses import field

import torch


class CountdownError(Exception):
    """A mistake the user can fix: printed as one line by cli(), never as a traceback."""


# ---- args ----------------------------------------------------------------------------------------
def arg(default, help):
    """A dataclass field with its --help text next to it: `lr: float = arg(5e-5, "peak lr")`."""
    return field(default=default, metadata={"help": help})


def parse_args(cls, argv=None):
    """argparse from an Args dataclass: `--foo_bar` and `--foo-bar` both work, bools get
    --x/--no-x."""
    doc = (sys.modules[cls.__module__].__doc__ or "").strip()
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        kind = {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type), f.type)
        help = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=f.default, help=help)
        else:
            p.add_argument(*names, dest=f.name, type=kind, default=f.default, help=help)
    args = cls(**vars(p.parse_args(argv)))
    if getattr(args, "save_every", 1) < 1:  # `step % 0` ended a run at its first save
        raise CountdownError(f"--save_every must be at least 1 (the last step saves whatever it "
                             f"is), not {args.save_every}")
    return args


@dataclasses.dataclass
class TrainArgs:
    """The flags every training script shares, in this order. A script's Args extends this (or
    RLArgs) and redeclares only the fields whose default, its paper's, or whose help differs."""
    init: str = arg("out/sft",
                    "checkpoint to start from: a dir, a hub name, or `tiny` (a new tiny model)")
    data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4",
                    "tasks whose prompts are rolled out (its train split)")
    eval_data: str = arg("Jiayi-Pan/Countdown-Tasks-3to4",
                         "tasks for periodic pass@k (its `val` split)")
    output_dir: str = arg("out/run", "where the checkpoint, args.json and metrics.jsonl go")
    seed: int = arg(0, "seed for task order and sampling")
    template: str = arg("base", "prompt template: base | compact")
    lr: float = arg(1e-5, "learning rate")
    batch_size: int = arg(128, "prompts per optimizer step")
    micro_batch: int = arg(8, "rows per forward/backward (bounds memory)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    grad_clip: float = arg(1.0, "global grad-norm clip")
    max_prompt_len: int = arg(512, "prompts longer than this are an error")
    max_response_len: int = arg(1024, "rollout budget in new tokens")
    eval_every: int = arg(50, "steps between held-out evaluations (0: only at start and end)")
    eval_problems: int = arg(200, "held-out problems per evaluation")
    eval_samples: int = arg(16, "samples per problem (pass@k up to this)")
    eval_max_new_tokens: int = arg(1024, "generation budget at evaluation")
    decode: str = arg("auto", "the HF sampler's decode loop: auto (the faster here: "
                              "plumbing/fast_decode.py's) | plain (common.py's, over transformers' "
                              "cache) | dynamic | static | graph (common.HFSampler)")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward to save memory")
    wandb_project: str = arg("", "log to this wandb project too (off when empty)")
    save_every: int = arg(25, "steps between resumable states in OUTPUT_DIR/state (the newest 2 "
                              "are kept)")
    resume: str = arg("", "continue the run saved in this dir from its newest state (it becomes "
                          "the output dir)")
    overwrite: bool = arg(False, "start again in a non-empty --output_dir (refused otherwise)")
    skip_nonfinite: bool = arg(False, "drop a step whose loss or gradient is NaN/inf instead of "
                                      "stopping the run")
    lora_rank: int = arg(0, "LoRA rank through peft (001 §3.1.2: 32 for the warm start; 002 §5: 8 "
                            "for GRPO); 0: full fine-tuning. Checkpoints are saved merged")
    lora_alpha: float = arg(0.0, "LoRA alpha; 0: twice the rank")
    lora_targets: str = arg("all-linear", "modules LoRA adapts: all-linear (every projection but "
                                          "the LM head) or comma-separated names, e.g. "
                                          "q_proj,v_proj")
    fsdp: bool = arg(False, "under torchrun: FSDP2's fully_shard, the weights, gradients and AdamW "
                            "state sharded over the ranks, instead of DDP (README: More GPUs)")

    def policy_options(self):
        """load_policy's keyword arguments."""
        return dict(gradient_checkpointing=self.gradient_checkpointing, lora_rank=self.lora_rank,
                    lora_alpha=self.lora_alpha, lora_targets=self.lora_targets)

    def run_options(self, output_dir):
        """The plumbing flags as harness.Run's keyword arguments; args.json records the dir written
        to."""
        return dict(seed=self.seed, resume=self.resume,
                    skip_nonfinite=self.skip_nonfinite, eval_every=self.eval_every,
                    wandb_project=self.wandb_project,
                    config={**dataclasses.asdict(self), "output_dir": output_dir})


@dataclasses.dataclass
class RLArgs(TrainArgs):
    """On-policy RL, shared by rloo, grpo, opd and rlt: B prompts x G rollouts a step."""
    warmup_steps: int = arg(0, "linear lr warm-up over this many steps, then constant (0: none, "
                               "as the papers)")
    max_steps: int = arg(200, "optimizer steps, one rollout batch each (000 Table 5)")
    group_size: int = arg(8, "G rollouts per prompt (000 Table 5)")
    temperature: float = arg(1.0, "rollout temperature; log-probs are of logits / T (000 Table 5: "
                                  "1.0; top_p 1, no top_k)")
    backend: str = arg("hf",
                       "sampler: hf (plain PyTorch, CPU ok) | vllm (GPU; pinned in common.py)")
    term_grads: bool = arg(False, "on the first step and every evaluating one, also back-propagate "
                                  "each loss term alone (grad/<term>: each knob's pull, "
                                  "docs/studies/loss_terms.md). Costs a backward a term and the "
                                  "graph kept for them: a walkthrough RLOO step peaked at 60.4 GB with it "
                                  "against an estimate of 34.9, 26.85 GB without (docs/gpu.md)")

    async_steps: int = arg(0, "k: the sampler runs k steps ahead in a process of its own, so "
                              "step t trains on rollouts of the weights after step t − 1 − k "
                              "(TRL's AsyncGRPOTrainer, tinker's sampling_steps_ahead; 0: the "
                              "loop takes turns; --backend hf on a CPU, one process; "
                              "docs/studies/off_policy.md)")
    sampler_threads: int = arg(1, "k ≥ 1: the sampler process's threads, taken from the trainer's")
    log_rollouts: int = arg(0, "groups a step written to rollouts.jsonl (prompt, completions, "
                               "rewards, advantages, importance weights, the version that "
                               "sampled them); two steps side by side: python -m "
                               "plumbing.rollout_log OUTPUT_DIR STEP STEP")
    prompt_forward: str = arg("auto", "the update's forward: shared (micro-batches of whole "
                                      "groups, each prompt's forward once for its G rollouts, "
                                      "common.decoder_states; auto on a CPU) | per_row (every "
                                      "row whole; auto on a GPU and with "
                                      "--gradient_checkpointing)")
    forward_rows: int = arg(16, "shared: rollouts a forward runs, sorted by length, within a "
                                "micro-batch of whole groups (each forward padded to its "
                                "longest; 16-32 ran fastest on a CPU, docs/studies/performance.md)")

    def run_options(self, output_dir):
        return {**super().run_options(output_dir), "term_grads": self.term_grads}

    def rollout_options(self):
        """common.rollouts()'s arguments after the temperature, as the sampler process takes them
        (plumbing/async_sampler.py)."""
        return dict(n=self.group_size, template=self.template, max_prompt_len=self.max_prompt_len,
                    max_new_tokens=self.max_response_len, decode=None if self.decode == "auto"
                    else self.decode, bottom_p=getattr(self, "bottom_p", 1.0),
                    bottom_p_freq=getattr(self, "bottom_p_freq", 1.0))

    def shares_prompts(self, model):
        """--prompt_forward resolved for `model`: shared, unless on a GPU (`auto`: its memory
        measured per row, docs/gpu.md) or with --gradient_checkpointing, whose recompute
        transformers runs without the cache that carries the prompts, or with --fsdp, whose layers
        free their gathered weights after a forward while the cache's gradient still needs them
        (said in one line)."""
        check_choice("prompt_forward", self.prompt_forward, ("auto", "shared", "per_row"))
        alone = not (self.gradient_checkpointing or self.fsdp)
        if self.prompt_forward == "shared" and not alone:
            print("--prompt_forward shared: per row instead, since --gradient_checkpointing or "
                  "--fsdp runs the layers without the cache that shares each prompt")
        if self.prompt_forward == "auto":
            return next(model.parameters()).device.type == "cpu" and alone
        return self.prompt_forward == "shared" and alone


def check_choice(flag, value, choices):
    """One line naming the choices when a flag's value is not one of them."""
    if value not in choices:
        raise CountdownError(
            f"--{flag} must be {', '.join(choices[:-1])} or {choices[-1]}, not {value!r}")


def check_rl_args(group_size, reward="sparse", curriculum="none", pg_norm="sum", mu="sampler",
                  positive_weight=1.0):
    """One-line errors for the RL flags every script checks the same way."""
    check_choice("reward", reward, ("sparse", "dense"))
    check_choice("mu", mu, ("sampler", "trainer"))
    check_choice("curriculum", curriculum, ("none", "tiers", "filter"))
    check_choice("pg_norm", pg_norm, ("sum", "mean"))
    if group_size < 2:
        raise CountdownError(
            "--group_size must be at least 2: the advantage compares rollouts of one prompt")
    if positive_weight < 0:
        raise CountdownError(f"--positive_weight must be >= 0, not {positive_weight}")


def check_async(k, backend, lora_rank, dynamic_sampling=False):
    """--async_steps: one line for what the sampler process cannot do (its device and world are
    checked where it starts, plumbing/async_sampler.py)."""
    if k < 0:
        raise CountdownError(f"--async_steps must be 0 (take turns) or more, not {k}")
    why = (backend != "hf" and "--backend vllm (its engine lives in the trainer's process)" or
           lora_rank and "--lora_rank (the sampler process builds the plain model)" or
           dynamic_sampling and "--dynamic_sampling (a refill needs this step's verdicts)")
    if k and why:
        raise CountdownError(f"--async_steps {k} with {why}: the sampler runs ahead with --backend "
                             f"hf on a CPU, in one process; use --async_steps 0")


def check_grpo(args):
    """grpo.py's flags, the GRPO family's and --async_steps among them: one line for a value they
    cannot take. Returns --adaptive_temperature as (T_easy, T_hard), or () when off."""
    check_rl_args(args.group_size, args.reward, args.curriculum)
    check_choice("loss_agg", args.loss_agg, ("seq-mean", "token-mean", "constant"))
    check_choice("ratio_level", args.ratio_level, ("token", "sequence"))
    check_choice("loss_type", args.loss_type, ("clip", "cispo"))
    check_choice("is_correction", args.is_correction, ("auto", "none", "token_truncate",
                                                       "token_mask", "sequence_truncate",
                                                       "sequence_mask"))
    if args.is_correction == "auto":  # resolved here, so args.json records what ran
        args.is_correction = "sequence_mask" if args.async_steps else "none"
    if args.is_cap <= 1:
        raise CountdownError(f"--is_cap must be above 1 (truncate at C, mask outside [1/C, C]), "
                             f"not {args.is_cap}")
    if args.max_sample_batches < 1:
        raise CountdownError(f"--max_sample_batches must be at least 1, not "
                             f"{args.max_sample_batches}")
    if not 0 <= args.overlong_buffer <= args.max_response_len:
        raise CountdownError(f"--overlong_buffer must be 0 (off) to --max_response_len "
                             f"({args.max_response_len}), not {args.overlong_buffer}")
    check_async(args.async_steps, args.backend, args.lora_rank, args.dynamic_sampling)
    return parse_temperatures(args.adaptive_temperature, args.backend, args.bottom_p)


def parse_temperatures(adaptive, backend, bottom_p):
    """grpo.py's --adaptive_temperature as (T_easy, T_hard), or () when off; one line for what
    cannot run."""
    if bottom_p < 1 and backend != "hf":
        raise CountdownError("--bottom_p needs --backend hf: vLLM has no bottom-p sampling")
    try:
        temps = tuple(float(x) for x in adaptive.split(",")) if adaptive else ()
    except ValueError:
        temps = None
    if temps is None or len(temps) not in (0, 2) or any(t <= 0 for t in temps or ()):
        raise CountdownError("--adaptive_temperature must be EASY,HARD (e.g. 0.6,1.5), not "
                             f"{adaptive!r}")
    return temps


def cli(main):
    """Run `main`; a CountdownError becomes one line on stderr and exit code 2."""
    follow_threads()
    try:
        main()
    except CountdownError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def follow_threads():
    """Take the thread count run_cpu.sh's scheduler (plumbing/pipeline.py) gives this stage now:
    when a stage beside it ends, its cores go to the ones still running. Called at the start and once a training
    step; nothing without $COUNTDOWN_THREADS_FILE (torch then keeps OMP_NUM_THREADS or its own)."""
    path = os.environ.get("COUNTDOWN_THREADS_FILE")
    if not path:
        return
    try:
        with open(path) as f:
            n = int(f.read())
    except (OSError, ValueError):  # not written yet
        return
    if n > 0 and n != torch.get_num_threads():
        torch.set_num_threads(n)


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)
