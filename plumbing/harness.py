"""The run harness around every training loop: its mechanics, never its decisions (the script's
loop says when it evaluates, checkpoints, saves and stops). Before the loop: the output dir
(prepare_run), the policy to train and the frozen models beside it. In it: `Run` restores a
resumed run, owns the data order, the non-finite stop (`finite`, called by the script between its
gradient clip and its optimizer step), the files (`checkpoint`, `save`) and the log (`log`, through
`Logger`: metrics.jsonl, the console, wandb); `StepStats` adds up a step's metrics over its
micro-batches; `warmup_lr` is the RL scripts' schedule. Nothing here knows an algorithm."""
import contextlib
import copy
import json
import os
import random
import shutil
import time
import warnings

import torch

from plumbing.checkpoints import (latest_state, load_state, save_checkpoint, save_state,
                                  step_is_finite)
from plumbing import distributed as ranks
from plumbing import rollout_log
from plumbing.flags import CountdownError, follow_threads
from plumbing.async_sampler import AheadSampler  # noqa: F401  the scripts take it from here
from plumbing.models import check_same_tokenizer, frozen_dtype, load_model, trains_in_bf16
from plumbing.tasks import load_tasks


def prepare_run(output_dir, resume="", overwrite=False):
    """Before a script writes anything, the dir it will write to: `--resume DIR` continues the run
    in DIR; else a non-empty output_dir is refused unless --overwrite, which clears what a run
    appends to."""
    ranks.distributed()  # under torchrun: with the other ranks, each looking before rank 0 writes
    if resume and not latest_state(resume):
        raise CountdownError(
            f"--resume {resume}: no saved training state in {resume}/state "
            "(runs save one every --save_every steps); start it again with --overwrite")
    clear = not resume and os.path.isdir(output_dir) and bool(os.listdir(output_dir))
    if clear and not overwrite:
        raise CountdownError(
            f"--output_dir {output_dir} is not empty: pass --overwrite to start it again, "
            f"--resume {output_dir} to continue it, or another --output_dir")
    ranks.barrier()
    if clear and not ranks.rank():
        shutil.rmtree(os.path.join(output_dir, "state"), ignore_errors=True)
        for name in ("metrics.jsonl", "probe.jsonl"):  # probe.jsonl: curriculum.probe's
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(output_dir, name))
    return resume or output_dir


def load_policy(init, gradient_checkpointing=False, compile=False, lora_rank=0, lora_alpha=0.0,
                lora_targets="all-linear", **tiny_overrides):
    """(model, tokenizer, device) to train: fp32 master weights (bf16 compute comes from autocast).
    With lora_rank > 0 only low-rank adapters train (peft; papers 001 and 002): the model is a
    PeftModel, its frozen base in frozen_dtype (bf16 on a GPU: a 7B base is 15 GB, not 30) and its
    adapters in fp32 (peft keeps them so), and save_checkpoint writes it merged, an ordinary
    checkpoint for the next --init. With `compile`, the decoder's forward (what token_stats runs)
    is torch.compile'd; the sampler runs the layers one by one and stays eager. Under torchrun the
    rank joins the others first, and "cuda" is its own card (plumbing/distributed.py)."""
    ranks.distributed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = frozen_dtype(device) if lora_rank > 0 else torch.float32
    model, tok = load_model(init, device, dtype, **tiny_overrides)
    # from_pretrained returns eval mode, where transformers never checkpoints: train mode is what
    # makes --gradient_checkpointing act (Qwen2 has no dropout, so nothing else changes). The
    # sampler and evaluation switch to eval mode and back.
    model.train()
    if gradient_checkpointing:  # recompute each layer's activations in backward, not keep them
        # transformers 5 renamed it (5.24: the old name goes in v6); older releases know the old
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if device == "cpu":  # common.autocast's attention for good: the recompute must run the
            model.set_attn_implementation("cpu_attention")  # forward's
    if lora_rank > 0:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise CountdownError("--lora_rank needs peft: pip install -e '.[lora]'") from None
        targets = lora_targets if lora_targets == "all-linear" else lora_targets.split(",")
        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha or 2 * lora_rank, lora_dropout=0.0,
                            target_modules=targets)
        try:
            with warnings.catch_warnings():  # peft 0.21 reads transformers' old name: not ours
                warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
                model = get_peft_model(model, config)
        except ValueError as e:  # a target name the model does not have
            raise CountdownError(f"--lora_targets {lora_targets}: {e}") from None
    if compile and compile_pays(device):  # dynamic: each micro-batch has its own length; the
        model.get_decoder().compile(dynamic=True)  # first call compiles
        # and compiles again for another thread count: handed a second thread with 74 steps
        # left, the fp32 sft stage stalled 82 s recompiling, then stepped in 0.53 s, not 0.81:
        # a loss unless ~300 steps are left. It keeps the threads it started with
        os.environ.pop("COUNTDOWN_THREADS_FILE", None)  # (flags.follow_threads)
    return model, tok, device


