"""Plumbing every script shares; nothing here knows about any one algorithm: args, seeding, devices,
models and tokenizers (hub, local dir, or the embedded `tiny` one), tasks and prompts, tokenization
with response masks, chunked log-probs / entropy / KL, logs. The samplers are in sampler.py."""
import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import re
import socket
import sys
import time
from dataclasses import field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import verifier


class CountdownError(Exception):
    """A mistake the user can fix: printed as one line by cli(), never as a traceback."""


# ---- args ----------------------------------------------------------------------------------------
def arg(default, help):
    """A dataclass field with its --help text next to it: `lr: float = arg(5e-5, "peak lr")`."""
    return field(default=default, metadata={"help": help})


def parse_args(cls, argv=None):
    """argparse from an Args dataclass: `--foo_bar` and `--foo-bar` both work, bools get --x/--no-x."""
    doc = (sys.modules[cls.__module__].__doc__ or "").strip()
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        kind = {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type), f.type)
        help = f"{f.metadata.get('help', '')} (default: {f.default})"
        if kind is bool:
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        else:
            p.add_argument(*names, dest=f.name, type=kind, default=f.default, help=help)
    return cls(**vars(p.parse_args(argv)))


def cli(main):
    """Run `main`; a CountdownError becomes one line on stderr and exit code 2."""
    try:
        main()
    except CountdownError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def warmup_lr(opt, lr, step, warmup_steps):
    """Set and return step's lr: linear up to `lr` over warmup_steps, then constant; stateless, so --resume needs none."""
    lr = lr * min(1.0, step / warmup_steps) if warmup_steps > 0 else lr
    for group in opt.param_groups:
        group["lr"] = lr
    return lr


def device_and_dtype():
    """bf16 on a GPU (what the papers trained in), fp32 on CPU (sampling and inference stay fp32 there)."""
    return ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def cpu_bf16():
    """Whether training forwards on this CPU compute in bf16: yes where it has native bf16 dot products
    (AVX512-BF16 or AMX), where bf16 matmuls ran 3.6x faster than fp32 ones (README, performance); elsewhere
    they are emulated and slow. COUNTDOWN_CPU_BF16=0 or 1 overrides (0 reproduces the fp32 numbers)."""
    if os.environ.get("COUNTDOWN_CPU_BF16") in ("0", "1"):
        return os.environ["COUNTDOWN_CPU_BF16"] == "1"
    return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def trains_in_bf16(device):
    """Whether training forwards on `device` compute in bf16 (autocast below): on a GPU always, on a CPU
    where cpu_bf16(). Every script records it in args.json as `train_compute`."""
    return device == "cuda" or cpu_bf16()


@contextlib.contextmanager
def autocast(device, *models):
    """Training forwards keep fp32 master weights and optimizer state and compute in bf16: a bf16 AdamW
    update of lr 1e-6 would round away. On a GPU, always. On a CPU with native bf16 (cpu_bf16()), with the
    `models` switched to eager attention meanwhile: the CPU's fused attention is 4x slower in bf16 backward,
    while its eager matmuls gain like the others (measured: one SFT step 0.35 s fp32, 0.32 s bf16 fused,
    0.20 s bf16 eager). Without `models`, or on another CPU, plain fp32: sampling is fastest that way here."""
    models = [m for m in models if m is not None] if device == "cpu" and trains_in_bf16(device) else []  # None: no ref
    before = [m.config._attn_implementation for m in models]
    try:
        for m in models:
            m.set_attn_implementation("eager")
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" or bool(models)):
            yield
    finally:
        for m, impl in zip(models, before):
            m.set_attn_implementation(impl)


# ---- prompts and tasks ---------------------------------------------------------------------------
# TinyZero's base-model format, used by papers 000/002. `compact` keeps the same question and the same
# assistant prefix but drops the preamble: with the embedded tokenizer it halves the prompt length.
TEMPLATES = {
    "base": "A conversation between User and Assistant. The user asks a question, and the Assistant "
            "solves it. The assistant first thinks about the reasoning process in the mind and then "
            "provides the user with the answer.\nUser: Using the numbers {nums}, create an equation "
            "that equals {target}. You can use basic arithmetic operations (+, -, *, /) and each number "
            "can only be used once. Show your work in <think> </think> tags. And return the final "
            "answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.\n"
            "Assistant: Let me solve this step by step.\n<think>",
    "compact": "User: Using the numbers {nums}, create an equation that equals {target}.\n"
               "Assistant: Let me solve this step by step.\n<think>",
}


def make_prompt(nums, target, template="base"):
    return TEMPLATES[template].format(nums=list(nums), target=target)


