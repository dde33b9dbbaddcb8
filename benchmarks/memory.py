"""Memory and time of the README's 1×H100 walkthrough, stage by stage: arithmetic, not measured.

    python benchmarks/memory.py              # every walkthrough command: peak GB, its phase, time
    python benchmarks/memory.py -v           # ... and every term of both, with its assumption
    python benchmarks/memory.py --markdown   # the README walkthrough's two estimate columns
    python benchmarks/memory.py grpo.py --init out/sft --micro_batch 32    # any one command
    python benchmarks/memory.py torchrun --nproc_per_node 8 sft.py --init Qwen/Qwen2.5-7B --fsdp
                                             # one rank's share of an 8-card run (README: More GPUs)

A stage's memory is the largest of its phases: `sample` (rollouts: a vLLM engine awake, or the HF
sampler's KV cache), `update` (forward and backward of one micro-batch), `step` (AdamW) and `eval`.
Each command is read with its script's own Args, so the defaults are the code's. Shapes come from
benchmarks/qwen2.5-0.5b.json and qwen2.5-7b.json, or a checkpoint dir's config.json. GB = 1e9 bytes;
the card has 80 GiB (85.9 GB) and every walkthrough stage must stay under LIMIT, 70 GB: the rest is
the CUDA context, the caching allocator's fragmentation and what this arithmetic leaves out.

Checked: the activation term against the bytes autograd saves for a Qwen2.5-0.5B-shaped model on a
CPU under bf16 autocast, 2 rows of 128 tokens (tests/test_memory.py: 410.4 MB saved, 410.7 MB
estimated; LoRA r32 on a bf16 base, 4 layers: 0.96x). Not yet checked on a GPU: the fused
attention's and the allocator's share, the log-prob chunk and backward buffers (assumed below);
benchmarks/gpu_smoke.py writes this estimate beside each peak it measures there.
"""
import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import math
import os
import shlex
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: the scripts' Args and the sampler's rule

GB = 1e9
CARD = 80 * 2**30  # an H100's memory as torch reports its total (the HF sampler's budget is /4)
LIMIT = 70 * GB

# ---- assumptions: each estimate below names the ones it uses -------------------------------------
PROMPT_TOKENS = 150  # Qwen tokens of the base template with 3-4 numbers (the tiny tokenizer: ~230)
RESPONSE_TOKENS = 400  # mean response length, for time only: memory takes every row at its budget
SAMPLE_TPS = {"0.5B": 20_000, "7B": 4_000}  # tokens/s sampled on one H100, by vLLM or the HF
#                                            sampler (SFT's evaluations): assumed, not measured
PEAK_FLOPS = 989e12  # H100 SXM dense bf16
MFU = 0.4  # share of PEAK_FLOPS a training forward and backward reach (assumed; gpu_smoke measures)
VLLM_STARTUP_S = 60  # engine start, weight load and CUDA-graph capture, once per script (assumed)
VLLM_ASLEEP = 2 * GB  # what a sleeping engine keeps (CUDA graphs, its pools): assumed
CHUNK_LOGITS = 2**26  # common.token_stats' default chunk: positions x vocabulary
CHUNK_BYTES = 24  # per logit of the chunk being differentiated: bf16 logits 2, their fp32 copy,
#                   log_softmax, exp, exp·log (entropy) 4 each, and their gradients after recompute;
#                   plus the head's bf16 cast (2VH) in full fine-tuning
TEACHER_CHUNK_BYTES = 16  # per logit of the teacher's chunk: its fp32 log_softmax, exp, difference
SAMPLER_LOGIT_BYTES = 14  # per row and vocabulary entry while decoding: bf16 logits, then fp32
#                           filtered, softmax and cumsum alive together (common._pick)
PAIR_YIELD = 0.6  # IPO: share of prompts whose 8 samples hold a right and a wrong one (assumed)
SFT_ROWS = 1_000  # a hub dataset's rows are unknown here: its time is quoted per 1,000 rows