def load_frozen(name, device, tok, policy_name):
    """A model that never trains (a teacher, a student), in frozen_dtype; it must share the policy's
    tokenizer."""
    model, other_tok = load_model(name, device, frozen_dtype(device))
    check_same_tokenizer(tok, other_tok, policy_name, name)
    return model.eval().requires_grad_(False)


def frozen_copy(model):
    """A frozen copy of `model` (a reference π_ref) in frozen_dtype."""
    return copy.deepcopy(model).to(frozen_dtype(model.device)).eval().requires_grad_(False)


def compile_pays(device):
    """--compile where it is measured faster and can build: on a GPU, and on a CPU with AVX512,
    where SFT's step ran 1.25x faster (0.473 s against 0.591, docs/studies/performance.md, though
    its compile costs more than that saves over the pipeline's SFT); not on an AVX2 CPU, where the
    compiled step was slower, nor on others, not measured. On a CPU, inductor
    needs a C++ compiler with OpenMP and Python's headers (absent on a bare Ubuntu/WSL, or macOS
    without libomp): a small kernel is compiled first, and where it fails the run goes on eager
    with one line saying why, not a traceback at its first step."""
    if device == "cuda":
        return True
    isa = torch.backends.cpu.get_cpu_capability()  # AVX512, AVX2, DEFAULT (e.g. ARM), ...
    if not isa.startswith("AVX512"):
        print(f"--compile: skipped on this {isa} CPU (it paid only with AVX512; slower on AVX2)")
        return False
    try:
        torch.compile(lambda x: (x @ x).relu().sum(-1))(torch.randn(8, 8))
    except Exception as e:  # inductor's InvalidCxxCompiler, a missing omp.h or Python.h, ...
        why = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        print(f"--compile: skipped, no working C++ compiler for torch.compile here ({why[:160]})")
        return False
    finally:
        torch._dynamo.reset()  # the probe's graph is not the model's
    return True


def held_out(args):
    """evaluate.eval_metrics's arguments after the model and tokenizer for a training script's
    periodic evaluation: --eval_problems of --eval_data's val split, --eval_samples each, ..."""
    return (load_tasks(args.eval_data, "val", args.eval_problems), args.eval_samples,
            args.eval_max_new_tokens, args.template, args.seed)


def warmup_lr(opt, lr, step, warmup_steps):
    """Set and return step's lr: linear up to `lr` over warmup_steps, then constant. A function of
    the step, so --resume needs no scheduler state."""
    lr = lr * min(1.0, step / warmup_steps) if warmup_steps > 0 else lr
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def step_seed(seed, step, draw=0):
    """The sampler's seed for one step's `draw`-th batch (grpo.py's --dynamic_sampling samples again):
    distinct across steps, draws and runs of nearby --seed."""
    return seed * 100_003 + step + draw * 1_000_003  # primes larger than any run's steps


def grpo_stats(stats, out, info, is_weight, cut, m, keep, correction, sequence):
    """grpo.py's micro-batch train/<name>s: token means over the loss's tokens, or over rollouts
    where the thing is a rollout's (GSPO's clip, a sequence-level correction's cut); out:
    token_stats', info: grpo_loss's parts, is_weight and cut: off_policy_weight's."""
    stats.token_mean("entropy", out["entropy"], m)
    stats.token_mean("kl", info["kl"], m)
    stats.token_mean("ratio", info["ratio"], m)
    stats.max("ratio_max", info["ratio"] * m)
    stats.token_mean("is_correction", is_weight, m)  # the mean weight ρ's correction gives
    cut_name = "is_masked" if correction.endswith("mask") else "is_truncated"
    for name, v, of_rows in (("clip_frac", info["clipped"], sequence),
                             (cut_name, cut.float(), correction.startswith("sequence"))):
        if name == "clip_frac" or correction != "none":  # (is_truncated, is_masked)
            if of_rows:  # a rollout's: its first token's
                stats.row_mean(name, v[:, 0] * keep)
            else:
                stats.token_mean(name, v, m)


