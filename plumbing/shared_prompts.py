"""The RL updates' fast path on a CPU (--prompt_forward shared, auto there): a group's rollouts
share their prompt, so the training forward runs each prompt once and expands its keys and values
over the group, all inside autograd: the loss's one backward carries every row's share through its
prompt's forward. The same log-probs and gradients as the plain per-row forward
(common.decoder_states without `prompts`), to float rounding (tests/test_rl.py: the shared prompt
forward is the per-row forward; a step the same in any micro-batches). Across a group the prompt
is about a quarter of a row (~34 of ~150 tokens here).
  - `GroupPrompts`: a micro-batch's prompts (each but its last token, left-padded), which prompt
    each row continues, and the row spans each forward runs;
  - `group_prompts`: builds it for common.rollout_batch, whose rows then hold each prompt's last
    token and the completion;
  - `shared_states`: the decoder over the prompts once, then over each span of rows;
  - `group_chunks`: common.micro_batches' micro-batches of whole groups;
  - `spans`: consecutive micro-batches of rows sorted by length (sft.py's token-bounded
    micro-batches too)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache


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


def group_chunks(lengths, n_prompts, size):
    """common.micro_batches' shared layout: micro-batches of whole groups (a prompt's n rows,
    rows prompt-major), size // n of them (at least one), groups in order of their longest
    rollout, each micro-batch's rows sorted by length (`lengths`: each row's)."""
    n = len(lengths) // n_prompts
    by_len = sorted(range(n_prompts), key=lambda g: max(lengths[g * n:g * n + n]))
    per = max(1, size // n)
    return [sorted((r for g in by_len[s:s + per] for r in range(g * n, g * n + n)),
                   key=lengths.__getitem__) for s in range(0, len(by_len), per)]


@dataclass
class GroupPrompts:
    """The prompts of a micro-batch of whole groups, for shared_states: ids (k, P) each prompt but
    its last token, left-padded, attention_mask (k, P), group (B,) each row's prompt, and spans,
    the (start, end) of the rows each forward runs."""
    ids: torch.Tensor
    attention_mask: torch.Tensor
    group: torch.Tensor
    spans: list

    def to(self, device):
        return GroupPrompts(*(x.to(device) for x in (self.ids, self.attention_mask, self.group)),
                            self.spans)


def group_prompts(prompt_ids, rows, n, pad_id, row_lengths, forward_rows):
    """The GroupPrompts of rollout rows `rows` (n a prompt) of prompts `prompt_ids` (token lists),
    the rows' forwards spans of `forward_rows` over their `row_lengths` (sorted ascending)."""
    groups = sorted({r // n for r in rows})
    P = max(len(prompt_ids[g]) - 1 for g in groups)
    return GroupPrompts(
        torch.tensor([[pad_id] * (P + 1 - len(p)) + p[:-1] for p in
                      (prompt_ids[g] for g in groups)]),
        torch.tensor([[0] * (P + 1 - len(p)) + [1] * (len(p) - 1) for p in
                      (prompt_ids[g] for g in groups)]),
        torch.tensor([groups.index(r // n) for r in rows]),
        spans(row_lengths, forward_rows))


def shared_states(decoder, cache, input_ids, attention_mask, prompts):
    """The decoder's last hidden states (B, T, D) of rows input_ids (B, T), each continuing prompt
    prompts.group[row]: its last token, then the rollout. The decoder runs each prompt once, through
    its own forward, and its keys and values, expanded over the prompt's rows, are the cache those
    rows continue from (`cache`: the cache argument's name, models.cache_name). The rows, sorted
    by length, run in forwards of prompts.spans, each padded to its own longest: a group's
    rollouts differ in length (here 40-160 tokens), and one forward of them all would pad each to
    the longest."""
    p_attn = prompts.attention_mask                                            # (k, P) left-padded
    kv = decoder(input_ids=prompts.ids, attention_mask=p_attn, use_cache=True,
                 position_ids=(p_attn.cumsum(-1) - 1).clamp(min=0))[cache]  # [(k, Hkv, P, d)]
    out = []
    for s, e in prompts.spans:
        group, T = prompts.group[s:e], int(attention_mask[s:e].sum(-1).max())  # this forward's
        rows_kv = DynamicCache([(layer.keys[group], layer.values[group]) for layer in kv.layers])
        pos = p_attn.sum(-1)[group, None] + torch.arange(T, device=group.device)        # (b, T)
        h = decoder(input_ids=input_ids[s:e, :T], position_ids=pos, use_cache=True, **{
            cache: rows_kv}, attention_mask=torch.cat([p_attn[group], attention_mask[s:e, :T]], 1)
                    ).last_hidden_state                                                # (b, T, D)
        out.append(F.pad(h, (0, 0, 0, input_ids.shape[1] - T)))
    return torch.cat(out)                                                              # (B, T, D)