# The walkthrough, as the README prints it (tests/test_memory.py holds the two together). Every
# checkpoint under out/ descends from the 0.5B, but the teacher's from the 7B.
WALKTHROUGH = [
    ("1", "sft", "python sft.py --output_dir out/sft"),
    ("2", "ipo", "python ipo.py --init out/sft --backend vllm --micro_batch 8 "
                 "--output_dir out/ipo"),
    ("3", "rloo", "python rloo.py --init out/sft --backend vllm --output_dir out/rloo"),
    ("4", "grpo", "python grpo.py --init out/sft --backend vllm --output_dir out/grpo"),
    ("5", "teacher", "python sft.py --init Qwen/Qwen2.5-7B --lora_rank 32 --gradient_checkpointing "
                     "--output_dir out/teacher"),
    ("6", "opd", "python opd.py --init out/sft --teacher out/teacher --backend vllm "
                 "--output_dir out/opd"),
    ("7", "opd_anticollapse", "python opd.py --init out/opd --teacher out/teacher --backend vllm "
                              "--entropy_coef 1e-2 --kd_temperature 1.3 --max_steps 150 "
                              "--output_dir out/opd_anticollapse"),
    ("8a", "rlt_sft", "python sft.py --init out/sft --data rlt --num_train 1000 --epochs 10 "
                      "--lr 1e-5 --final_lr 1e-6 --batch_size 16 --micro_batch 16 "
                      "--weight_decay 1e-4 --output_dir out/rlt_sft"),
    ("8b", "rlt", "python rlt.py --init out/rlt_sft --student out/sft --backend vllm "
                  "--export out/rlt/traces.jsonl"),
    ("9", "rlt_student", "python sft.py --data out/rlt/traces.jsonl --lr 1e-5 --final_lr 1e-6 "
                         "--warmup 0.1 --weight_decay 0 --batch_size 96 --micro_batch 32 "
                         "--epochs 3 --output_dir out/rlt_student"),
    ("10", "evaluate", "python evaluate.py --model out/STAGE --backend vllm --test_time "
                       "--out out/eval/STAGE"),
]
CONFIGS = {"Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b.json", "Qwen/Qwen2.5-7B": "qwen2.5-7b.json",
           "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b.json", "out/teacher": "qwen2.5-7b.json"}
# rows of a file this estimate cannot read: RLT's export (its --export_problems, 1 a problem)
KNOWN_ROWS = {"out/rlt/traces.jsonl": 2_000}
# loss terms each script back-propagates alone on its diagnose steps (harness.StepStats.term_grads)
DIAGNOSE_TERMS = {"rloo.py": 3, "grpo.py": 2, "opd.py": 3, "rlt.py": 2}


class EstimateError(Exception):
    """A command this estimate cannot read: printed as one line."""


# ---- model shapes --------------------------------------------------------------------------------
@dataclasses.dataclass
class Shape:
    """What the arithmetic needs of a Qwen2 config."""
    H: int
    L: int
    heads: int
    kv_heads: int
    head_dim: int
    I: int  # noqa: E741  the MLP's width
    V: int
    tied: bool
    name: str = ""

    @classmethod
    def of(cls, cfg, name=""):
        H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        return cls(H, cfg["num_hidden_layers"], heads, cfg["num_key_value_heads"],
                   cfg.get("head_dim") or H // heads, cfg["intermediate_size"], cfg["vocab_size"],
                   cfg.get("tie_word_embeddings", False), name)

    @property
    def kv(self):
        return self.kv_heads * self.head_dim  # width of k and of v

    def layer_matmul(self):
        """One layer's projection weights: q, o (H x H), k, v (H x kv), gate, up, down (H x I)."""
        return 2 * self.H * self.H + 2 * self.H * self.kv + 3 * self.H * self.I

    def params(self):
        """Every parameter: embeddings (and an untied head), projections, q/k/v biases, norms."""
        layer = self.layer_matmul() + self.H + 2 * self.kv + 2 * self.H
        return self.V * self.H * (1 if self.tied else 2) + self.L * layer + self.H

    def lora_params(self, r):
        """LoRA on every projection (all-linear): r x (in + out) each."""
        io = 2 * (2 * self.H) + 2 * (self.H + self.kv) + 3 * (self.H + self.I)
        return self.L * r * io

    def kv_bytes(self):
        """KV cache per row and position: keys and values of every layer in bf16."""
        return self.L * 2 * self.kv * 2

    def label(self):
        return "7B" if self.params() > 2e9 else "0.5B"


