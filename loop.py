"""The run around every training loop, so a script's loop shows only its algorithm. Before it: the
output dir (prepare_run), the policy to train and the frozen models beside it. In it: `Run` owns the
data order, the optimizer step with its finite check, the periodic evaluation (eval_metrics),
checkpoint and resumable state, and the log; `StepStats` adds up a step's metrics over its
micro-batches; `rollout_metrics` are paper 001's flatline diagnostics of an RL batch. Nothing here
knows an algorithm."""
import contextlib
import copy
import os
import random
import shutil
import time
import warnings

import torch

from checkpoints import latest_state, load_state, save_checkpoint, save_state, step_is_finite
from common import CountdownError, Logger, follow_threads
from evaluate import evaluate as run_eval
from logprobs import autocast, trains_in_bf16
from models import check_same_tokenizer, frozen_dtype, load_model
from sampler import HFSampler
from traces import mistake_shares, strategy_metrics, strategy_stats


def prepare_run(output_dir, resume="", overwrite=False):
    """Before a script writes anything, the dir it will write to: `--resume DIR` continues the run
    in DIR; else a non-empty output_dir is refused unless --overwrite, which clears what a run
    appends to."""
    if resume:
        if not latest_state(resume):
            raise CountdownError(
                f"--resume {resume}: no saved training state in {resume}/state "
                "(runs save one every --save_every steps); start it again with --overwrite")
        return resume
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        if not overwrite:
            raise CountdownError(
                f"--output_dir {output_dir} is not empty: pass --overwrite to start it again, "
                f"--resume {output_dir} to continue it, or another --output_dir")
        shutil.rmtree(os.path.join(output_dir, "state"), ignore_errors=True)
        for name in ("metrics.jsonl", "probe.jsonl"):  # probe.jsonl: curriculum.probe's
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(output_dir, name))
    return output_dir