class StepStats:
    """A step's metrics summed over its micro-batches as `train/<name>`: token means over the
    batch's `n_tokens` loss tokens, means over its `n_rows` rollouts, maxima, and the
    sampler/trainer log-prob gap (train/sampler_gap, the weight-sync canary: ~1e-7 when an fp32
    trainer is the sampler, ~1e-3 from a bf16 trainer's rounding, ~1e-1 from a sampler one step
    stale). Given the `model` (Run.stats, on diagnose steps), also each loss term's own gradient
    norm as `grad/<term>`."""

    def __init__(self, n_rows, n_tokens, model=None):
        # under torchrun, this rank's share of a mean's count (Run.stats): the means of the shares
        # over the ranks, in metrics() as in DDP's gradient, are the whole batch's
        self.n_rows, self.n_tokens = n_rows, max(n_tokens, 1)
        self.sums, self.maxima, self.gap = {}, {}, None  # gap: the RL scripts'
        self.ess, self.log_rho = [0.0, 0.0], {}  # Σρ_i, Σρ_i² and row -> log ρ_i (sampler_gap)
        self.params = [] if model is None else [p for p in model.parameters() if p.requires_grad]
        self.grads = {}  # term -> its gradient, summed over micro-batches

    def add(self, name, value):
        self.sums[name] = self.sums.get(name, 0.0) + value

    def token_mean(self, name, per_token, mask):
        """per_token, mask: (b, T-1); this micro-batch's share of the mean over the batch's
        tokens."""
        self.add(name, (per_token.detach() * mask).sum().item() / self.n_tokens)

    def row_mean(self, name, per_row):
        """per_row: (b,); this micro-batch's share of the mean over the batch's rollouts."""
        self.add(name, per_row.detach().sum().item() / self.n_rows)

    def max(self, name, value):
        self.maxima[name] = max(self.maxima.get(name, 0.0), value.max().item())

    def sampler_gap(self, logp, sampler_logp, mask, rows=()):
        """The trainer's π (before the update) against the sampler's μ on the sampled tokens, mask
        (b, T-1): the mean |log π − log μ| (train/sampler_gap), k3's estimate of KL(μ‖π)
        (train/mismatch: staleness and precision alike), and each rollout's ρ_i = Π_t π/μ, whose
        effective sample size (Σρ)²/(n Σρ²) is train/is_ess (1: all equal; Huang et al. 2026,
        "Stable Asynchrony", watch it fall) and whose log, by row, the rollouts' log keeps."""
        d = (logp.detach() - sampler_logp) * mask  # (b, T-1) log π/μ
        self.gap = (self.gap or 0.0) + d.abs().sum().item()
        self.token_mean("mismatch", d.exp() - 1 - d, mask)  # k3: r − 1 − log r, r = π/μ
        seq = d.sum(-1).double()  # (b,) log ρ_i
        rho = seq.clamp(-300, 300).exp()
        self.ess = [self.ess[0] + rho.sum().item(), self.ess[1] + rho.square().sum().item()]
        self.log_rho.update(zip(rows, seq.tolist()))

    def term_grads(self, terms, scale):
        """How much of the update each knob really moves (grad/pg, grad/entropy, grad/kl: the
        script's KL term, as train/kl). terms: name -> per-rollout (b,) values of that term as the
        loss weights it, so that sum / scale is this micro-batch's share of it. Each term is
        back-propagated alone (before the loss's own backward, which frees the graph). Costs one
        backward and one gradient copy per term, on diagnose steps only."""
        for name, term in terms.items() if self.params else ():
            acc = self.grads.setdefault(name, [torch.zeros_like(p) for p in self.params])
            if not term.requires_grad:  # a term switched off (β = 0: no reference)
                continue
            grads = torch.autograd.grad(term.sum() / scale, self.params, retain_graph=True,
                                        allow_unused=True)
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g)

    def metrics(self, passes=1, per_token=False):
        """The sums over `passes` passes of the batch (GRPO's num_iterations) as their mean per
        pass (per_token: per loss token too); under torchrun, of every rank's."""
        gap = {} if self.gap is None else {"sampler_gap": self.gap, "ess": self.ess[0],
                                           "ess_sq": self.ess[1]}
        sums = ranks.reduce({**self.sums, **gap})
        per = passes * (self.n_tokens if per_token else 1)
        out = {f"train/{k}": v / per for k, v in sums.items() if k not in gap}
        out.update({f"train/{k}": v for k, v in ranks.reduce(self.maxima, "max").items()})
        for k, acc in self.grads.items():
            norm = torch.sqrt(sum(ranks.mean_tensor(a).float().square().sum() for a in acc))
            out[f"grad/{k}"] = norm.item()
        if gap:  # (Σρ)² / (n Σρ²) over every rank's rollouts (the means of the ranks' sums)
            out["train/sampler_gap"] = sums["sampler_gap"] / self.n_tokens
            out["train/is_ess"] = sums["ess"] ** 2 / max(self.n_rows * sums["ess_sq"], 1e-300)
        return out