def model_shape(name):
    """The shape behind a --init/--teacher/--model value: a checkpoint dir's config.json, a named
    config in benchmarks/, or (any other out/ dir) the 0.5B every pipeline checkpoint is from."""
    path = os.path.join(name, "config.json")
    if not os.path.isfile(path) and (name in CONFIGS or name.startswith("out/")):
        path = os.path.join(HERE, CONFIGS.get(name, CONFIGS["Qwen/Qwen2.5-0.5B"]))
    elif not os.path.isfile(path):
        raise EstimateError(f"no shape for model {name!r}: pass a checkpoint dir, an out/ dir, or "
                            f"one of {sorted(CONFIGS)}")
    with open(path) as f:
        return Shape.of(json.load(f), name)


# ---- the terms -----------------------------------------------------------------------------------
def act_per_token_layer(s, lora_rank=0):
    """Bytes autograd saves for backward per token and layer, training under bf16 autocast with the
    residual stream in fp32 (fp32 master weights), counted from Qwen2's layer: two RMSNorms keep
    their fp32 input and normalized output (16H); the bf16 casts of their outputs into q, k, v, gate
    and up (10H, one cast a projection: autocast caches only weights); fused attention keeps q, out
    (4H), k, v (4kv) and a fp32 log-sum-exp per head; o_proj reads attention's output in place; the
    MLP keeps gate, silu(gate), up and their product in bf16 (8I); 8 bytes of rsqrt. LoRA (a frozen
    bf16 base): frozen projections keep nothing of their input, each adapter keeps a bf16 cast of
    it (12H + 2I) and its r-wide middle; the norms keep only their input (8H), the MLP 6I besides.
    Measured on a CPU: tests/test_memory.py."""
    att = 4 * s.kv + 4 * s.heads
    if lora_rank:
        return 24 * s.H + 8 * s.I + att + 14 * lora_rank + 8
    return 30 * s.H + 8 * s.I + att + 8


def act_per_token_rest(s):
    """Saved once per token outside the layers: the final norm (8H + 4), RoPE's cos and sin
    (shared by every layer), token_stats' gathered hidden state (4H) and its index (16)."""
    return 8 * s.H + 4 + 2 * 4 * s.head_dim + 4 * s.H + 16


def activations(s, tokens, lora_rank=0, checkpointing=False):
    """Saved for backward by one micro-batch of `tokens` (its rows x its longest). Gradient
    checkpointing keeps each layer's input (the fp32 residual, bf16 under a bf16 LoRA base) and
    recomputes one layer at a time in backward."""
    layer = act_per_token_layer(s, lora_rank)
    if checkpointing:
        per = s.L * (2 if lora_rank else 4) * s.H + layer
    else:
        per = s.L * layer
    return tokens * (per + act_per_token_rest(s))


def backward_buffers(s, tokens):
    """Gradients alive inside one layer's backward: the residual's fp32 gradient twice (8H) and
    three MLP-wide bf16 ones (6I), per token (assumed from the layer's structure)."""
    return tokens * (8 * s.H + 6 * s.I)


def frozen_forward(s, tokens):
    """A frozen model's no-grad forward (teacher, reference, RLT's student) over a micro-batch: one
    layer's bf16 temporaries at a time (6I + 8H a token) and its final hidden state (2H)."""
    return tokens * (6 * s.I + 10 * s.H)


def prefill(s, prompts, P):
    """The HF sampler's prefill of the distinct prompts, bf16: one layer's MLP and attention
    scores (bf16, then fp32 softmax) at a time."""
    return prompts * P * (6 * s.I + 8 * s.H) + prompts * s.heads * P * P * 6


def hf_sampling(s, rows, prompts, P, new_tokens, finishing=True, card=CARD):
    """The HF sampler on a GPU (bf16): KV cache of the rows it decodes together (its own rule,
    HFSampler.rows_per_batch) at P + new_tokens positions, and when rows finish the copy that drops
    them (up to 0.75 of it, common._KVCache.keep); the decode's logits; the prefill of its share of
    the prompts."""
    from common import HFSampler
    cfg = SimpleNamespace(num_hidden_layers=s.L, num_key_value_heads=s.kv_heads,
                          head_dim=s.head_dim, hidden_size=s.H, num_attention_heads=s.heads)
    hf = SimpleNamespace(kv_budget=card / 4, batch_size=rows, model=SimpleNamespace(config=cfg))
    b = HFSampler.rows_per_batch(hf, P + new_tokens)
    cache = b * (P + new_tokens) * s.kv_bytes()
    return {f"KV cache ({b} rows x {P + new_tokens})": cache,
            "KV copy when rows finish (0.75)": 0.75 * cache if finishing else 0,
            "decode logits": b * s.V * SAMPLER_LOGIT_BYTES,
            "prefill": prefill(s, max(1, math.ceil(prompts * b / rows)), P)}