def load_policy(init, gradient_checkpointing=False, compile=False, lora_rank=0, lora_alpha=0.0,
                lora_targets="all-linear", **tiny_overrides):
    """(model, tokenizer, device) to train: fp32 master weights (bf16 compute comes from autocast).
    With lora_rank > 0 only low-rank adapters train (peft; papers 001 and 002): the model is a
    PeftModel, its frozen base in frozen_dtype (bf16 on a GPU: a 7B base is 15 GB, not 30) and its
    adapters in fp32 (peft keeps them so), and save_checkpoint writes it merged, an ordinary
    checkpoint for the next --init. With `compile`, the decoder's forward (what token_stats runs)
    is torch.compile'd; the sampler runs the layers one by one and stays eager."""
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
        if device == "cpu" and trains_in_bf16(device):  # logprobs.autocast's eager attention for
            model.set_attn_implementation("eager")  # good: the recompute must run the forward's
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
        os.environ.pop("COUNTDOWN_THREADS_FILE", None)  # (common.follow_threads)
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
    where SFT's step ran 1.3x faster in bf16 and 1.22x in fp32 (0.74 s against 0.90,
    docs/studies/performance.md); not on an AVX2 CPU, where the compiled step was slower (1.45-1.94 s
    against 1.07 s eager: issue 44's machine), nor on others, not measured. On a CPU, inductor
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


def warmup_lr(opt, lr, step, warmup_steps):
    """Set and return step's lr: linear up to `lr` over warmup_steps, then constant. A function of
    the step, so --resume needs no scheduler state."""
    lr = lr * min(1.0, step / warmup_steps) if warmup_steps > 0 else lr
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def step_seed(seed, step):
    """The sampler's seed for one step: distinct across steps and across runs of nearby --seed."""
    return seed * 100_003 + step  # 100,003 is prime and larger than any run's steps


@torch.no_grad()
def mix_reference(ref, model, mix, step=0, every=1):
    """π_ref ← mix · π_θ + (1 − mix) · π_ref every `every` steps (paper 004 Table 3: a slowly
    moving reference); nothing for no reference or every=0 (a frozen one)."""
    if ref is None or not every or step % every:
        return
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        p_ref.mul_(1 - mix).add_(p, alpha=mix)


class StepStats:
    """A step's metrics summed over its micro-batches as `train/<name>`: token means over the
    batch's `n_tokens` loss tokens, means over its `n_rows` rollouts, maxima, and the
    sampler/trainer log-prob gap (train/sampler_gap, the weight-sync canary: ~1e-7 when an fp32
    trainer is the sampler, ~1e-3 from a bf16 trainer's rounding, ~1e-1 from a sampler one step
    stale). Given the `model` (Run.stats, on diagnose steps), also each loss term's own gradient
    norm as `grad/<term>`."""

    def __init__(self, n_rows, n_tokens, model=None):
        self.n_rows, self.n_tokens = n_rows, max(n_tokens, 1)
        self.sums, self.maxima, self.gap = {}, {}, 0.0
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

    def sampler_gap(self, logp, sampler_logp, mask):
        self.gap += ((logp.detach() - sampler_logp).abs() * mask).sum().item()

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

    def metrics(self, passes=1):
        """The sums over `passes` passes of the batch (GRPO's num_iterations) as their mean per
        pass."""
        out = {f"train/{k}": v / passes for k, v in self.sums.items()}
        out.update({f"train/{k}": v for k, v in self.maxima.items()})
        out.update({f"grad/{k}": torch.sqrt(sum(a.float().square().sum() for a in acc)).item()
                    for k, acc in self.grads.items()})
        return {**out, "train/sampler_gap": self.gap / self.n_tokens}


def behavior_logp(mu, logp, sampler_logp):
    """μ's log-probs of the sampled tokens (b, T-1), for RLOO's and OPD's weight w = π_θ/μ and their
    KL (000 Eq. 3): `sampler`, the sampler's own (the paper's μ, the policy that sampled; a bf16
    engine's rounding moves w too), or `trainer`, this forward's, detached (w = 1 before the
    update: the engine's mismatch left out, as TRL and verl take π_old)."""
    return logp.detach() if mu == "trainer" else sampler_logp


def loss_rows(ro, mask_truncated):
    """Which rollouts the loss keeps (B*G,) and their response tokens: all, or with 002 §3's
    --mask_truncated only those that ended (EOS) within the budget."""
    keep = torch.tensor(ro.finished, dtype=torch.float32) if mask_truncated else \
        torch.ones(len(ro.completion_ids))
    return keep, sum(len(c) for c, k in zip(ro.completion_ids, keep.tolist()) if k)


def rollout_metrics(ro, scores, reward, adv, tasks):
    """Paper 001's flatline diagnostics of an RL batch, its strategies and its mistakes. scores
    (B*G,): verifier scores 0/0.1/1; reward (B, G): what the advantage saw; adv (B*G,); tasks:
    the B prompts' problems. A group whose rewards are all equal has A = 0."""
    n, group_std = len(ro.completion_ids), reward.std(1)  # (B,) within-group spread
    return {"train/reward": reward.mean(), "train/accuracy": (scores == 1).float().mean(),
            "train/format": (scores > 0).float().mean(), "train/reward_std": group_std.mean(),
            "train/adv_std": adv.std(), "train/zero_adv_groups": (group_std == 0).float().mean(),
            "train/resp_len": sum(map(len, ro.completion_ids)) / n,
            # what the reward sees (no complete answer block) and what the budget did (no EOS)
            "train/no_answer": (scores == 0).float().mean(), "train/cut": 1 - sum(ro.finished) / n,
            **strategy_metrics("train", strategy_stats(ro.texts, scores.tolist())),
            **{f"train/mistake/{k}": v for k, v in mistake_shares(
                ro.texts, [t for t in tasks for _ in range(n // len(tasks))]).items()}}


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
        summary, _ = run_eval(model, tokenizer, tasks, n_samples, max_new_tokens=max_new_tokens,
                              template=template, seed=seed, sampler=sampler)
    sampler.sleep()
    model.train(was_training)
    return {"eval/format_rate": summary["format_rate"],
            **{f"eval/pass@{k}": v for k, v in summary["pass_at_k"].items()},
            **strategy_metrics("eval", summary["strategies"]),
            **{f"eval/mistake/{k}": v for k, v in summary["mistakes"].items()}}


class Run:
    """Everything around a training loop that is not its algorithm. On --resume it restores the
    weights, optimizer, schedule, RNGs, moving reference and data order of the newest state, so
    step start+1 runs as if never stopped. `evaluate()` returns the eval/ metrics: run at step 0,
    every `eval_every` steps and at the end, each time beside an HF checkpoint in output_dir; a
    resumable state every `save_every`."""

    def __init__(self, output_dir, total_steps, model, tok, opt, evaluate, *, sched=None, ref=None,
                 seed=0, resume=False, grad_clip=1.0, skip_nonfinite=False, eval_every=0,
                 save_every=25, config=None, wandb_project="", eval_first=True, lr=None,
                 warmup_steps=0, term_grads=False):
        self.output_dir, self.total, self.model, self.tok = output_dir, total_steps, model, tok
        self.opt, self.evaluate, self.sched, self.ref = opt, evaluate, sched, ref
        # lr: a constant lr after warm-up; None: `sched` sets it
        self.lr, self.warmup_steps = lr, warmup_steps
        self.grad_clip, self.skip_nonfinite = grad_clip, skip_nonfinite
        self.eval_every, self.save_every = eval_every, save_every
        self.eval_first = eval_first  # SFT has nothing to measure at step 0
        self.term_grads = term_grads  # measure each loss term's own gradient on diagnose steps
        self.rng = random.Random(seed)  # the data order's
        self.start, self.extra = 0, {}
        if resume:
            self.start, self.extra = load_state(output_dir, model, opt, sched, self.rng, ref)
        self.order, self.skipped = self.extra.get("order", []), self.extra.get("skipped", 0)
        self.pool_size = self.extra.get("pool_size")  # the pool `order` shuffles
        self.grad_norms = []  # this step's (GRPO makes several)
        if config is not None:  # and the precision its training forwards compute in
            bf16 = trains_in_bf16(model.device.type)
            config = {**config, "train_compute": "bf16" if bf16 else "fp32"}
        self.log = Logger(output_dir, total_steps, config, wandb_project, self.start)

    def steps(self):
        """Step numbers from the first not yet done; logs the start's evaluation on a fresh run."""
        if not self.start and self.eval_first:
            self.log.log(0, self.evaluate())  # where the init starts
        for step in range(self.start + 1, self.total + 1):
            follow_threads()  # a stage that ended beside this one left its cores
            self.step, self.t0, self.t_sample = step, time.time(), 0.0
            if self.lr is not None:
                warmup_lr(self.opt, self.lr, step, self.warmup_steps)
            yield step

    def next_indices(self, pool, k):
        """The next k of a shuffled order of `pool` (task indices), reshuffled when fewer than k
        are left or the pool has changed (a curriculum's new tier); and whether it was reshuffled
        (a new epoch)."""
        new_epoch = len(self.order) < k or len(pool) != self.pool_size
        if new_epoch:
            self.order, self.pool_size = self.rng.sample(pool, len(pool)), len(pool)
        idx, self.order = self.order[:k], self.order[k:]
        return idx, new_epoch

    def next_tasks(self, tasks, n, pool=None):
        """The next n tasks, drawn from `pool` (indices into tasks; default all of them)."""
        return [tasks[i] for i in self.next_indices(pool or range(len(tasks)), n)[0]]

    def evaluates(self, step):
        return step == self.total or bool(self.eval_every and step % self.eval_every == 0)

    def stats(self, n_rows, n_tokens):
        """This step's StepStats; with --term_grads, on the first step and every evaluating one it
        also measures each loss term's own gradient (StepStats.term_grads), which costs a backward
        per term and keeps the graph for them."""
        due = self.term_grads and (self.step == self.start + 1 or self.evaluates(self.step))
        return StepStats(n_rows, n_tokens, self.model if due else None)

    def sampled(self):
        """Mark the end of the step's sampling (time/sample)."""
        self.t_sample = time.time() - self.t0

    def optimizer_step(self, step, loss):
        """Clip the gradient, step if the loss and gradient are finite (else stop with one line
        naming the last good state, or with --skip_nonfinite drop the step), then the schedule;
        returns the grad norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        if step_is_finite(step, loss, grad_norm, self.skip_nonfinite, self.output_dir):
            self.opt.step()
        else:
            self.skipped += 1
        if self.sched is not None:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.grad_norms.append(grad_norm.item())
        return grad_norm

    def end_step(self, step, metrics, **extra):
        """Log the step's metrics (with lr, grad norm, skipped steps and times), evaluate and
        checkpoint when due, and save a resumable state when due (with the script's `extra` data
        state)."""
        now = time.time()
        metrics.update({"train/lr": self.opt.param_groups[0]["lr"],
                        "train/skipped_steps": self.skipped,
                        "train/grad_norm": sum(self.grad_norms) / len(self.grad_norms),
                        "time/sample": self.t_sample, "time/update": now - self.t0 - self.t_sample,
                        "time/step": now - self.t0})
        self.grad_norms = []
        if self.evaluates(step):  # the checkpoint first: an evaluation that fails loses nothing
            save_checkpoint(self.model, self.tok, self.output_dir)
            metrics.update(self.evaluate())
        self.log.log(step, metrics)
        if step == self.total or step % self.save_every == 0:
            save_state(self.output_dir, step, self.model, self.opt, self.sched, self.rng, self.ref,
                       order=self.order, pool_size=self.pool_size, skipped=self.skipped,
                       **extra)

    def close(self):
        self.log.close()
        print(f"saved {self.output_dir}" if self.total else "no training steps")
