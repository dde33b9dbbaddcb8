"""The fast twin of common.token_stats' decoder forward for an RL batch: the G rollouts of a prompt
share its tokens, so the batch's prompts run through the decoder once a step (Prompts) and each
micro-batch runs only its rollouts' tokens, attending to their prompt's keys and values
(Prompts.hidden). The same hidden states as the per-row forward, up to float rounding
(tests/test_rl.py); a quarter less update work on the embedded setting, where a prompt is ~34 of
a row's ~150 tokens (docs/studies/performance.md). The gradient: each micro-batch's backward stops
at the prompts' keys and values, copies made leaves, which sum it over the micro-batches;
Prompts.backward() carries that sum through the prompts' forward once, after the last micro-batch.
The model's own modules, called one by one as plumbing/fast_decode.py calls them (Qwen2 and Llama,
peft or not); the attention is torch's fused kernel in fp32, eager under bf16 autocast (its
(rows, heads, T, S) scores held for backward): for a CPU's short rows, not a GPU's long ones
(flags: --prompt_forward)."""
import torch
import torch.nn.functional as F

from plumbing.fast_decode import _decoder_parts, _rope, _rope_table
from plumbing.flags import CountdownError


class Prompts:
    """The step's B prompts through the decoder once: each layer's keys and values. `prompts`: B
    token-id lists, rollout r's prompt being prompts[r // G]. Each prompt's last token is left
    out: it starts every rollout's own forward, whose first output predicts the rollout's first
    token. Right-padded: causal attention keeps every real token off the padding after it. With
    `on` False it does nothing: of() gives None (token_stats' own forward), backward() returns.
    `fused`: layers()' attention (default: fused in fp32, eager under autocast)."""

    def __init__(self, model, prompts, G, on=True, fused=None):
        self.on, self.G, self.fused = on, G, fused
        if not on:
            return
        try:  # fast_decode's architectures: Qwen2 and Llama, full attention, a static RoPE
            self.decoder, _ = _decoder_parts(model)
        except CountdownError:
            raise CountdownError(f"--prompt_forward shared runs Qwen2 and Llama models, not this "
                                 f"{model.config.model_type}: use --prompt_forward per_row") from None
        dev = self.decoder.embed_tokens.weight.device
        self.lens = torch.tensor([len(p) - 1 for p in prompts], device=dev)  # (B,) tokens kept
        P = int(self.lens.max())
        ids = torch.tensor([list(p[:-1]) + [0] * (P + 1 - len(p)) for p in prompts], device=dev)
        pos = torch.arange(P, device=dev).expand(len(prompts), P)                     # (B, P)
        _, self.kv = layers(self.decoder, ids, pos, fused=fused)  # [(k, v) (B, Hkv, P, d)] a layer
        # the micro-batches' inputs: leaves whose .grad sums every micro-batch's share
        self.leaves = [tuple(x.detach().requires_grad_(x.requires_grad) for x in kv)
                       for kv in self.kv]
        self.bias = torch.zeros(len(prompts), P, device=dev).masked_fill(  # (B, P) -inf: padding
            pos >= self.lens[:, None], float("-inf"))

    def of(self, rows):
        """token_stats' `prompts` for a micro-batch of rollouts `rows`: hidden(·, which)."""
        if not self.on:
            return None
        which = torch.tensor(rows, device=self.lens.device) // self.G  # (b,) each row's prompt
        return lambda input_ids: self.hidden(input_ids, which)

    def hidden(self, input_ids, which):
        """decoder(input_ids).last_hidden_state (b, T, D) at every position that predicts a rollout
        token (the others hold a neighbour's): input_ids (b, T) prompt then rollout, right-padded,
        as common.pack builds them; which (b,) each row's prompt."""
        b, T = input_ids.shape
        start = self.lens[which]  # (b,) where each row's last prompt token is
        Ts = T - int(start.min())
        pos = start[:, None] + torch.arange(Ts, device=start.device)                  # (b, Ts)
        ids = input_ids.gather(1, pos.clamp(max=T - 1))  # that token, the rollout, then padding
        past = [(k[which], v[which]) for k, v in self.leaves]
        h, _ = layers(self.decoder, ids, pos, self.bias[which], past, self.fused)  # (b, Ts, D)
        back = (torch.arange(T, device=start.device) - start[:, None]).clamp(0, Ts - 1)  # (b, T)
        return h.gather(1, back[..., None].expand(b, T, h.shape[-1]))

    def backward(self):
        """The prompts' share of the gradient, summed over their rollouts' micro-batches, through
        their forward: once a step, after the micro-batches' own backward."""
        if not self.on:
            return
        pairs = [(x, leaf.grad) for kv, leaves in zip(self.kv, self.leaves)
                 for x, leaf in zip(kv, leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward(*zip(*pairs))


def layers(decoder, ids, pos, bias=None, past=None, fused=None):
    """The decoder's final hidden states (b, T, D) and each layer's keys and values [(k, v) (b, Hkv,
    T, d)] of ids (b, T) at positions pos (b, T), each token attending causally to the ones before
    it and to `past` [(k, v) (b, Hkv, S, d)] where bias (b, S) is 0 (-inf: padding). `fused`
    (default: in fp32, not under autocast): torch's fused attention, 1.2x faster forward here than
    the eager scores and as fast backward; in bf16 its backward took 1.8x as long, so autocast
    runs eager, grouped-query attention as fast_decode._attention lays it out (a KV head's g query
    heads are g·T rows)."""
    b, T = ids.shape
    Hkv = decoder.config.num_key_value_heads
    g = decoder.config.num_attention_heads // Hkv
    cos, sin = (x[pos][:, None] for x in _rope_table(decoder, int(pos.max()) + 1, ids.device))
    causal = torch.full((T, T), float("-inf"), device=ids.device).triu(1)             # (T, T)
    mask = causal.expand(b, T, T) if past is None else torch.cat(
        [bias[:, None, :].expand(b, T, bias.shape[1]), causal.expand(b, T, T)], -1)  # (b, T, S+T)
    autocast = torch.is_autocast_enabled(ids.device.type)
    fused = not autocast if fused is None else fused
    # added to the scores, in the dtype their matmul runs in: cast once
    mask = mask.to(torch.get_autocast_dtype(ids.device.type) if autocast else
                   decoder.embed_tokens.weight.dtype)
    mask = mask[:, None] if fused else mask[:, None, None].expand(  # (b, 1, T, S+T) | the scores'
        b, Hkv, g, T, mask.shape[-1]).reshape(b * Hkv, g * T, -1)   # layout (b·Hkv, g·T, S+T)
    h, kvs = decoder.embed_tokens(ids), []                                            # (b, T, D)
    for i, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        d = attn.head_dim
        x = layer.input_layernorm(h)
        q = _rope(attn.q_proj(x).view(b, T, -1, d).transpose(1, 2), cos, sin)      # (b, H, T, d)
        k = _rope(attn.k_proj(x).view(b, T, Hkv, d).transpose(1, 2), cos, sin)   # (b, Hkv, T, d)
        v = attn.v_proj(x).view(b, T, Hkv, d).transpose(1, 2)
        kvs.append((k, v))
        if past is not None:
            k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)  # (b, Hkv, S+T, d)
        if fused:
            o = F.scaled_dot_product_attention(q, k, v, mask, scale=attn.scaling,
                                               enable_gqa=True)                     # (b, H, T, d)
        else:
            scores = torch.baddbmm(mask, q.reshape(b * Hkv, g * T, d),  # (b·Hkv, g·T, S+T)
                                   k.flatten(0, 1).transpose(1, 2), alpha=attn.scaling)
            # softmax over the bf16 scores: torch's CPU kernel computes in fp32 and writes bf16, the
            # p of an fp32 softmax cast back, without its fp32 copies of the scores each way
            # (backward too): the update 0.87x (docs/studies/performance.md)
            p = scores.softmax(-1).to(v.dtype)
            o = torch.bmm(p, v.flatten(0, 1)).view(b, -1, T, d)                       # (b, H, T, d)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return decoder.norm(h), kvs
