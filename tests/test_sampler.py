"""HFSampler's fast decode loop (plumbing/fast_decode.py: the model's own modules, a KV cache written in
place): its logits are the model's, its log-probs the trainer's, its draws the plain loop's token
for token (common.py's loop over transformers' cache, decode='plain'), with and without LoRA."""
import warnings

import pytest
import torch

from plumbing import tasks as D
from plumbing import fast_decode as F
import common as LP
from plumbing import harness
from plumbing import models as M
import common as S
from plumbing.flags import CountdownError
from common import token_stats


# three prompt lengths: the batch is left-padded
PROMPTS = [D.make_prompt([3, 5, 4], 32, "compact"), D.make_prompt([10, 2, 7, 1], 99, "compact"),
           "User: 1 2"]


def tiny(eos_logit=0.0, seed=0, **overrides):
    """A tiny random Qwen2 (fp32, eval) and its tokenizer; with `eos_logit`, the EOS row of the
    (tied) head points along the mean hidden state (as tests/test_common.py does), so EOS gets a
    logit of about that much and rows finish at different steps."""
    torch.manual_seed(seed)
    tok = M.build_tiny_tokenizer()
    model = M.build_tiny_model(tok, **overrides).eval()
    if eos_logit:
        with torch.no_grad():
            ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
            h = model.get_decoder()(input_ids=ids).last_hidden_state.mean((0, 1))
            model.get_output_embeddings().weight[tok.eos_token_id] = eos_logit * h / h.norm() ** 2
    return model, tok


def last_logits(model, ids):
    """The logits after `ids` (one row, no padding) by a plain full forward, no cache. (V,)"""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def assert_logprobs_are_the_trainers(model, tok, ro, temperature):
    rows = list(range(len(ro.completion_ids)))
    ids, attn, mask, sampler_lp = LP.rollout_batch(ro, rows, tok.pad_token_id)[:4]
    with torch.no_grad():
        logp = token_stats(model, ids, attn, mask, temperature=temperature)["logp"]
    sel = mask[:, 1:].bool()
    assert sel.sum() == sum(map(len, ro.logprobs))
    assert (logp - sampler_lp)[sel].abs().max() < 1e-5