class Run:
    """The mechanics around a training loop, none of its decisions: the script's loop says when it
    evaluates, checkpoints, saves and stops. On --resume (in __init__) it restores the weights,
    optimizer, schedule, RNGs, moving reference and data order of the newest state, so step
    run.start + 1 runs as if never stopped. It also owns the data order, the non-finite stop
    (`finite`, between the script's gradient clip and its optimizer step), the files (`checkpoint`,
    `save`) and the log (`log`: metrics.jsonl, the console, wandb)."""

    def __init__(self, output_dir, total_steps, model, tok, opt, *, sched=None, ref=None,
                 seed=0, resume=False, skip_nonfinite=False, eval_every=0, config=None,
                 wandb_project="", term_grads=False):
        self.output_dir, self.total, self.model, self.tok = output_dir, total_steps, model, tok
        # the optimizer, schedule and moving reference are the script's: Run saves and restores them
        self.opt, self.sched, self.ref = opt, sched, ref
        self.skip_nonfinite = skip_nonfinite
        # --term_grads measures each loss term's own gradient on the first step and every
        # --eval_every (Run.stats)
        self.term_grads, self.eval_every = term_grads, eval_every
        self.rng = random.Random(seed)  # the data order's
        self.start, self.extra = 0, {}
        if resume:
            self.start, self.extra = load_state(output_dir, model, opt, sched, self.rng, ref)
        self.order, self.skipped = self.extra.get("order", []), self.extra.get("skipped", 0)
        self.pool_size = self.extra.get("pool_size")  # the pool `order` shuffles
        self.grad_norms = []  # this step's (GRPO makes several)
        self.step, self.t0, self.t_sample = self.start, time.time(), 0.0
        if config is not None:  # and the precision its training forwards compute in
            bf16 = trains_in_bf16(model.device.type)
            config = {**config, "train_compute": "bf16" if bf16 else "fp32"}
        self.log_file = None if ranks.rank() else Logger(output_dir, total_steps, config,
                                                         wandb_project, self.start)

    def steps(self):
        """Step numbers from the first not yet done (run.start + 1) to the last, each one timed.
        Between steps it takes the cores a stage that ended beside this one left (run_cpu.sh's
        scheduler; nothing outside it): a speed, never a number, changes."""
        for step in range(self.start + 1, self.total + 1):
            follow_threads()
            self.step, self.t0, self.t_sample = step, time.time(), 0.0
            yield step

    def next_indices(self, pool, k):
        """The next k of a shuffled order of `pool` (task indices), reshuffled when fewer than k
        are left or the pool has changed (a curriculum's new tier); and whether it was reshuffled
        (a new epoch). Under torchrun, k is a rank's share: the step takes k x N, rank r the r-th
        k of them, so that every N trains on the same batches."""
        n = ranks.world()
        new_epoch = len(self.order) < k * n or len(pool) != self.pool_size
        if new_epoch:
            self.order, self.pool_size = self.rng.sample(pool, len(pool)), len(pool)
        idx, self.order = self.share(self.order[:k * n]), self.order[k * n:]
        return idx, new_epoch

    @staticmethod
    def share(items):
        """This rank's contiguous share of a step's items (all of them in one process)."""
        k = len(items) // ranks.world()
        return items[k * ranks.rank():k * (ranks.rank() + 1)]

    @staticmethod
    def mean(metrics):
        """A dict of means over this rank's share, as the means over every rank's."""
        return ranks.reduce(metrics)

    def on_rank0(self, fn):
        """fn() by rank 0 alone (with the whole model under FSDP); the other ranks wait."""
        return ranks.on_rank0(fn, self.model)

    def next_tasks(self, tasks, n, pool=None):
        """The next n tasks, drawn from `pool` (indices into tasks; default all of them)."""
        return [tasks[i] for i in self.next_indices(pool or range(len(tasks)), n)[0]]

    def stats(self, n_rows, n_tokens):
        """This step's StepStats; with --term_grads, on the first step, every --eval_every and the
        last, it also measures each loss term's own gradient (StepStats.term_grads), which costs
        a backward per term."""
        due = self.term_grads and (self.step in (self.start + 1, self.total) or bool(
            self.eval_every and self.step % self.eval_every == 0))
        # under torchrun: the step's tokens over all ranks / N, a rank's share of the token means
        n_tokens = ranks.total(n_tokens) / ranks.world()
        return StepStats(n_rows, n_tokens, self.model if due else None)

    def sampled(self):
        """Mark the end of the step's sampling (time/sample)."""
        self.t_sample = time.time() - self.t0

    def finite(self, step, loss, grad_norm):
        """The non-finite stop, between the script's clip and its optimizer step: True when the
        loss and the clipped-to gradient norm are finite. Else it stops the run with one line
        naming the last good state, or with --skip_nonfinite returns False (the script then drops
        the step's gradient) and counts the step. Records the grad norm for the step's log."""
        self.grad_norms.append(float(grad_norm))
        if step_is_finite(step, loss, grad_norm, self.skip_nonfinite, self.output_dir):
            return True
        self.skipped += 1
        return False

    def checkpoint(self):
        """The model as an HF checkpoint in output_dir (the next script's --init), by rank 0."""
        full = ranks.full_state(self.model)  # FSDP: gathered from every rank's shards
        if not ranks.rank():
            save_checkpoint(self.model, self.tok, self.output_dir, full and full[0])
        ranks.barrier()

    def log(self, step, metrics):
        """The step's metrics, with lr, grad norm, skipped steps and times (none at step 0), to
        metrics.jsonl, the console and wandb."""
        if step:
            now = time.time()
            metrics = {**metrics, "train/lr": self.opt.param_groups[0]["lr"],
                       "train/skipped_steps": self.skipped,
                       "train/grad_norm": sum(self.grad_norms) / max(1, len(self.grad_norms)),
                       "time/sample": self.t_sample, "time/update": now - self.t0 - self.t_sample,
                       "time/step": now - self.t0}
        self.grad_norms = []
        if self.log_file:  # rank 0's
            self.log_file.log(step, metrics)

    def log_rollouts(self, step, n_groups, samples, tasks, scores, reward, adv, log_rho):
        """--log_rollouts: the step's first n_groups groups to rollouts.jsonl (rank 0's)."""
        if n_groups and self.log_file:
            rollout_log.append(os.path.join(self.output_dir, "rollouts.jsonl"), step, samples,
                               tasks, scores, reward, adv, log_rho, n_groups)

    def save(self, step, **extra):
        """A resumable state of the step (what --resume restarts from), with the script's `extra`
        data state; by rank 0 (DDP's ranks hold the same; FSDP's shards gathered first)."""
        full = ranks.full_state(self.model, self.opt)
        if not ranks.rank():
            save_state(self.output_dir, step, self.model, self.opt, self.sched, self.rng,
                       self.ref, full, order=self.order, pool_size=self.pool_size,
                       skipped=self.skipped, **extra)
        ranks.barrier()

    def close(self):
        ranks.barrier()
        if self.log_file:
            self.log_file.close()
        print(f"saved {self.output_dir}" if self.total else "no training steps")


