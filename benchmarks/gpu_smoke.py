"""GPU smoke test: the walkthrough's scripts for a few steps at its real lengths (prompts of ~230
tokens, 1,024 new ones) on a random Qwen2.5-0.5B-shaped model, no hub, no network: per stage, the
peak memory of each phase beside benchmarks/memory.py's estimate, and tokens/s. Run it through
benchmarks/gpu_smoke.sh (its header: the commands, how long each takes).

Stages, in order: sft, evaluate, opd (a random Qwen2.5-7B-shaped teacher in bf16, built in this
process; 0.5B-shaped when less than 60 s of the budget is left), grpo, rloo, sft_lora (step 5's LoRA
and checkpointing flags on the 0.5B shape), ipo (pairs from a file: a random model makes no
on-policy pair) and rlt (the random model both teacher and student; no export). Each runs its
script's main() in this process with the README's flags for its step, then these: the random model,
generated tasks (base template), SFT traces cut at the budget (as the longest real ones), the HF
sampler, 128 rollouts a step, 3 steps, 8 x 4 evaluation samples at step 0 and at the end. With
--term_grads, steps 1 and 3 also back-propagate each loss term alone; step 2's update tokens/s is
the plain one. A random model never stops: every rollout runs to its budget.
Output, OUT/gpu_smoke.jsonl: a setup line, one line per stage, a summary line. A stage's line: its
argv, peak_allocated_gb and peak_reserved_gb per phase (setup; sample: the rollouts; update:
log-probs, loss, backward and AdamW; eval), estimate_gb per phase (memory.py, the same flags, this
card), per step sample_tokens_per_s (rows x response / time/sample), update_tokens_per_s ((prompt +
response) x rows / time/update), sampler_gap and resp_len, and eval_tokens_per_s. A stage that fails
(an OOM too) writes its error and where; the next one runs. No checkpoints or resumable states are
written (the CPU suite tests them; a 0.5B state is 6 GB of disk).
The sampler stage (only with `--stages sampler`) runs no script: HFSampler's three decode loops
(dynamic, a CPU's; static; graph, the static step replayed as a CUDA graph) side by side on the
random 0.5B policy in fp32 (bf16 autocast inside the sampler), at --sampler_rows 128 and 512;
sampler_stage says what each run and check measures. A run that fails writes its error; the next
one runs.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import platform
import random
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repo root, then benchmarks/
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub: fail, never wait
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import memory  # noqa: E402

# The random models' shapes: the real ones (benchmarks/*.json), or tiny ones for a CPU whose vocab
# is padded past the tokenizer's 388 ids as Qwen's is, the teacher's further (151,936 vs 152,064)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
TINY_TEACHER = dict(TINY, hidden_size=96, intermediate_size=192, vocab_size=640)
STEPS = {"sft": "1", "ipo": "2", "rloo": "3", "grpo": "4", "opd": "6", "sft_lora": "5", "rlt": "8b",
         "evaluate": "10", "sampler": None}  # sampler: --backend hf's decode loops, no script
GB = 1e9


class Deadline(Exception):
    """A stage still running at --deadline_s."""


# ---- the random models and the data --------------------------------------------------------------
def qwen_config(path, tok, **overrides):
    """A Qwen2Config from one of benchmarks/*.json, with the tiny tokenizer's EOS and pad (the
    scripts append that EOS to targets and stop on it)."""
    from transformers import Qwen2Config
    with open(path) as f:
        cfg = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    cfg.update(overrides, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=None)
    return Qwen2Config(**cfg)


def random_model(cfg, device, dtype):
    """A Qwen2 with transformers' random init, built on `device` in `dtype` (a 7B in bf16 on a GPU
    in seconds, never through the CPU or the disk)."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)


def write_data(work, tok, n_tasks, n_sft, response_tokens):
    """tasks.jsonl (nums, target: the RL prompts and the evaluations), sft.jsonl (query: the
    base template's prompt of a task; completion: solver traces joined until longer than the
    response budget, so every SFT row is cut at it, as the longest real rows are) and pairs.jsonl
    (IPO: that prompt, its completion chosen, the next row's rejected: both cut at the budget)."""
    from plumbing import traces
    from plumbing.tasks import load_tasks, make_prompt
    tasks = load_tasks("gen:nums=3-4,test=1,val=1", "train", max(n_tasks, n_sft))
    rng = random.Random(0)
    with open(os.path.join(work, "tasks.jsonl"), "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in tasks[:n_tasks])
    rows = []
    for t in tasks[:n_sft]:
        text = ""
        while len(tok(text, add_special_tokens=False)["input_ids"]) <= response_tokens:
            text += traces.make_trace(t["nums"], t["target"], rng, 2.0) + "\n"
        rows.append((make_prompt(t["nums"], t["target"], "base"), text))
    with open(os.path.join(work, "sft.jsonl"), "w") as f:
        f.writelines(json.dumps({"query": q, "completion": c}) + "\n" for q, c in rows)
    with open(os.path.join(work, "pairs.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": q, "chosen": c, "rejected": rows[i - 1][1]}) + "\n"
                     for i, (q, c) in enumerate(rows))
    return max(len(tok(make_prompt(t["nums"], t["target"], "base"))["input_ids"]) for t in tasks)


# ---- per-phase peak memory: marks at the boundaries harness.Run already has ------------------------
class Phases:
    """Peak allocated/reserved CUDA memory between marks, by phase name (the max over steps), and
    the wall time of each evaluation. Run.sampled() ends `sample`, Run.checkpoint() or Run.log()
    ends `update` (log-probs, loss, backward, AdamW), the evaluation between them is `eval`."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.alloc, self.reserved, self.eval_s = {}, {}, []
        self.reset()

    def reset(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def mark(self, phase):
        if self.cuda:
            torch.cuda.synchronize()
            for acc, now in ((self.alloc, torch.cuda.max_memory_allocated()),
                             (self.reserved, torch.cuda.max_memory_reserved())):
                acc[phase] = max(acc.get(phase, 0), now / GB)
        self.reset()

    def timed(self, evaluate):
        """`evaluate`, its wall time appended to eval_s."""
        def call(*a, **kw):
            t = time.time()
            out = evaluate(*a, **kw)
            self.eval_s.append(time.time() - t)
            return out
        return call

    @contextlib.contextmanager
    def watching(self):
        """harness.Run's boundaries marked for the duration; checkpoints and resumable states not
        written (a stage's output dir gets args.json and metrics.jsonl only)."""
        from plumbing import harness
        saved = {k: getattr(harness, k) for k in ("save_checkpoint", "save_state")}
        run_cls = harness.Run
        methods = {k: getattr(run_cls, k) for k in ("__init__", "sampled", "checkpoint", "log")}
        phases, evaluating = self, {}  # the script evaluates between Run.checkpoint and Run.log

        def init(run, *a, **kw):
            methods["__init__"](run, *a, **kw)
            phases.mark("setup")
            evaluating["setup"] = time.time()  # step 0's evaluation, if any, comes next

        def sampled(run):
            methods["sampled"](run)
            phases.mark("sample")

        def checkpoint(run):
            phases.mark("update")
            methods["checkpoint"](run)
            phases.mark("pre-eval")
            evaluating["t"] = time.time()

        def log(run, step, metrics):
            if step == 0 or "t" in evaluating:  # after an evaluation
                phases.eval_s.append(time.time() - evaluating.pop("t", evaluating["setup"]))
                phases.mark("eval")
            else:
                phases.mark("update")
            methods["log"](run, step, metrics)
            phases.mark("log")
        try:
            harness.save_checkpoint = harness.save_state = lambda *a, **kw: None
            run_cls.__init__, run_cls.sampled, run_cls.checkpoint, run_cls.log = (init, sampled,
                                                                                  checkpoint, log)
            yield self
        finally:
            for k, v in methods.items():
                setattr(run_cls, k, v)
            for k, v in saved.items():
                setattr(harness, k, v)


# ---- one stage -----------------------------------------------------------------------------------
def with_flags(command, **flags):
    """The walkthrough's `command` (python SCRIPT.py ...) with `flags` set: an existing one is
    replaced, a True value is a bare switch, a None one removed."""
    words, out, i = shlex.split(command), [], 0
    while i < len(words):
        w = words[i]
        name = w[2:].replace("-", "_") if w.startswith("--") else None
        if name in flags:
            i += 2 if i + 1 < len(words) and not words[i + 1].startswith("--") else 1
            continue
        out.append(w)
        i += 1
    for k, v in flags.items():
        if v is True:
            out.append(f"--{k}")
        elif v is not None:
            out += [f"--{k}", str(v)]
    return out


def run_stage(words, phases, teacher=None):
    """main(argv) of the command's script in this process, opd.py handed `teacher` for its
    load_frozen; the wall time and its output dir's metrics rows."""
    from plumbing import harness
    script = words[1][:-3]
    module = __import__(script)
    load_frozen, t0 = harness.load_frozen, time.time()
    if teacher is not None:  # under whichever name opd.py calls it
        module.load_frozen = harness.load_frozen = lambda *a, **kw: teacher  # noqa: E731
    try:
        with phases.watching():
            if script == "evaluate":  # its main() reads sys.argv; time its sampling alone
                argv, sys.argv, evaluate = sys.argv, ["evaluate.py", *words[2:]], module.evaluate
                module.evaluate = phases.timed(evaluate)
                try:
                    module.main()
                finally:
                    sys.argv, module.evaluate = argv, evaluate
                phases.mark("eval")
            else:
                module.main(words[2:])
    finally:
        if teacher is not None:
            module.load_frozen = harness.load_frozen = load_frozen
    wall = time.time() - t0
    if "--output_dir" not in words:  # evaluate.py
        return wall, []
    with open(os.path.join(words[words.index("--output_dir") + 1], "metrics.jsonl")) as f:
        return wall, [json.loads(x) for x in f]


def throughput(rows, n_rows, prompt_tokens, response_tokens=None):
    """Per logged step: sampling tokens/s (rows x mean response / time/sample) and update tokens/s
    ((prompt + response) x rows / time/update), and the sampler gap."""
    out = {"sample_tokens_per_s": [], "update_tokens_per_s": [], "sampler_gap": [], "resp_len": []}
    for r in rows:
        if r["step"] < 1:  # step 0: the evaluation before training
            continue
        resp = r.get("train/resp_len", response_tokens)
        if r.get("time/sample"):
            out["sample_tokens_per_s"].append(round(n_rows * resp / r["time/sample"]))
        if r.get("time/update"):
            out["update_tokens_per_s"].append(
                round(n_rows * (prompt_tokens + resp) / r["time/update"]))
        if "train/sampler_gap" in r:
            out["sampler_gap"].append(r["train/sampler_gap"])
        out["resp_len"].append(resp)
    return {k: v for k, v in out.items() if v}


def finite(x):
    return all(finite(v) for v in x.values()) if isinstance(x, dict) else \
        all(finite(v) for v in x) if isinstance(x, list) else \
        not isinstance(x, float) or math.isfinite(x)


# ---- the stages ----------------------------------------------------------------------------------
def stage_flags(name, command, work, common, tiny, eval_new, n_pairs):
    """(flags, note): what a stage sets on its walkthrough command."""
    flags, note = {**common, "output_dir": os.path.join(work, "runs", name)}, ""
    if name in ("sft", "sft_lora"):
        # 64 rows: a few micro-batches of the longest rows (--micro_batch_tokens: 13 each)
        flags.update(data=os.path.join(work, "sft.jsonl"), batch_size=16 if tiny else 64,
                     backend=None, **({"micro_batch": 8} if tiny else {}))
        if name == "sft_lora":
            flags["max_steps"] = min(flags["max_steps"], 2)
            note = ("step 5's flags (LoRA r32 on a bf16 base, checkpointing) on the 0.5B shape: "
                    "a 7B base would be 15 GB written and read")
    elif name == "evaluate":
        flags = dict(model=common["init"], data=common["data"], split="val",
                     num_problems=4 if tiny else 32, num_samples=2 if tiny else 16,
                     max_new_tokens=eval_new, backend="hf", out=flags["output_dir"],
                     test_time=None)
        note = "--test_time left out: its draws are this sampler's again, and never end"
    elif name == "ipo":  # pairs from a file, --steps steps of them: no max_steps in ipo.py
        batch = 8 if tiny else 32
        flags.update(pairs=os.path.join(work, "pairs.jsonl"), heldout=0, batch_size=batch,
                     epochs=flags.pop("max_steps") * batch / n_pairs,
                     **({"micro_batch": 4} if tiny else {}))
        note = ("pairs from a file, both responses cut at the budget: a random model's samples "
                "make no on-policy pair, so the sampling of step 2's pairs is not measured")
    else:  # RL: --rows rollouts, in groups of the script's own G
        G = memory.parse_command(command)[1].group_size
        flags["batch_size"] = max(1, common["rows"] // G)
        if name == "rlt":
            flags.update(student=common["init"], export=None)
            note = "--export left out: 2,000 explanations are this sampler's again"
    flags.pop("rows", None)
    return flags, note


def build_teacher(tok, teacher_dir, device, big, tiny):
    """OPD's teacher, random, in models.frozen_dtype (bf16 on a GPU) as harness.load_frozen would
    hold it, built here and handed to opd.py in its place (a 7B's 15 GB never go through the
    disk); its config.json alone is written, for memory.py. (teacher, note)"""
    from plumbing.models import frozen_dtype
    shape = "7b" if big else "0.5b"
    cfg = qwen_config(os.path.join(HERE, f"qwen2.5-{shape}.json"), tok,
                      **(TINY_TEACHER if tiny else {}))
    teacher = random_model(cfg, device, frozen_dtype(device)).eval().requires_grad_(False)
    os.makedirs(teacher_dir, exist_ok=True)
    cfg.save_pretrained(teacher_dir)
    kind = "tiny" if tiny else f"Qwen2.5-{shape.upper()}"
    return teacher, f"teacher: random {kind}-shaped, {frozen_dtype(device)}, built in this process"


def measured(name, rows, words, phases, P, L):
    """A stage's throughputs: per step from its metrics.jsonl, evaluations from their wall time
    (a random model writes every sample to its budget)."""
    out, a = {}, memory.parse_command(shlex.join(words))[1]
    if name == "evaluate":
        n_eval, new = a.num_problems * a.num_samples, a.max_new_tokens
    else:  # SFT: rows; IPO: chosen and rejected; RL: rollouts
        n_rows = a.batch_size * (2 if name == "ipo" else getattr(a, "group_size", 1))
        out.update(throughput(rows, n_rows, P, L))
        steps = [r["step"] for r in rows if r["step"] >= 1]
        out["steps"] = len(steps)
        if getattr(a, "term_grads", False) and steps:  # each loss term's own backward too
            out["diagnose_steps"] = sorted({steps[0], steps[-1]})
        n_eval, new = a.eval_problems * a.eval_samples, a.eval_max_new_tokens
    if phases.eval_s:
        out["eval_tokens_per_s"] = round(n_eval * new / max(phases.eval_s))
    return out


# ---- the sampler stage: the HF sampler's three decode loops side by side -------------------------
# the CUDA runtime and driver calls that launch one kernel (torch.profiler names them so)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GROUP = 8  # rollouts a prompt in the sampler stage: 128 rows are 16 prompts, as an RL step's


def sampler_timed(model, tok, prompts, decode, new, seed=0):
    """One HFSampler(decode=...).generate of `prompts` x GROUP rows, `new` tokens each: its Rollouts
    and times, cut by synchronized marks on plumbing/fast_decode.py's helpers: the prefill, _graphed's
    warm-up step and capture, the loop from the prefill's end to _trim."""
    from plumbing import fast_decode as F
    import common as S
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    marks = {"capture_s": 0.0, "captures": 0, "prefill_s": 0.0, "loop_s": 0.0, "batches": 0}
    saved = F._prefill, F._graphed, F._trim

    def prefill(*a, **kw):
        t = time.time()
        out = saved[0](*a, **kw)
        sync()
        marks["prefill_end"] = time.time()
        marks["prefill_s"] += marks["prefill_end"] - t
        marks["batches"] += 1
        return out

    def graphed(*a, **kw):
        t = time.time()
        out = saved[1](*a, **kw)
        sync()
        marks["capture_s"] += time.time() - t
        marks["captures"] += 1
        return out

    def trim(*a, **kw):  # the decode loop ends
        sync()
        marks["loop_s"] += time.time() - marks["prefill_end"]
        return saved[2](*a, **kw)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.time()
    try:
        F._prefill, F._graphed, F._trim = prefill, graphed, trim
        ro = S.HFSampler(model, tok, decode=decode).generate(prompts, GROUP, 1.0,
                                                             max_new_tokens=new, seed=seed)
    finally:
        F._prefill, F._graphed, F._trim = saved
    sync()
    wall = time.time() - t0
    picks = max(map(len, ro.completion_ids))  # steps the batch ran (every row draws each step)
    # forwards outside the capture: the first token comes from the prefill, and _graphed's
    # warm-up step is in capture_s
    steps = picks - 1 - marks["captures"]
    decode_s = marks["loop_s"] - marks["capture_s"]
    rows = len(ro.completion_ids)
    one = marks["batches"] == 1  # the per-step numbers assume one batch (the KV budget fits it)
    out = dict(rows=rows, decode=decode, new_tokens=new, batches=marks["batches"], wall_s=wall,
               prefill_s=marks["prefill_s"], capture_s=marks["capture_s"],
               tokens_per_s=round(sum(map(len, ro.completion_ids)) / wall),
               decode_steps=steps, step_ms=1000 * decode_s / steps if steps and one else None,
               decode_tokens_per_s=round(rows * steps / decode_s) if steps and one else None,
               finished=sum(ro.finished))
    if cuda:
        out.update(peak_allocated_gb=torch.cuda.max_memory_allocated() / GB,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / GB)
    return ro, out


def launches_per_step(model, tok, prompts, decode, short=3, long=7):
    """Per decode step, from torch.profiler over generate calls of `short` and `long` new tokens
    (their difference: prefill and capture cancel out): kernel launch calls, CUDA graph launches,
    kernels the GPU ran, and aten ops (the CPU's; on a GPU a graph replay runs none)."""
    import common as S
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    counts = []
    for new in (short, long):
        with profile(activities=acts) as prof:
            S.HFSampler(model, tok, decode=decode).generate(prompts, GROUP, 1.0,
                                                            max_new_tokens=new, seed=0)
        by, gpu = Counter(), 0
        for e in prof.key_averages():
            by[e.key] += e.count
            gpu += e.count if str(getattr(e, "device_type", "")).endswith("CUDA") else 0
        counts.append({"kernel_launches": sum(by[k] for k in LAUNCHES),
                       "graph_launches": by["cudaGraphLaunch"], "gpu_kernels": gpu,
                       "aten_ops": sum(v for k, v in by.items() if k.startswith("aten::"))})
    return {k: round((counts[1][k] - counts[0][k]) / (long - short), 1) for k in counts[0]}


def compare(a, b):
    """Two Rollouts of the same prompts and seed: do their tokens agree, and how far apart are the
    log-probs of the tokens they share (each row's prefix up to its first difference)."""
    differ, first, diffs = 0, None, []
    for x, y, lx, ly in zip(a.completion_ids, b.completion_ids, a.logprobs, b.logprobs):
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        if x != y:
            differ += 1
            first = same if first is None else min(first, same)
        diffs += [abs(u - v) for u, v in zip(lx[:same], ly[:same])]
    return {"tokens_identical": differ == 0 and len(a.completion_ids) == len(b.completion_ids),
            "rows_differing": differ, "first_differing_token": first,
            "logprob_max_abs_diff": max(diffs, default=0.0),
            "logprob_mean_abs_diff": sum(diffs) / max(len(diffs), 1)}


def sampler_stage(tok, cfg, device, tasks_path, rows_list, new, eager_new, t_start, budget_s,
                  emit):
    """The HF sampler's decode loops on the random policy (fp32 masters, as an RL script's): per
    row count, dynamic and static for `eager_new` tokens (launch-bound: a step's time hardly
    depends on the length), the graph for `eager_new` (checked against static) and `new`; at the
    first row count each loop's sampler gap (mean |sampler - trainer| log-prob, 8 rows), and last
    its launches per decode step. A line per run (sampler/run) and check (sampler/check) as each
    ends; none starts after `budget_s`. Returns the stage's summary."""
    import common as S
    from common import autocast
    from benchmarks.vllm_check import logprob_gap
    from plumbing.tasks import make_prompt
    with open(tasks_path) as f:
        tasks = [json.loads(x) for x in f]
    prompts = [make_prompt(t["nums"], t["target"], "base") for t in tasks]
    model = random_model(cfg, device, torch.float32).eval()
    cuda = device == "cuda"
    summary = {"rates": {}, "checks": {}, "errors": [], "skipped": [],
               "note": f"{GROUP} rows a prompt; dynamic and static time {eager_new} new tokens, "
                       f"the graph {eager_new} and {new}"}

    def attempt(what, fn, stage="sampler/check", **context):
        """fn() unless past the budget; an error is noted (a line of `stage`), and the stage goes
        on (not past the deadline: Deadline ends it)."""
        if time.time() - t_start > budget_s:
            summary["skipped"].append(what)
            return None
        try:
            return fn()
        except Deadline:
            raise
        except Exception as e:  # an OOM too: note it, free what it held, go on
            summary["errors"].append(f"{what}: {type(e).__name__}: {e}"[:500])
            emit({"stage": stage, **context, "what": what, "ok": False,
                  "error": f"{type(e).__name__}: {e}"[:2000],
                  "where": [x.strip() for x in traceback.format_exc().splitlines()
                            if x.strip().startswith("File ")][-3:]})
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            return None
    decodes = ["dynamic", "static"] + (["graph"] if cuda else [])
    if not cuda:
        why = "CUDA only: the static loop is its eager twin (tests/test_sampler_static.py)"
        emit({"stage": "sampler/run", "decode": "graph", "ok": None, "skipped": why})
        summary["note"] += f"; graph skipped, {why}"
    # a first call of each loop, untimed: CUDA's lazy loading and cuBLAS's set-up go here
    for d in decodes:
        attempt(f"warm-up {d}", lambda: S.HFSampler(model, tok, decode=d).generate(
            prompts[:1], 2, 1.0, max_new_tokens=4, seed=0))
    first = None  # the prompts of the first row count
    for rows in rows_list:
        if rows % GROUP or rows // GROUP > len(prompts):
            summary["errors"].append(f"rows {rows}: not a multiple of {GROUP} up to "
                                     f"{GROUP * len(prompts)}")
            continue
        batch, ros = prompts[:rows // GROUP], {}
        plan = [(d, eager_new) for d in decodes] + ([("graph", new)] if cuda and new != eager_new
                                                    else [])
        for d, n_new in plan:
            def run(d=d, n_new=n_new):
                ro, line = sampler_timed(model, tok, batch, d, n_new)
                emit({"stage": "sampler/run", "ok": True, **line})
                return ro, line
            got = attempt(f"{rows} rows {d} {n_new} tokens", run, "sampler/run", rows=rows,
                          decode=d, new_tokens=n_new)
            if got:
                ros[d, n_new] = got[0]
                summary["rates"][f"{rows}/{d}/{n_new}"] = {
                    k: got[1][k] for k in ("tokens_per_s", "decode_tokens_per_s", "step_ms")}
        if ("graph", eager_new) in ros and ("static", eager_new) in ros:
            check = attempt(f"{rows} rows check", lambda: compare(ros["graph", eager_new],
                                                                 ros["static", eager_new]))
            if check:
                emit({"stage": "sampler/check", "rows": rows, "new_tokens": eager_new,
                      "what": "graph against static, seed 0", **check})
                summary["checks"][f"{rows}/graph_vs_static"] = check
        if first is not None:
            continue
        first = batch
        for d in decodes:  # at the first row count: the trainer's log-probs of 8 of its rows
            if (d, eager_new) not in ros:
                continue
            ro = ros[d, eager_new]
            part = S.Rollouts(ro.prompt_ids[:1], *(x[:GROUP] for x in (
                ro.completion_ids, ro.logprobs, ro.texts, ro.finished)))

            def gap(part=part):
                with autocast(device):
                    return logprob_gap(model, tok, part, 1.0)
            g = attempt(f"sampler gap {d}", gap, decode=d)
            if g is not None:
                emit({"stage": "sampler/check", "decode": d, "what": "sampler gap, 8 rows",
                      "sampler_gap": g})
                summary["checks"][f"sampler_gap/{d}"] = g
    # launches last (they hardly depend on the rows): a graph captured under the profiler is the
    # likeliest part to fail, and then nothing else waits behind it
    for d in decodes if first else []:
        per_step = attempt(f"launches {d}", lambda d=d: launches_per_step(model, tok, first, d),
                           decode=d)
        if per_step:
            emit({"stage": "sampler/check", "decode": d, "what": "per decode step", **per_step})
            summary["checks"][f"launches/{d}"] = per_step
    del model
    return summary


# ---- the plan ------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out/gpu_smoke"),
                   help="where gpu_smoke.jsonl goes (default: $OUT, else out/gpu_smoke)")
    p.add_argument("--work", default="", help="models, data and runs (default: a temp dir)")
    p.add_argument("--tiny", action="store_true", help="tiny models and lengths: a CPU in seconds")
    p.add_argument("--budget_s", type=float, default=300,
                   help="no stage starts after this many seconds; OPD takes a 7B-shaped teacher "
                        "if it starts 60 s before")
    p.add_argument("--deadline_s", type=float, default=420,
                   help="a stage still running at this many seconds is stopped as failed, and the "
                        "summary line written: the whole command ends within ~7.5 min")
    p.add_argument("--stages", default="sft,evaluate,opd,grpo,rloo,sft_lora,ipo,rlt",
                   help="which stages, in this order")
    p.add_argument("--steps", type=int, default=3, help="steps of each training stage")
    p.add_argument("--rows", type=int, default=0,
                   help="rollouts a step (RL): prompts = rows / G (default 128; --tiny 16)")
    p.add_argument("--sampler_rows", default="",
                   help="the sampler stage's row counts (default 128,512; --tiny 16,32)")
    p.add_argument("--sampler_tokens", type=int, default=0,
                   help="new tokens the sampler stage's dynamic and static loops time (default "
                        "256; --tiny 8); the graph also decodes the full 1,024")
    args = p.parse_args(argv)
    args.rows = args.rows or (16 if args.tiny else 128)
    args.sampler_rows = [int(x) for x in (args.sampler_rows or
                                          ("16,32" if args.tiny else "128,512")).split(",")]
    args.sampler_tokens = args.sampler_tokens or (8 if args.tiny else 256)
    if args.tiny:  # fp32 on a CPU: this lane checks the plumbing, the suite's own runs check bf16
        os.environ.setdefault("COUNTDOWN_CPU_BF16", "0")
        # one thread: on tensors this small a second one only adds barrier waits (measured: a
        # step 70x slower with another process busy on the machine's other core)
        torch.set_num_threads(1)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STEPS]
    if unknown or args.steps < 1 or args.rows < 2:
        print("error: " + (f"--stages: no stage {', '.join(unknown)} (there are "
                           f"{', '.join(STEPS)})" if unknown else
                           "--steps must be at least 1 and --rows at least 2"), file=sys.stderr)
        return 2
    t_start = time.time()

    def past_deadline(*_):
        raise Deadline(f"still running at --deadline_s {args.deadline_s:.0f} s")
    signal.signal(signal.SIGALRM, past_deadline)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "gpu_smoke.jsonl")
    work = args.work or tempfile.mkdtemp(prefix="gpu_smoke-")
    os.makedirs(work, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    card = torch.cuda.get_device_properties(0).total_memory if cuda else memory.CARD
    log = open(out_path, "w")

    def emit(row):  # floats to 3 decimals, or 3 digits below 1 (a log-prob gap of 4e-3, 2e-7)
        row = {k: (round(v, 3) if abs(v) >= 1 else float(f"{v:.3g}")) if isinstance(v, float)
               else v for k, v in row.items()}
        log.write(json.dumps(row) + "\n")
        log.flush()
        print("[gpu_smoke]", json.dumps({k: v for k, v in row.items() if k != "argv"}), flush=True)

    # ---- setup: tokenizer, the random 0.5B-shaped policy, the data ----
    import transformers

    from plumbing.checkpoints import save_checkpoint
    from plumbing.models import build_tiny_tokenizer
    tok = build_tiny_tokenizer()
    L, eval_new = (16, 8) if args.tiny else (1024, 1024)  # new tokens: the walkthrough's 1,024
    policy_dir, teacher_dir = os.path.join(work, "policy"), os.path.join(work, "teacher")
    cfg = qwen_config(os.path.join(HERE, "qwen2.5-0.5b.json"), tok, **(TINY if args.tiny else {}))
    t = time.time()
    # bf16 on a GPU halves what is written; the trainers load fp32 masters from it anyway
    model = random_model(cfg, device, torch.bfloat16 if cuda else torch.float32)
    save_checkpoint(model, tok, policy_dir)
    n_params = sum(x.numel() for x in model.parameters())
    del model
    n_sft = 40 if args.tiny else 96  # SFT rows and IPO pairs
    P = write_data(work, tok, 64, n_sft, L)
    gc.collect()
    if cuda:  # the first stage's reserved memory starts from nothing
        torch.cuda.empty_cache()
    emit({"stage": "setup", "ok": True, "device": torch.cuda.get_device_name(0) if cuda else
          platform.processor() or "cpu", "card_gb": round(card / GB, 1),
          "torch": torch.__version__, "transformers": transformers.__version__,
          "policy_params": n_params, "prompt_tokens": P, "max_response_len": L,
          "tiny": args.tiny, "build_s": time.time() - t, "work": work})

    # ---- each stage: the README's command for its step, at this scale ----
    walk = {step: cmd for step, _, cmd in memory.WALKTHROUGH}
    tasks = os.path.join(work, "tasks.jsonl")
    common = dict(init=policy_dir, data=tasks, eval_data=tasks, max_steps=args.steps,
                  eval_every=0, eval_problems=8 if not args.tiny else 2,
                  eval_samples=4 if not args.tiny else 2, eval_max_new_tokens=eval_new,
                  max_response_len=L, save_every=10**6, backend="hf", rows=args.rows)
    done, failed, skipped = [], [], []
    for name in stages:
        elapsed = time.time() - t_start
        if elapsed > args.budget_s or failed and failed[-1].startswith("deadline:"):
            skipped.append(name)
            emit({"stage": name, "ok": None, "skipped": f"time budget ({elapsed:.0f} s spent)"})
            continue
        row = {"stage": name, "walkthrough_step": STEPS[name]}
        phases, teacher = Phases(), None
        signal.alarm(max(1, int(args.deadline_s - elapsed)))
        try:
            if name == "sampler":  # no script: the sampler's loops, timed side by side
                t_stage = time.time()
                row.update(sampler_stage(tok, cfg, device, tasks, args.sampler_rows, L,
                                         min(args.sampler_tokens, L), t_start, args.budget_s,
                                         emit))
                row.update(ok=not row["errors"], wall_s=time.time() - t_stage)
                (done if row["ok"] else failed).append(name)
            else:
                flags, note = stage_flags(name, walk[STEPS[name]], work, common, args.tiny,
                                          eval_new, n_sft)
                if name == "opd":  # a random 7B-shaped teacher if there is time, else a 0.5B one
                    big = cuda and time.time() - t_start < args.budget_s - 60
                    teacher, note = build_teacher(tok, teacher_dir, device, big, args.tiny)
                    flags["teacher"] = teacher_dir
                words = with_flags(walk[STEPS[name]], **flags)
                row.update(argv=words[1:], note=note)
                try:  # memory.py's phases for this command and card; rows never finish (no copy)
                    est = memory.estimate(shlex.join(words), prompt_tokens=P, finishing=False,
                                          card=card)
                    gb = {p: round(sum(t.values()) / GB, 2) for p, t in est.phases.items()}
                    if "step" in gb:  # update and step fall inside one mark here
                        gb["update"] = max(gb["update"], gb.pop("step"))
                    row["estimate_gb"] = gb
                except Exception as e:  # the measurement matters more than the arithmetic
                    row["estimate_gb"] = f"error: {type(e).__name__}: {e}"
                phases.reset()
                wall, rows = run_stage(words, phases, teacher)
                row.update(ok=True, wall_s=wall, **measured(name, rows, words, phases, P, L))
                done.append(name)
        except BaseException as e:  # an OOM or a one-line CountdownError alike: note it, go on
            if isinstance(e, KeyboardInterrupt):
                raise
            where = [x.strip() for x in traceback.format_exc().splitlines()
                     if x.strip().startswith("File ")][-3:]
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], where=where)
            failed.append(f"deadline:{name}" if isinstance(e, Deadline) else name)
        finally:
            signal.alarm(0)
        row["peak_allocated_gb"] = {k: round(v, 2) for k, v in phases.alloc.items()} or None
        row["peak_reserved_gb"] = {k: round(v, 2) for k, v in phases.reserved.items()} or None
        row["finite"] = finite({k: v for k, v in row.items() if k != "argv"})
        emit(row)
        teacher = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    emit({"stage": "summary", "ok": not failed, "wall_s": time.time() - t_start, "done": done,
          "failed": failed, "skipped": skipped, "out": out_path})
    log.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
