"""The training forward: the precision it computes in (autocast), the trainer's tensors (prompt and
response packed with response masks; rollouts in micro-batches), and chunked log-probs, entropy and
KL over the vocabulary, so no (B, T, V) logits tensor ever exists."""
import contextlib
import os

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common import CountdownError


# ---- the precision a training forward computes in ---------------------------------------------
def device_and_dtype():
    """bf16 on a GPU (what the papers trained in), fp32 on CPU (sampling and inference stay fp32
    there)."""
    return ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def cpu_bf16():
    """Whether training forwards on this CPU compute in bf16: yes where it has native bf16 dot
    products (AVX512-BF16 or AMX), where bf16 matmuls ran 3.6x faster than fp32 ones (README,
    performance); elsewhere they are emulated and slow. COUNTDOWN_CPU_BF16=0 or 1 overrides (0
    reproduces the fp32 numbers)."""
    if os.environ.get("COUNTDOWN_CPU_BF16") in ("0", "1"):
        return os.environ["COUNTDOWN_CPU_BF16"] == "1"
    return any(
        getattr(torch.cpu, f, lambda: False)()
        for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def trains_in_bf16(device):
    """Whether training forwards on `device` compute in bf16 (autocast below): on a GPU always, on a
    CPU where cpu_bf16(). Every script records it in args.json as `train_compute`."""
    return device == "cuda" or cpu_bf16()


@contextlib.contextmanager
def autocast(device, *models):
    """Training forwards keep fp32 master weights and optimizer state and compute in bf16: a bf16
    AdamW update of lr 1e-6 would round away. On a GPU, always. On a CPU with native bf16
    (cpu_bf16()), with the `models` switched to eager attention meanwhile: the CPU's fused
    attention is 4x slower in bf16 backward, while its eager matmuls gain like the others
    (measured: one SFT step 0.35 s fp32, 0.32 s bf16 fused, 0.20 s bf16 eager). Without `models`,
    or on another CPU, plain fp32: sampling is fastest that way here."""
    models = [m for m in models if m is not None
              ] if device == "cpu" and trains_in_bf16(device) else []  # None: no ref
    before = [m.config._attn_implementation for m in models]
    try:
        for m in models:
            m.set_attn_implementation("eager")
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" or bool(models)):
            yield
    finally:
        for m, impl in zip(models, before):
            m.set_attn_implementation(impl)


# ---- tokenization with response masks ------------------------------------------------------------
def pack(prompt_ids, response_ids, pad_id):
    """Right-padded (B, T) input_ids, attention_mask, response_mask from token-id lists. The
    response mask covers the response tokens, EOS included if the response has one; prompt and
    padding are 0. Masks come from lengths, never from `ids != pad_id`: for Qwen pad == eos."""
    seqs = [torch.tensor(p + r, dtype=torch.long) for p, r in zip(prompt_ids, response_ids)]
    # (B, T)
    input_ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    pos = torch.arange(input_ids.shape[1])
    ends = torch.tensor([len(s) for s in seqs])[:, None]
    starts = torch.tensor([len(p) for p in prompt_ids])[:, None]
    return input_ids, (pos < ends).long(), ((pos >= starts) & (pos < ends)).long()


def tokenize_pairs(tokenizer, prompts, responses, max_prompt_len=512, max_response_len=1024):
    """Tokenize prompt and response separately (so the boundary is exact), append EOS to each
    response (kept in the mask: the model must learn to stop), truncate the response to
    max_response_len."""
    P = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    R = tokenizer(responses, add_special_tokens=False)["input_ids"]
    too_long = [len(p) for p in P if len(p) > max_prompt_len]
    if too_long:
        raise CountdownError(
            f"a prompt has {max(too_long)} tokens but --max_prompt_len is {max_prompt_len}")
    R = [(r + [tokenizer.eos_token_id])[:max_response_len] for r in R]
    return pack(P, R, tokenizer.pad_token_id)


def spans(lengths, max_rows, max_tokens=0):
    """(start, end) of consecutive micro-batches of rows sorted by length (ascending), each of at
    most max_rows rows and, with max_tokens, of at most max_tokens padded tokens (its rows times
    its longest; a longer row goes alone): a micro-batch's activations then follow its tokens, not
    its rows (64 of the longest SFT rows are 64,000 tokens)."""
    out, s = [], 0
    while s < len(lengths):
        e = s + 1
        while e < len(lengths) and e - s < max_rows and (
                not max_tokens or (e - s + 1) * int(lengths[e]) <= max_tokens):
            e += 1
        out.append((s, e))
        s = e
    return out


# ---- log-probs, entropy and KL without the B x T x V wall ----------------------------------------
def _chunk_stats(h, weight, targets, temperature, want_entropy, t_h, t_weight, kd_temperature,
                 kd_reverse=False):
    """Log-prob of `targets`, entropy, KL to the teacher (forward KL(teacher || model), or with
    kd_reverse KL(model || teacher)) and whether the target is the argmax, for one chunk of N
    positions. Only this chunk's (N, V) logits ever exist; checkpoint() recomputes them in
    backward."""
    logits = F.linear(h, weight).float()                                                 # (N, V)
    logp_all = torch.log_softmax(logits / temperature, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)                             # (N,)
    correct = (logits.argmax(-1) == targets).float()
    with torch.set_grad_enabled(torch.is_grad_enabled() and want_entropy != "logged"):
        entropy = -(logp_all.exp() * logp_all).sum(-1) if want_entropy else torch.zeros_like(logp)
    kl = torch.zeros_like(logp)
    # paper 000 Eq. 4: KL(softmax(z_T / T) || softmax(z_S / T)) over the shared vocab; reversed,
    # GKD's KL(softmax(z_S / T) || softmax(z_T / T)), exact over the vocab at each position
    if t_h is not None:
        with torch.no_grad():
            # (N, V')
            t_logp = torch.log_softmax(F.linear(t_h, t_weight).float() / kd_temperature, -1)
        s_logp = torch.log_softmax(logits[:, : t_logp.shape[-1]] / kd_temperature, -1)
        p, q = (s_logp, t_logp) if kd_reverse else (t_logp, s_logp)
        kl = (p.exp() * (p - q)).sum(-1)                                                  # (N,)
    return logp, entropy, kl, correct


def causal_only(attention_mask):
    """None where every row is right-padded (ones, then zeros), as pack() builds them: a causal
    model's real tokens then attend only to earlier positions, all real, and the padding's outputs
    are never read, so the causal mask alone gives the same values, and the attention builds no
    (B, 1, T, T) padding mask (one SFT step here 0.52 s instead of 0.61, docs/studies/performance.md).
    Left padding (RLT's teacher contexts) keeps its mask."""
    right_padded = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    return None if right_padded else attention_mask


def token_stats(model, input_ids, attention_mask, mask, temperature=1.0, entropy=False,
                teacher=None, kd_temperature=1.0, chunk_size=None, teacher_inputs=None,
                kd_reverse=False):
    """Where `mask` (B, T) is 1: logp (B, T-1) of input_ids[:, 1:] and entropy (B, T-1) at
    `temperature` (a float, or a (B,) tensor: one per row); with a `teacher`, forward KL (B, T-1)
    (reverse with kd_reverse) at `kd_temperature` over the shared vocab (Qwen pads 151,936 vs
    152,064: cut to the smaller); the teacher reads `teacher_inputs` = (input_ids,
    attention_mask) of the same (B, T) shape if given (another context, left-padded so the scored tokens line up: RoPE only sees
    relative positions), else the same tokens.
    entropy="logged": a metric only, built without a graph: a branch of the graph that the loss
    never reaches is never freed by its backward, and would hold two (N, V) tensors per chunk until
    the next forward (GRPO on the H200 smoke: 63.4 GB at its peak where 43 were its own).
    `correct` (B, T-1): target == argmax. Zeros elsewhere. The lm_head runs on `chunk_size`
    positions at a time (default: 2^26 logits, 441 positions at Qwen's vocab), so memory scales
    with the chunk, not B x T x V, in forward and (checkpointed) backward."""
    sel = mask[:, 1:].bool()                                                             # (B, T-1)
    hidden = model.get_decoder()(input_ids=input_ids,
                                 attention_mask=causal_only(attention_mask)).last_hidden_state
    h = hidden[:, :-1][sel]                                                              # (N, H)
    targets = input_ids[:, 1:][sel]                                                      # (N,)
    if torch.is_tensor(temperature):  # one per row (grpo's --adaptive_temperature)
        temperature = temperature.to(h.device)[:, None].expand(sel.shape)[sel][:, None]  # (N, 1)
    weight = model.get_output_embeddings().weight                                        # (V, H)
    t_h = t_weight = None
    if teacher is not None:
        with torch.no_grad():
            t_ids, t_attn = teacher_inputs or (input_ids, attention_mask)
            t_h = teacher.base_model(input_ids=t_ids, attention_mask=causal_only(t_attn)
                                     ).last_hidden_state[:, :-1][sel]
            t_weight = teacher.get_output_embeddings().weight[: weight.shape[0]]
    chunk_size = chunk_size or max(1, 2**26 // weight.shape[0])
    # one chunk: nothing to save by recomputing
    recompute = torch.is_grad_enabled() and h.shape[0] > chunk_size
    outs = []
    for s in range(0, h.shape[0], chunk_size):
        c = slice(s, s + chunk_size)
        T = temperature[c] if torch.is_tensor(temperature) else temperature
        args = (h[c], weight, targets[c], T, entropy, None if t_h is None else t_h[c],
                t_weight, kd_temperature, kd_reverse)
        outs.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if recompute
                    else _chunk_stats(*args))
    def cat(k):
        return torch.cat([o[k] for o in outs]) if outs else h.new_zeros(0, dtype=torch.float32)
    return {name: torch.zeros(sel.shape, device=h.device).masked_scatter(sel, cat(k))
            for k, name in enumerate(("logp", "entropy", "kl", "correct"))}


# ---- rollouts as trainer tensors -----------------------------------------------------------------
def rollout_batch(ro, rows, pad_id):
    """Rows of a Rollouts as trainer tensors: input_ids, attention_mask, completion mask (b, T), cut
    to these rows' longest, and the sampler's log-probs (b, T-1) aligned with token_stats'
    outputs."""
    n = len(ro.completion_ids) // len(ro.prompt_ids)
    ids, attn, mask = pack([ro.prompt_ids[r // n] for r in rows],
                           [ro.completion_ids[r] for r in rows], pad_id)
    sel = mask[:, 1:].bool()
    lp = torch.tensor([x for r in rows for x in ro.logprobs[r]], dtype=torch.float32)
    return ids, attn, mask, torch.zeros(sel.shape).masked_scatter(sel, lp)


def micro_batches(ro, size, pad_id, device):
    """(rows, input_ids, attention_mask, completion mask, sampler log-probs) per micro-batch of
    `size` rollouts, on `device`. Rows are sorted by length first, so a micro-batch holds like
    lengths and little padding (the step's loss is a sum over rollouts: their order is free)."""
    by_len = sorted(range(len(ro.completion_ids)), key=lambda r: len(ro.completion_ids[r]))
    for s in range(0, len(by_len), size):
        rows = by_len[s:s + size]
        yield (rows, *(x.to(device) for x in rollout_batch(ro, rows, pad_id)))


@torch.no_grad()
def logprob_gap(model, tokenizer, ro, temperature):
    """Mean |trainer − sampler| log-prob over every sampled token of `ro`, in one pass: what the RL
    scripts log as train/sampler_gap, for checking a sampler (tests/test_vllm.py,
    benchmarks/gpu_smoke.py)."""
    rows = list(range(len(ro.completion_ids)))
    ids, attn, mask, sampler_logp = (x.to(model.device)
                                     for x in rollout_batch(ro, rows, tokenizer.pad_token_id))
    logp = token_stats(model, ids, attn, mask, temperature=temperature)["logp"]  # (b, T-1)
    return (logp - sampler_logp).abs()[mask[:, 1:].bool()].mean().item()