# ---- the log -------------------------------------------------------------------------------------
CONSOLE = {"train/loss": "loss", "train/reward": "reward", "train/accuracy": "acc",
           "train/token_acc": "tok_acc", "eval/loss": "eval_loss", "eval/pass@1": "pass@1",
           "train/resp_len": "len", "time/step": "s"}


class Logger:
    """metrics.jsonl always, one console line per step under a tqdm bar, wandb only if asked."""

    def __init__(self, output_dir, total_steps, config=None, wandb_project="", start_step=0):
        from tqdm import tqdm
        os.makedirs(output_dir, exist_ok=True)
        if config is not None:  # the run's arguments
            with open(os.path.join(output_dir, "args.json"), "w") as f:
                json.dump(config, f, indent=1)
        path = os.path.join(output_dir, "metrics.jsonl")
        for log in (path, os.path.join(output_dir, "rollouts.jsonl")):  # resumed: drop what was
            rollout_log.keep_steps(log, start_step)                    # logged after the state
        self.file = open(path, "a")
        self.total, self.t0 = total_steps, time.time()
        self.bar = tqdm(total=total_steps, initial=start_step, leave=False, dynamic_ncols=True)
        self.wandb = None
        if wandb_project:
            import wandb
            self.wandb = wandb.init(project=wandb_project, config=config)

    def log(self, step, metrics):
        metrics = {k: float(v) for k, v in metrics.items()}
        row = {"step": step, "wall": round(time.time() - self.t0, 2), **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(metrics, step=step)
        shown = [f"{short} {metrics[k]:.3g}" for k, short in CONSOLE.items() if k in metrics]
        self.bar.write(" | ".join([f"step {step}/{self.total}"] + shown))
        self.bar.n = step
        self.bar.refresh()

    def close(self):
        self.bar.close()
        self.file.close()
        if self.wandb:
            self.wandb.finish()