def bf16_copies(s, lora_rank=0):
    """Autocast's bf16 casts of the fp32 weights that train, cached for the forward and saved for
    backward: every projection (a LoRA base is bf16 already: only the adapters). The tied head's
    cast lives inside one log-prob chunk at a time (the chunks are checkpointed): counted there."""
    return 2 * s.lora_params(lora_rank) if lora_rank else 2 * s.L * s.layer_matmul()


def vllm_awake(card):
    """An awake engine: its share of the card (VLLMSampler's default gpu_memory_utilization)."""
    from common import VLLMSampler
    f = inspect.signature(VLLMSampler.__init__).parameters["gpu_memory_utilization"].default
    return {f"vLLM engine, awake ({f:.0%} of the card)": f * card}


# ---- one command ---------------------------------------------------------------------------------
def ranks_of(command):
    """N of `torchrun --nproc_per_node N SCRIPT.py ...` (1 for a plain command)."""
    words = shlex.split(command)
    if words[:1] != ["torchrun"] or "--nproc_per_node" not in words:
        return 1
    try:
        return int(words[words.index("--nproc_per_node") + 1])
    except (IndexError, ValueError):
        raise EstimateError("--nproc_per_node: give a number of cards") from None


def parse_command(command):
    """(script, Args) of `python SCRIPT.py FLAGS...` (or torchrun's), read with the script's own
    parser."""
    words = shlex.split(command)
    if words and words[0] == "torchrun":  # its own flags come before the script
        words = words[next((i for i, w in enumerate(words) if w.endswith(".py")), len(words)):]
    if words and words[0].startswith("python"):
        words = words[1:]
    if not words or not words[0].endswith(".py"):
        raise EstimateError(f"not a script command: {command!r} (want: python SCRIPT.py FLAGS)")
    script = words[0]
    try:
        module = importlib.import_module(os.path.basename(script)[:-3])
        from plumbing.flags import parse_args
        Args = module.Args
    except (ImportError, AttributeError):
        raise EstimateError(f"{script}: not one of this repo's scripts") from None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):  # argparse's usage block: only its last line is news
            return os.path.basename(script), parse_args(Args, words[1:])
    except SystemExit:
        why = err.getvalue().strip().splitlines()[-1:] or ["?"]
        raise EstimateError(f"{script}: {why[0].split('error: ')[-1]}") from None


@dataclasses.dataclass
class Estimate:
    script: str
    phases: dict  # phase -> {term: bytes}
    time: dict  # term -> seconds
    notes: list
    per_rows: int = 0  # a dataset of unknown size: time per this many rows, evaluations aside
    per_eval: float = 0.0  # seconds of one evaluation

    def peak(self):
        """(bytes, phase) of the largest phase."""
        return max((sum(t.values()), p) for p, t in self.phases.items())

    def seconds(self):
        return sum(self.time.values())


def train_flops(s, tokens, ctx, head_tokens, passes=3):
    """A forward's FLOPs over `tokens` at mean causal context ctx/2, the lm head on head_tokens,
    times `passes` (3: forward and backward; 4 with checkpointing; 1: a frozen forward)."""
    fwd = 2 * s.L * s.layer_matmul() * tokens + 2 * s.L * s.H * ctx * tokens + \
        2 * s.V * s.H * head_tokens
    return passes * fwd


