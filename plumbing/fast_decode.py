"""The fast twin of common.HFSampler's plain decode loop: the same tokens and log-probs, token for
token (tests/test_sampler.py), by the model's own modules called one by one over a KV cache written
in place, with no transformers cache object, mask or output classes in between. common.py picks it
by its `decode` flag, by default on every device (the faster there; docs/studies/performance.md),
and hands it the token picker it shares with the plain loop (`pick`: common._pick), so that this
file imports nothing from the top level:
  dynamic  (a CPU's default) the cache grows, finished rows leave the batch;
  static   one step at fixed shapes (_StaticStep): every row decodes to the batch's end, the cache
           preallocated, positions and step index on the device;
  graph    (a GPU's default) that step captured as a CUDA graph once per batch and replayed per
           token: a step is ~1,300 small kernels, launched one by one the card sat idle. The same
           tokens and log-probs as `static` for the same seed.
Qwen2 and Llama only (_decoder_parts says so for others: use decode='plain')."""
import functools

import torch

from plumbing.flags import CountdownError


def decode_mode(dev, decode=None):
    """`decode`, else the faster loop on device `dev`: on a GPU a step is launch-bound (dropping
    rows saves nothing, a graph replay saves the launches)."""
    mode = decode or ("graph" if dev.type == "cuda" else "dynamic")
    if mode == "graph" and (dev.type != "cuda"
                            or not hasattr(torch.cuda.CUDAGraph, "register_generator_state")):
        raise CountdownError(f"decode='graph' needs a CUDA model and a torch whose CUDA graphs "
                             f"take a generator (2.4+), not {dev.type} with torch "
                             f"{torch.__version__}: use decode='static'")
    return mode


def rows_per_batch(model, batch_size, kv_budget, slots):
    """batch_size, or fewer where their KV cache of `slots` positions a row (keys and values of
    every layer, 2 bytes a value in bf16) would pass kv_budget bytes (None: a quarter of a GPU, no
    bound on a CPU), half of which is left for the copy that dropping finished rows makes. A 7B
    model's 1,024 rows of 1,300 positions are 68 GB."""
    if kv_budget is None and model.device.type == "cuda":
        kv_budget = torch.cuda.get_device_properties(model.device).total_memory / 4
    if not kv_budget:
        return batch_size
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    row = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * slots * 2
    return max(1, min(batch_size, int(kv_budget / 2 // row)))


def batch_loop(mode, model, eos, pick):
    """The fast twin's loop for `mode` (dynamic | static | graph), as common.HFSampler calls its
    plain _batch: (rows, temperature, top_p, top_k, max_new_tokens, gen, bottom_p,
    bottom_p_freq) -> each row's (tokens, log-probs, finished)."""
    fast = dynamic_batch if mode == "dynamic" else functools.partial(static_batch,
                                                                     graph=mode == "graph")
    return functools.partial(fast, model, eos, pick)


def dynamic_batch(model, eos, pick, rows, temperature, top_p, top_k, max_new_tokens, gen, bottom_p,
                  bottom_p_freq):
    """common.HFSampler's plain loop, fast: the same finished rows leave the batch and its cache
    (_KVCache.keep) whenever a quarter of it has finished. Returns each row's (tokens, log-probs,
    finished), as the plain loop."""
    L = max_new_tokens
    decoder, head = _decoder_parts(model)
    logits, kv, bias, pos, rope = _prefill(decoder, head, rows, L, eos)
    b, P, dev = len(rows), bias.shape[1] - L, logits.device
    toks = torch.full((b, L), eos, device=dev)  # (b, L) by batch row; junk after a row's EOS
    lps = torch.zeros(b, L, device=dev)
    live = torch.arange(b, device=dev)  # which of the b rows the batch (and cache) holds
    active = torch.ones(b, dtype=torch.bool, device=dev)  # live rows without an EOS yet
    for t in range(L):
        tok = pick(logits, temperature, top_p, top_k, gen, bottom_p, bottom_p_freq)  # (live,)
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
            gen.keep(keep)
        pos = pos + 1
        logits = head(_forward(decoder, tok[:, None], pos[:, None], rope, kv,
                               bias[:, :P + t + 1]))  # (live, V)
    return _trim(toks, lps, eos)


def static_batch(model, eos, pick, rows, temperature, top_p, top_k, max_new_tokens, gen, bottom_p,
                 bottom_p_freq, graph=False):
    """dynamic_batch at static shapes (_StaticStep): every row runs to the batch's end, drawing each
    step, so a row's draws do not depend on which others finished; the batch stops when every
    row has. With `graph`, step 1 runs eagerly (the warm-up) and is captured, and each later
    token is one replay of it (_graphed)."""
    L = max_new_tokens
    decoder, head = _decoder_parts(model)
    logits, kv, bias, pos, rope = _prefill(decoder, head, rows, L, eos, slots=0)

    def pick_row(x):
        return pick(x, temperature, top_p, top_k, gen, bottom_p, bottom_p_freq)
    step = _StaticStep(decoder, head, kv, bias, pos, rope, logits, L, pick_row, temperature, eos)
    del kv, logits  # the prompt's cache now lives in the step's buffer
    replay = None
    for t in range(1, L):
        if not step.active.any():  # the step's one host sync, as dynamic_batch's
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
    the appends copy the cache once every R tokens. `old_kt`: old's keys again, transposed,
    (layers, b, n_kv_heads, head_dim, S), made at each append: the scores' batched matmul over them
    took 0.65-0.71x as long as over old's (S, head_dim) keys (docs/studies/performance.md). On a
    GPU `new` holds every decode slot (_decode_slots), in bf16 under autocast (_decode_precision),
    where the projections give bf16."""
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
        self.old_kt = self.old[:, 0].transpose(-1, -2)

    def advance(self, T):
        """T more slots of `new` are written: append it to `old` when full."""
        self.n += T
        if self.n == self.new.shape[4]:
            self.old, self.n = torch.cat([self.old, self.new], 4), 0
            self.old_kt = self.old[:, 0].transpose(-1, -2).contiguous()

    def spread(self, which, slots):
        """Rows `which` (b,) of `old`, e.g. each prompt to its n rows, and an empty `new` of `slots`
        slots (_decode_slots)."""
        self.old, self.old_kt = self.old[:, :, which], self.old_kt[:, which]
        self.new = self.old.new_empty(*self.old.shape[:4], slots, self.old.shape[5])

    def keep(self, rows):
        """Only these rows (the ones still running)."""
        self.old, self.new = self.old[:, :, rows], self.new[:, :, rows]
        self.old_kt = self.old_kt[:, rows]


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
    old_kt = kv.old_kt[i].flatten(0, 1)  # (b·Hkv, d, S_old): the keys, transposed
    old_v = kv.old[i, 1].flatten(0, 1)  # (b·Hkv, S_old, d)
    new_k, new_v = kv.new[i, :, :, :, :n + T].flatten(1, 2)  # (b·Hkv, n + T, d) each
    S_old = old_v.shape[1]
    scores = torch.cat([torch.baddbmm(bias[..., :S_old], q, old_kt),
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
    if gen.gen is not None:  # keyed draws (torchrun) advance their count inside the graph
        graph.register_generator_state(gen.gen)
    with torch.cuda.graph(graph, stream=stream):  # records only: nothing runs until a replay
        step()
    return graph.replay