def read_jsonl(path, required=()):
    """Rows of a JSONL file; a malformed line or a missing field is an error naming file:line."""
    if not os.path.isfile(path):
        raise CountdownError(f"no such file: {path}")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CountdownError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            missing = [k for k in required if not isinstance(row, dict) or k not in row]
            if missing:
                has = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise CountdownError(f"{path}:{i}: missing field(s) {missing}; the line has {has}")
            rows.append(row)
    return rows


def load_records(source, split, required):
    """Rows from a local .jsonl file, or a hub dataset's split (the `datasets` import is lazy)."""
    if source.endswith(".jsonl") or os.path.exists(source):
        return read_jsonl(source, required)
    hint = " The embedded alternative needs no hub: --data gen (see README)"
    _check_hub(f"dataset '{source}'", hint)
    try:
        import datasets
        ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # unknown name, no such split, no access: all end the same way for a user
        raise CountdownError(f"could not load dataset '{source}' split '{split}' ({type(e).__name__}: {e}).{hint}") from None
    missing = [k for k in required if k not in ds.column_names]
    if missing:
        raise CountdownError(f"dataset '{source}' has no column(s) {missing}; it has {ds.column_names}")
    return list(ds)


def _check_hub(what, hint):
    """Fail in seconds, not after huggingface_hub's minute of retries (HF_HUB_OFFLINE=1: use the cache)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "false", ""):
        return
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError:
        raise CountdownError(f"cannot reach {host} to fetch {what} (offline? if it is in your HF cache, "
                             f"set HF_HUB_OFFLINE=1).{hint}") from None


GEN_DEFAULTS = {"nums": "3-4", "range": "1-99", "target": "10-100", "test": "500", "val": "200", "seed": "0"}
HUB_HELD_OUT = 1000  # Countdown-Tasks-3to4 has only a train split: its last rows are our val + test


def load_tasks(data, split, n=None):
    """Countdown tasks {"nums", "target"} of split train|val|test (first n) from one of:
    `gen[:key=value,...]`  the generator; keys nums=3-4 range=1-99 target=10-100 test=500 val=200
                           seed=0 (the seed belongs to the data, so every script sees one test set);
    `path.jsonl`           a file with nums/target per line (the file is the split);
    `owner/name`           a hub dataset: its train split minus the last 1,000 rows (500 val, 500 test)."""
    if split not in ("train", "val", "test"):
        raise CountdownError(f"unknown split '{split}': use train, val or test")
    if data == "gen" or data.startswith("gen:"):
        try:
            kv = dict(GEN_DEFAULTS, **dict(item.split("=") for item in data[4:].split(",") if item))
            assert set(kv) == set(GEN_DEFAULTS)
            span = {k: (int(kv[k].split("-")[0]), int(kv[k].split("-")[-1])) for k in ("nums", "range", "target")}
            sizes = {"test": int(kv["test"]), "val": int(kv["val"]), "train": n or 10_000}
        except (ValueError, AssertionError):
            raise CountdownError(f"bad --data '{data}': expected gen:key=value,... with keys {sorted(GEN_DEFAULTS)} "
                                 "and spans like nums=3-4 or nums=3") from None
        sizes = dict(list(sizes.items())[: list(sizes).index(split) + 1])  # don't generate what isn't asked
        rows = verifier.generate_splits(sizes, int(kv["seed"]), tuple(range(span["nums"][0], span["nums"][1] + 1)),
                                        span["range"], span["target"])[split]
    else:
        rows = load_records(data, "train", ["nums", "target"])
        if not os.path.exists(data):  # a hub dataset: carve the held-out rows off its only split
            h = HUB_HELD_OUT
            rows = {"train": rows[:-h], "val": rows[-h:-h // 2], "test": rows[-h // 2:]}[split]
    for i, r in enumerate(rows, 1):
        if not (isinstance(r["nums"], list) and r["nums"] and all(type(x) is int for x in r["nums"]) and type(r["target"]) is int):
            raise CountdownError(f"{data} row {i}: nums must be a list of ints and target an int, got {r['nums']!r}, {r['target']!r}")
    if not rows:
        raise CountdownError(f"no tasks in {data} ({split})")
    return [{"nums": list(r["nums"]), "target": r["target"]} for r in rows[:n]]


# ---- models and tokenizers -----------------------------------------------------------------------
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=384, max_position_embeddings=1024)


@functools.lru_cache(maxsize=1)
def build_tiny_tokenizer(vocab_size=384):
    """A byte-level BPE (exact round trip for any text) trained on the task's own text, one token per
    digit so any number can be written, the four tags as single tokens. Deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng, corpus = random.Random(0), []
    for task in verifier.generate_splits({"x": 100}, seed=12345, num_range=(1, 25), target_range=(1, 200))["x"]:
        for template in TEMPLATES:
            corpus.append(make_prompt(task["nums"], task["target"], template) + verifier.make_trace(task["nums"], task["target"], rng, 2.0))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r" ?[0-9]"), "isolated"),  # " 12" -> " 1", "2"
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(["<think>", "</think>", "<answer>", "</answer>"])
    # pad != eos on purpose: a mask built from `ids != pad` would then never drop the real EOS.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def build_tiny_model(tokenizer, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **{**TINY, **overrides})
    return Qwen2ForCausalLM(cfg)