def estimate(command, prompt_tokens=PROMPT_TOKENS, response_tokens=RESPONSE_TOKENS,
             finishing=True, card=CARD):
    """The Estimate of one command. Memory takes every row at its token budget (a random model,
    or an early RL policy, writes to the end); time takes rows of response_tokens."""
    script, a = parse_command(command)
    ranks = ranks_of(command)  # torchrun's ranks: each holds its share (README: More GPUs)
    if script == "evaluate.py":
        return _estimate_eval(a, prompt_tokens, response_tokens, finishing, card)
    if script not in ("sft.py", "ipo.py", "rloo.py", "grpo.py", "opd.py", "rlt.py"):
        raise EstimateError(f"{script}: no estimate for it (training scripts and evaluate.py)")
    import torch

    from plumbing.models import frozen_dtype
    pol = model_shape(a.init)
    fb = torch.finfo(frozen_dtype("cuda")).bits // 8  # bytes a frozen model's parameter takes
    P, notes = prompt_tokens, []
    lora, gc = a.lora_rank, a.gradient_checkpointing
    trained = pol.lora_params(lora) if lora else pol.params()
    T = P + a.max_response_len  # a micro-batch's longest row, prompt included
    rows = a.micro_batch * (2 if script == "ipo.py" else 1)  # IPO: chosen and rejected together
    if getattr(a, "micro_batch_tokens", 0):  # sft.py: the longest rows go fewer at a time
        rows = min(rows, max(1, a.micro_batch_tokens // T))
    tokens = rows * T
    frozen = []  # (name, shape) of the models that never train, in frozen_dtype
    if script == "ipo.py" or (script in ("grpo.py", "rlt.py") and a.beta > 0):
        frozen.append(("reference", pol))
    if script == "opd.py":
        frozen.append(("teacher", model_shape(a.teacher)))
    if script == "rlt.py":  # it scores the explanations before the update, not inside it
        frozen.append(("student", model_shape(a.student)))
    in_update = [(n, s) for n, s in frozen if n != "student"]
    states = {"weights (fp32 masters)" if not lora else
              f"weights (base in {8 * fb}-bit, adapters fp32)":
              4 * trained + (fb * pol.params() if lora else 0),
              "AdamW moments (2 x fp32)": 8 * trained}
    held = {f"{n} ({s.label()}, {8 * fb}-bit)": fb * s.params() for n, s in frozen}
    copies = {"bf16 weight copies (autocast's cache)": bf16_copies(pol, lora)}
    vllm = getattr(a, "backend", "hf") == "vllm"
    asleep = {"vLLM engine, asleep": VLLM_ASLEEP} if vllm else {}
    # ---- update: forward and backward of one micro-batch ----
    update = {**states, "gradients (fp32)": 4 * trained, **copies, **held,
              f"activations ({rows} rows x {T} tokens"
              + (", checkpointed" if gc else "") + ")": activations(pol, tokens, lora, gc),
              "backward buffers (one layer)": backward_buffers(pol, tokens),
              "log-prob chunk": min(CHUNK_LOGITS, tokens * pol.V) * CHUNK_BYTES
              + (0 if lora else 2 * pol.V * pol.H),
              **asleep}
    for n, s in in_update:
        update[f"{n} forward"] = frozen_forward(s, tokens)
        if n == "teacher":
            update["teacher's log-prob chunk"] = min(CHUNK_LOGITS, tokens * pol.V) * \
                TEACHER_CHUNK_BYTES
    terms = DIAGNOSE_TERMS.get(script, 0) if getattr(a, "term_grads", False) else 0
    if terms:  # on diagnose steps every term's gradient is kept, plus one being computed
        update[f"diagnose steps: {terms} term gradients + 1"] = (terms + 1) * 4 * trained
    phases = {"update": update,
              "step": {**states, "gradients (fp32)": 4 * trained, **held, **asleep,
                       "AdamW's foreach temporaries": 4 * trained}}
    # ---- sampling: rollouts (RL), pairs (IPO), and the periodic evaluation ----
    persist = {**states, **held}
    if script == "ipo.py":
        sample_prompts, new = a.num_prompts, a.max_new_tokens
    else:  # each rank samples its share of the prompts (IPO's pairs: every rank all of them)
        sample_prompts, new = math.ceil(a.batch_size / ranks), a.max_response_len
    sample_rows = 0 if script == "sft.py" else sample_prompts * a.group_size

    def sampling(rows_, prompts_, new_):
        if vllm:
            return {**persist, **vllm_awake(card)}
        fsdp = ranks > 1 and a.fsdp  # FSDP2: every rank gathers the whole model to sample
        whole = {"the whole model, gathered (fp32)": 4 * pol.params()} if fsdp else {}
        return {**persist, **copies, **whole,
                **hf_sampling(pol, rows_, prompts_, P, new_, finishing, card)}
    if sample_rows:
        phases["sample"] = sampling(sample_rows, sample_prompts, new)
    eval_rows = a.eval_problems * a.eval_samples
    phases["eval"] = sampling(eval_rows, a.eval_problems, a.eval_max_new_tokens)
    if ranks > 1:
        sharded(phases, pol, trained, ranks, a.fsdp, lora)
    # ---- time ----
    time, tps, flops = {}, SAMPLE_TPS[pol.label()], PEAK_FLOPS * MFU
    R = min(response_tokens, a.max_response_len)
    ctx = P + R
    if script == "sft.py":
        n_rows = _sft_rows(a, notes)
        steps = a.max_steps or math.ceil(a.epochs * math.ceil(n_rows / a.batch_size))
        step_rows, step_sample = a.batch_size, 0
        evals = n_evals(steps, a.eval_every, at_start=False)  # SFT has nothing to show at step 0
    elif script == "ipo.py":
        pairs = a.num_prompts * PAIR_YIELD * (1 - a.heldout)
        steps = max(1, math.ceil(a.epochs * pairs / a.batch_size))
        step_rows, step_sample = 2 * min(a.batch_size, pairs), 0
        time["sampling the pairs"] = sample_rows * R / tps
        evals = n_evals(steps, a.eval_every)
        notes.append(f"pairs: {a.num_prompts} prompts x {PAIR_YIELD} with a right and a wrong "
                     f"sample, {a.heldout:.0%} held out")
    else:
        steps = a.max_steps
        step_rows, step_sample = sample_rows, sample_rows * R
        evals = n_evals(steps, a.eval_every)
    step_rows = math.ceil(step_rows / ranks) if script != "ipo.py" else step_rows / ranks
    step_tokens = step_rows * ctx
    time["sampling"] = steps * step_sample / tps
    time["update" + (" (checkpointed: 4 passes)" if gc else "")] = steps * train_flops(
        pol, step_tokens, ctx, step_rows * R, 4 if gc else 3) / flops
    for n, s in frozen:  # RLT's student: its scoring of each explanation
        time[f"{n} forward"] = steps * train_flops(s, step_tokens, ctx, step_rows * R, 1) / flops
    if terms:  # 2 passes (a backward) per term, on the first step and every evaluating one
        time["diagnose steps' term backwards"] = evals * terms * train_flops(
            pol, step_tokens, ctx, step_rows * R, 2) / flops
    per_eval = eval_rows * min(response_tokens, a.eval_max_new_tokens) / tps
    per_rows = SFT_ROWS if any(n.startswith("time per") for n in notes) else 0
    if not per_rows:  # a dataset of unknown size: its evaluations are quoted apart
        time[f"{evals} evaluations ({a.eval_problems} x {a.eval_samples})"] = evals * per_eval
    if script == "rlt.py" and a.export:
        time[f"export ({a.export_problems} problems)"] = \
            a.export_problems * a.export_best_of * R / tps
    if vllm:
        time["vLLM start"] = VLLM_STARTUP_S
    notes.append(f"{steps} steps" + (f", one rank of {ranks} ({'FSDP2' if a.fsdp else 'DDP'}); "
                                     "the gradients' all-reduce not counted" if ranks > 1 else ""))
    if per_rows:
        notes.append(f"+ {fmt_time(per_eval)} an evaluation, every {a.eval_every} steps")
    return Estimate(script, phases, time, notes, per_rows, per_eval)


def sharded(phases, s, trained, n, fsdp, lora):
    """One rank's training phases under torchrun. FSDP2 (fsdp): the fp32 weights, gradients and
    AdamW moments split n ways, plus the layers it gathers around a forward or backward (this one
    and the next, prefetched) and the root's embedding, norm and head, whole from its forward to its
    backward. DDP: every rank holds it all, plus the gradient buckets it all-reduces (a copy)."""
    gathered = 2 * 4 * (s.layer_matmul() + 3 * s.H) + 4 * s.V * s.H * (1 if s.tied else 2)
    for phase, terms in phases.items():
        for k in [k for k in terms if k.startswith(("weights", "AdamW", "gradients"))]:
            if fsdp:
                terms[k + f", 1/{n}"] = terms.pop(k) / n
        if fsdp and phase in ("update", "step"):  # sampling gathers the whole model instead
            terms["gathered: 2 layers + embedding and head (fp32)"] = gathered
        elif not fsdp and not lora and phase in ("update", "step"):
            terms["DDP's gradient buckets (fp32)"] = 4 * trained


def n_evals(steps, every, at_start=True):
    """Evaluations of a run (harness.Run): at step 0 (`at_start`), every `every` steps, at the end."""
    return int(at_start) + (steps // every + (steps % every != 0) if every else 1)


def _sft_rows(a, notes):
    """Training rows of an SFT command: --num_train, a generated set (20,000), a file this
    estimate knows, or SFT_ROWS for a dataset it cannot read."""
    if a.num_train:
        return a.num_train
    if a.data.split(":")[0] in ("gen", "arith", "rlt"):
        return 20_000
    if a.data in KNOWN_ROWS:
        return KNOWN_ROWS[a.data]
    if os.path.isfile(a.data):
        with open(a.data) as f:
            return sum(1 for line in f if line.strip())
    notes.append(f"time per {SFT_ROWS:,} rows of {a.data} (its size is not known here)")
    return SFT_ROWS


def _estimate_eval(a, P, response_tokens, finishing, card):
    """evaluate.py: the model in bf16 beside its sampler; time of its samples (and, with
    --test_time, as many more drawn until each problem is solved, at most)."""
    s = model_shape(a.model.replace("STAGE", "sft"))
    rows = a.num_problems * a.num_samples
    base = {f"model ({s.label()}, bf16)": 2 * s.params()}
    phases = {"eval": {**base, **(vllm_awake(card) if a.backend == "vllm" else hf_sampling(
        s, rows, a.num_problems, P, a.max_new_tokens, finishing, card))}}
    R = min(response_tokens, a.max_new_tokens)
    time = {f"samples ({a.num_problems} x {a.num_samples})": rows * R / SAMPLE_TPS[s.label()]}
    if a.test_time:
        time["test-time draws (at most as many)"] = rows * R / SAMPLE_TPS[s.label()]
    if a.backend == "vllm":
        time["vLLM start"] = VLLM_STARTUP_S
    return Estimate("evaluate.py", phases, time, ["per stage evaluated"])


# ---- output --------------------------------------------------------------------------------------
def fmt_time(s):
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def show(name, e, verbose):
    peak, phase = e.peak()
    flag = "" if peak <= LIMIT else f"  OVER {LIMIT / GB:.0f} GB"
    print(f"{name:<18} {peak / GB:6.1f} GB ({phase:<6}) {fmt_time(e.seconds()):>8}  "
          f"{'; '.join(e.notes)}{flag}")
    if verbose:
        for p, terms in e.phases.items():
            print(f"    {p}: {sum(terms.values()) / GB:.1f} GB")
            for k, v in terms.items():
                if v:
                    print(f"        {v / GB:7.2f}  {k}")
        print("    time:")
        for k, v in e.time.items():
            print(f"        {fmt_time(v):>8}  {k}")


def markdown(e):
    """The README walkthrough's two estimate cells of a stage."""
    peak, phase = e.peak()
    if e.per_rows:
        return (f"{peak / GB:.0f} GB ({phase})", f"~{fmt_time(e.seconds())} per {e.per_rows:,} "
                f"rows + ~{fmt_time(e.per_eval)} an evaluation")
    per = " per stage" if e.script == "evaluate.py" else ""  # one evaluation of one checkpoint
    return f"{peak / GB:.0f} GB ({phase})", f"~{fmt_time(e.seconds())}{per}"


ASSUMPTIONS = (f"prompt {PROMPT_TOKENS} tokens; memory: every row at its --max_response_len; time: "
               f"responses of {RESPONSE_TOKENS} tokens, sampling {SAMPLE_TPS['0.5B']:,} tokens/s "
               f"(0.5B; 7B {SAMPLE_TPS['7B']:,}), training at {MFU:.0%} of {PEAK_FLOPS / 1e12:.0f} "
               f"TFLOPS, vLLM start {VLLM_STARTUP_S} s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="every term of every phase")
    p.add_argument("--markdown", action="store_true", help="the README's estimate cells")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="one command (SCRIPT.py FLAGS...) instead of the walkthrough")
    args = p.parse_args(argv)
    try:
        if args.command:
            show(args.command[0], estimate(shlex.join(args.command)), True)
            return 0
        print(f"assumptions: {ASSUMPTIONS}")
        over = []
        for step, name, command in WALKTHROUGH:
            e = estimate(command)
            if args.markdown:
                print(f"| {step} | {name} | " + " | ".join(markdown(e)) + " |")
            else:
                show(f"{step} {name}", e, args.verbose)
            over += [name] if e.peak()[0] > LIMIT else []
    except EstimateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if over:
        print(f"error: over {LIMIT / GB:.0f} GB: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