@pytest.mark.parametrize("slots", [3, F._KVCache.R])
def test_decode_logits_equal_a_full_forward_with_padding_and_dropped_rows(monkeypatch, slots):
    """Every step's logits, for every row the batch holds, equal a full forward of that row's
    prompt and tokens so far (no padding, no cache). The tokens come from a script, in which rows
    0 and 1 end at step 1 (4 of 6 left: the batch drops them) and row 3 at step 3 (3 of 4 left:
    dropped too); a random model with init std 0.05 (2.5x the default), so that positions matter.
    The cache's written-in-place part holds `slots` tokens before it is appended to the rest: 3,
    so that appends and drops interleave, and the default, reached at step 32."""
    monkeypatch.setattr(F._KVCache, "R", slots)
    model, tok = tiny(initializer_range=0.05)
    eos, L, n = tok.eos_token_id, 40, 2
    script = torch.randint(eos + 1, len(tok), (6, L), generator=torch.Generator().manual_seed(0))
    script[0, 1] = script[1, 1] = script[3, 3] = eos
    live, active, seen = list(range(6)), [True] * 6, []  # mirrors the sampler's batch

    def pick(logits, *_):
        t = len(seen)
        assert len(logits) == len(live)  # the rows it holds: finished ones leave as designed
        seen.append({r: logits[i] for i, r in enumerate(live)})
        for r in live:
            active[r] &= bool(script[r, t] != eos)
        toks = script[live, t]
        if sum(active[r] for r in live) <= 0.75 * len(live):
            live[:] = [r for r in live if active[r]]
        return toks

    monkeypatch.setattr(S, "_pick", pick)
    ro = S.HFSampler(model, tok).generate(PROMPTS, n, 1.0, max_new_tokens=L)
    assert [len(s) for s in seen] == [6, 6, 4, 4] + [3] * (L - 4)
    for t, logits in enumerate(seen):
        for r, row_logits in logits.items():
            prefix = ro.prompt_ids[r // n] + script[r, :t].tolist()
            assert torch.allclose(row_logits, last_logits(model, prefix), atol=1e-5), (t, r)
    ends = [2, 2, L, 4, L, L]  # through the EOS, or all L tokens
    assert ro.completion_ids == [script[r, :k].tolist() for r, k in enumerate(ends)]
    assert ro.finished == [k < L for k in ends]


@pytest.mark.parametrize("temperature,eos_logit", [(0.7, 2.0), (1.5, 4.0)])
def test_sampled_logprobs_match_the_trainers_forward(temperature, eos_logit):
    """Log-probs of softmax(logits / T) of the sampled tokens equal token_stats(temperature=T) on
    the same rows, to 1e-5 in fp32; with rows of different lengths, some finished early."""
    model, tok = tiny(eos_logit)
    ro = S.HFSampler(model, tok, batch_size=8).generate(PROMPTS, 6, temperature,
                                                        max_new_tokens=24, seed=1)
    assert 0 < sum(ro.finished) < len(ro.finished)
    assert_logprobs_are_the_trainers(model, tok, ro, temperature)


# an EOS logit per case that ends some rows early and not others
@pytest.mark.parametrize("eos_logit,options", [
    (2.0, dict(temperature=0.7)),
    (0.5, dict(temperature=0.6, top_p=0.95, top_k=20)),
    (3.5, dict(temperature=1.0, bottom_p=0.5, bottom_p_freq=0.5)),
    (0.8, dict(temperature=0.0)),
])
def test_the_fast_twin_draws_the_plain_loops_tokens(monkeypatch, eos_logit, options):
    """The same seed draws the same tokens as the plain loop (the transformers forward with
    its DynamicCache), with the same log-probs and stops: the generator is used in the same order
    and the arithmetic agrees closely enough that no draw flips. The cache's written-in-place part
    holds 5 tokens, so that appends to the rest happen between the drops."""
    monkeypatch.setattr(F._KVCache, "R", 5)
    model, tok = tiny(eos_logit)
    fast, plain = (S.HFSampler(model, tok, batch_size=8, decode=decode).generate(
        PROMPTS, 6, max_new_tokens=24, seed=2, **options) for decode in ("dynamic", "plain"))
    assert 0 < sum(fast.finished) < len(fast.finished)
    assert fast.completion_ids == plain.completion_ids and fast.finished == plain.finished
    assert fast.texts == plain.texts
    for a, b in zip(fast.logprobs, plain.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_lora_model_samples_through_its_adapters(tiny_ckpt):
    """A peft model with trained (nonzero) adapters: its samples carry its own log-probs (not the
    base model's), and the tokens are the plain loop's."""
    model, _, _ = harness.load_policy(tiny_ckpt, False, lora_rank=4)
    tok = M.build_tiny_tokenizer()
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    model.eval()
    ro = S.HFSampler(model, tok).generate(PROMPTS, 3, 0.7, max_new_tokens=16, seed=0)
    assert_logprobs_are_the_trainers(model, tok, ro, 0.7)
    with model.disable_adapter():  # the adapters change the log-probs: they were used
        with pytest.raises(AssertionError):
            assert_logprobs_are_the_trainers(model, tok, ro, 0.7)
    plain = S.HFSampler(model, tok, decode="plain").generate(PROMPTS, 3, 0.7, max_new_tokens=16, seed=0)
    assert ro.completion_ids == plain.completion_ids


def test_llama_decodes_too_and_other_models_are_refused():
    """Llama (no q/k/v biases) goes through the same loop; another architecture gets one line
    naming what is supported; a blown-up model, the non-finite-logits error."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    tok = M.build_tiny_tokenizer()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, initializer_range=0.2)).eval()
    ro = S.HFSampler(llama, tok).generate(PROMPTS, 2, 1.0, max_new_tokens=12, seed=0)
    assert_logprobs_are_the_trainers(llama, tok, ro, 1.0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(CountdownError, match="Qwen2 and Llama"):
        S.HFSampler(gpt2, tok).generate(PROMPTS, 1, max_new_tokens=2)
    model, _ = tiny()
    with torch.no_grad():
        model.get_decoder().norm.weight[0] = float("nan")
    with pytest.raises(CountdownError, match="not finite"):
        S.HFSampler(model, tok).generate(PROMPTS, 1, max_new_tokens=2)


# ---- on a GPU: bf16, one preallocated cache, rows bounded by the cache's memory -----------------
def test_a_gpu_decode_preallocates_every_slot_and_samples_the_same(monkeypatch):
    """On a GPU the cache's written-in-place part holds all L decode slots from the start: no
    append ever copies the cache (twice its memory for a moment). Forced here on CPU: the same
    tokens and log-probs as the appending CPU path, and `old` never grows past the prompt."""
    L = 40  # past _KVCache.R: the CPU path appends once
    assert F._decode_slots(torch.device("cuda"), L) == L and F._decode_slots(torch.device("cpu"), L) == F._KVCache.R
    model, tok = tiny(eos_logit=2.0)
    ref = S.HFSampler(model, tok).generate(PROMPTS, 2, 1.0, max_new_tokens=L, seed=3)
    sizes, advance = [], F._KVCache.advance

    def spy(self, T):
        advance(self, T)
        sizes.append(self.old.shape[4])
    monkeypatch.setattr(F._KVCache, "advance", spy)
    monkeypatch.setattr(F, "_decode_slots", lambda dev, L: L)
    ro = S.HFSampler(model, tok).generate(PROMPTS, 2, 1.0, max_new_tokens=L, seed=3)
    assert len(sizes) > F._KVCache.R and set(sizes) == {sizes[0]}  # the prompt's P slots, never more
    assert ro.completion_ids == ref.completion_ids and max(map(len, ro.completion_ids)) > F._KVCache.R
    for a, b in zip(ro.logprobs, ref.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


@pytest.mark.parametrize("decode,cache,attr", [("dynamic", "_KVCache", "new"),
                                               ("static", "_StaticStep", "cache")])
def test_a_gpu_decodes_under_bf16_autocast(decode, cache, attr, monkeypatch):
    """Rollouts run outside the trainer's autocast: on a GPU the sampler brings its own (a bf16
    cache, the trainer's precision; fp32 doubled both). On a CPU nothing changes. The bf16 path
    itself, forced on this CPU, in both loops (the static one is what a GPU's graph replays): a
    bf16 cache, log-probs near the fp32 trainer's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: torch disables it, and says so
        ctx = S._decode_precision(torch.device("cuda"))
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
    assert not isinstance(S._decode_precision(torch.device("cpu")), torch.autocast)
    model, tok = tiny(eos_logit=2.0)
    dtypes, init = [], getattr(F, cache).__init__

    def spy(self, *args):
        init(self, *args)
        dtypes.append(getattr(self, attr).dtype)
    monkeypatch.setattr(getattr(F, cache), "__init__", spy)
    monkeypatch.setattr(S, "_decode_precision", lambda dev: torch.autocast("cpu", torch.bfloat16))
    ro = S.HFSampler(model, tok, decode=decode).generate(PROMPTS, 2, 1.0, max_new_tokens=16, seed=0)
    assert dtypes == [torch.bfloat16]
    rows = list(range(len(ro.completion_ids)))
    ids, attn, mask, sampler_lp = LP.rollout_batch(ro, rows, tok.pad_token_id)[:4]
    with torch.no_grad():
        logp = token_stats(model, ids, attn, mask)["logp"]
    gap = (logp - sampler_lp)[mask[:, 1:].bool()].abs()
    assert 0 < gap.mean() < 0.05, gap.mean()  # bf16 rounding, not another distribution


def test_a_kv_cache_budget_bounds_the_rows_decoded_together(monkeypatch):
    """On a GPU a batch holds only as many rows as their KV cache fits in kv_budget (1,024 rows of a
    7B model's 1,300 positions are 68 GB): keys and values of every layer, 2 bytes each, half the
    budget left for the copy that dropping finished rows makes. Without a budget (a CPU), batch_size."""
    model, tok = tiny()
    attn = model.get_decoder().layers[0].self_attn
    cfg = model.config
    per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * attn.head_dim * 2  # bytes
    P, L = max(len(p) for p in tok(PROMPTS, add_special_tokens=False)["input_ids"]), 6
    sampler = S.HFSampler(model, tok, kv_budget=2 * 4 * per_slot * (P + L), decode="plain")  # 4 rows
    assert sampler.rows_per_batch(P + L) == 4 and S.HFSampler(model, tok).rows_per_batch(P + L) == 1024
    assert S.HFSampler(model, tok, batch_size=3, kv_budget=1e12).rows_per_batch(P + L) == 3
    sizes, batch = [], S.HFSampler._batch
    monkeypatch.setattr(S.HFSampler, "_batch", lambda self, rows, *a: sizes.append(len(rows)) or batch(self, rows, *a))
    ro = sampler.generate(PROMPTS, 3, 1.0, max_new_tokens=L, seed=0)
    assert sizes == [4, 4, 1] and len(ro.completion_ids) == 9


def test_the_decode_flag_picks_the_loop_and_a_script_logs_the_same_either_way(tiny_ckpt, tmp_path,
                                                                               monkeypatch):
    """--decode plain runs common.py's plain loop in a script (its _batch is called); its rollouts
    are the fast twin's, so two RLOO steps log the same metrics, times aside: the same tokens make
    every count equal, and the two loops' log-probs (which the IS weight and the KL read) agree to
    float noise (fp32 training here: a bf16 trainer's rounding would blur that comparison). A loop
    that is not one is one line naming the choices."""
    import json

    import rloo
    from test_rl import FAST
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")
    calls, batch = [], S.HFSampler._batch
    monkeypatch.setattr(S.HFSampler, "_batch", lambda self, *a: calls.append(1) or batch(self, *a))
    rows = {}
    for decode in ("plain", "auto"):
        n = len(calls)
        rloo.main(["--init", tiny_ckpt, *FAST, "--decode", decode, "--output_dir", str(tmp_path / decode)])
        assert (len(calls) > n) == (decode == "plain"), decode
        rows[decode] = [{k: v for k, v in json.loads(x).items() if k != "wall" and not k.startswith("time/")}
                        for x in open(tmp_path / decode / "metrics.jsonl")]
    assert len(rows["plain"]) == 3
    for plain, fast in zip(rows["plain"], rows["auto"]):
        assert plain.keys() == fast.keys()
        for k in plain:
            assert plain[k] == pytest.approx(fast[k], rel=1e-4, abs=1e-6), (plain["step"], k)
    model, tok = tiny()
    with pytest.raises(CountdownError, match="--decode must be one of auto, plain, dynamic"):
        S.HFSampler(model, tok, decode="fast")