def load_model(name, device="cpu", dtype=torch.float32, **tiny_overrides):
    """(model, tokenizer) from `tiny` (new, from scratch), a checkpoint dir, or a hub name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging
    logging.disable_progress_bar()  # one console line per step: no "Loading weights" bars in between
    if name == "tiny":
        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(tokenizer, **tiny_overrides).to(device, dtype), tokenizer
    if os.path.exists(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise CountdownError(f"{name} is not a checkpoint dir (no config.json): pass the --output_dir of a finished run")
    elif not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise CountdownError(f"no such checkpoint dir: {name}")
    hint = "" if os.path.exists(name) else " The embedded alternative needs no hub: --model tiny (see README)"
    if hint:
        _check_hub(f"model '{name}'", hint)
    # transformers 5's AutoTokenizer rebuilds a Qwen2 tokenizer for any qwen2 config, which would drop the
    # tiny tokenizer's one-token-per-digit pre-tokenizer: load a plain tokenizers-backed one as saved.
    tok_cfg = os.path.join(name, "tokenizer_config.json")
    plain = os.path.isfile(tok_cfg) and json.load(open(tok_cfg)).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
    try:
        tokenizer = (PreTrainedTokenizerFast if plain else AutoTokenizer).from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    except OSError as e:
        raise CountdownError(f"could not load {name}: {e}{hint}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # Qwen base: pad == eos, so masks come from lengths
    return model, tokenizer


def check_same_tokenizer(tok, other, name, other_name):
    """Token-level KL between two models needs one vocabulary (Qwen 0.5B and 7B share theirs; only the
    embedding padding differs, which token_stats cuts off)."""
    if tok.get_vocab() != other.get_vocab():
        raise CountdownError(f"{name} and {other_name} have different tokenizers ({len(tok)} vs {len(other)} tokens): "
                             "a token-level KL needs one vocabulary; train both from the same base (any `tiny` shares one)")


# ---- tokenization with response masks ------------------------------------------------------------
def pack(prompt_ids, response_ids, pad_id):
    """Right-padded (B, T) input_ids, attention_mask, response_mask from token-id lists. The response
    mask covers the response tokens, EOS included if the response has one; prompt and padding are 0.
    Masks come from lengths, never from `ids != pad_id`: for Qwen pad == eos."""
    seqs = [torch.tensor(p + r, dtype=torch.long) for p, r in zip(prompt_ids, response_ids)]
    input_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)        # (B, T)
    pos = torch.arange(input_ids.shape[1])
    ends = torch.tensor([len(s) for s in seqs])[:, None]
    starts = torch.tensor([len(p) for p in prompt_ids])[:, None]
    return input_ids, (pos < ends).long(), ((pos >= starts) & (pos < ends)).long()


def tokenize_pairs(tokenizer, prompts, responses, max_prompt_len=512, max_response_len=1024):
    """Tokenize prompt and response separately (so the boundary is exact), append EOS to each response
    (kept in the mask: the model must learn to stop), truncate the response to max_response_len."""
    P = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    R = tokenizer(responses, add_special_tokens=False)["input_ids"]
    too_long = [len(p) for p in P if len(p) > max_prompt_len]
    if too_long:
        raise CountdownError(f"a prompt has {max(too_long)} tokens but --max_prompt_len is {max_prompt_len}")
    R = [(r + [tokenizer.eos_token_id])[:max_response_len] for r in R]
    return pack(P, R, tokenizer.pad_token_id)


# ---- log-probs, entropy and KL without the B x T x V wall ----------------------------------------
def _chunk_stats(h, weight, targets, temperature, want_entropy, t_h, t_weight, kd_temperature):
    """Log-prob of `targets`, entropy, forward KL(teacher || model) and whether the target is the
    argmax, for one chunk of N positions. Only this chunk's (N, V) logits ever exist; checkpoint()
    recomputes them in backward."""
    logits = F.linear(h, weight).float()                                                 # (N, V)
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)                             # (N,)
    correct = (logits.argmax(-1) == targets).float()
    entropy = -(logp_all.exp() * logp_all).sum(-1) if want_entropy else torch.zeros_like(logp)
    kl = torch.zeros_like(logp)
    if t_h is not None:  # paper 000 Eq. 4: KL(softmax(z_T / T) || softmax(z_S / T)) over the shared vocab
        with torch.no_grad():
            t_logp = torch.log_softmax(F.linear(t_h, t_weight).float() / kd_temperature, -1)   # (N, V')
        s_logp = torch.log_softmax(logits[:, : t_logp.shape[-1]] / kd_temperature, -1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    return logp, entropy, kl, correct


def token_stats(model, input_ids, attention_mask, mask, temperature=1.0, entropy=False, teacher=None,
                kd_temperature=1.0, chunk_size=None, teacher_inputs=None):
    """Where `mask` (B, T) is 1: logp (B, T-1) of input_ids[:, 1:] and entropy (B, T-1) at `temperature`;
    with a `teacher`, forward KL (B, T-1) at `kd_temperature` over the shared vocab (Qwen pads 151,936
    vs 152,064: cut to the smaller); the teacher reads `teacher_inputs` = (input_ids, attention_mask) of the
    same (B, T) shape if given (another context, left-padded so the scored tokens line up: RoPE only sees
    relative positions), else the same tokens. `correct` (B, T-1): target == argmax. Zeros elsewhere. The lm_head
    runs on `chunk_size` positions at a time (default: 2^26 logits, 441 positions at Qwen's vocab), so
    memory scales with the chunk, not B x T x V, in forward and (checkpointed) backward."""
    sel = mask[:, 1:].bool()                                                             # (B, T-1)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    h = hidden[:, :-1][sel]                                                              # (N, H)
    targets = input_ids[:, 1:][sel]                                                      # (N,)
    weight = model.get_output_embeddings().weight                                        # (V, H)
    t_h = t_weight = None
    if teacher is not None:
        with torch.no_grad():
            t_ids, t_attn = teacher_inputs or (input_ids, attention_mask)
            t_h = teacher.base_model(input_ids=t_ids, attention_mask=t_attn).last_hidden_state[:, :-1][sel]
            t_weight = teacher.get_output_embeddings().weight[: weight.shape[0]]
    chunk_size = chunk_size or max(1, 2**26 // weight.shape[0])
    recompute = torch.is_grad_enabled() and h.shape[0] > chunk_size  # one chunk: nothing to save by recomputing
    outs = []
    for s in range(0, h.shape[0], chunk_size):
        c = slice(s, s + chunk_size)
        args = (h[c], weight, targets[c], temperature, entropy, None if t_h is None else t_h[c], t_weight, kd_temperature)
        outs.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if recompute else _chunk_stats(*args))
    cat = lambda k: torch.cat([o[k] for o in outs]) if outs else h.new_zeros(0, dtype=torch.float32)  # noqa: E731
    return {name: torch.zeros(sel.shape, device=h.device).masked_scatter(sel, cat(k))
            for k, name in enumerate(("logp", "entropy", "kl", "correct"))}


# ---- logging -------------------------------------------------------------------------------------
CONSOLE = {"train/loss": "loss", "train/reward": "reward", "train/accuracy": "acc", "train/token_acc": "tok_acc",
           "eval/loss": "eval_loss", "eval/pass@1": "pass@1", "train/resp_len": "len", "time/step": "s"}


class Logger:
    """metrics.jsonl always, one console line per step under a tqdm bar, wandb only if asked."""

    def __init__(self, output_dir, total_steps, args=None, wandb_project="", start_step=0):
        from tqdm import tqdm
        os.makedirs(output_dir, exist_ok=True)
        if args is not None:
            with open(os.path.join(output_dir, "args.json"), "w") as f:
                bf16 = trains_in_bf16(device_and_dtype()[0])  # the precision of the training forwards
                json.dump({**dataclasses.asdict(args), "train_compute": "bf16" if bf16 else "fp32"}, f, indent=1)
        path = os.path.join(output_dir, "metrics.jsonl")
        if start_step and os.path.isfile(path):  # resumed: drop what was logged after the restored state
            keep = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= start_step]
            open(path, "w").writelines(keep)
        self.file = open(path, "a")
        self.total, self.t0 = total_steps, time.time()
        self.bar = tqdm(total=total_steps, initial=start_step, leave=False, dynamic_ncols=True)
        self.wandb = None
        if wandb_project:
            import wandb
            self.wandb = wandb.init(project=wandb_project, config=dataclasses.asdict(args) if args else None)

    def log(self, step, metrics):
        metrics = {k: float(v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, "wall": round(time.time() - self.t0, 2), **metrics}) + "\n")
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
