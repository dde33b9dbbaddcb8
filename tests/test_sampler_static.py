"""HFSampler's static decode step (a GPU's loop: _StaticStep, replayed as a CUDA graph there),
forced here on the CPU with decode="static": its logits are a full forward's, its log-probs the
trainer's, every row draws from the one seeded generator each step, rows stop at their first EOS.
The graph itself needs CUDA: benchmarks/gpu_smoke.py's sampler stage checks its tokens and
log-probs against this loop's on a GPU."""
from types import SimpleNamespace

import pytest
import torch
from test_sampler import PROMPTS, assert_logprobs_are_the_trainers, last_logits, tiny

from plumbing import fast_decode as F
from plumbing import harness
from plumbing import models as M
import common as S
from plumbing.flags import CountdownError


def static(model, tok, **kw):
    return S.HFSampler(model, tok, decode="static", **kw)


def scripted(monkeypatch, script):
    """_pick replaced by `script` (rows, L): step t returns column t for every row, and records the
    logits it was given, {row: (V,)}, one dict per step."""
    seen = []

    def pick(logits, *_):
        t = len(seen)
        seen.append(dict(enumerate(logits)))
        return script[:, t]
    monkeypatch.setattr(S, "_pick", pick)
    return seen


def test_static_logits_equal_a_full_forward(monkeypatch):
    """Every step's logits, for every row (finished ones too: the static loop keeps them), equal a
    full forward of that row's prompt and tokens so far, no padding, no cache: the cache slot each
    token's keys go to, the one its bias opens and its position agree. Rows 0, 1 and 3 end early;
    the others never do, so the loop runs all L steps and those rows stay unfinished. A random
    model with init std 0.05 (2.5x the default), so that positions matter.
    Broken on purpose: keys and values written one slot later (P + t) than the bias opens,
    this test failed; the slot never opened in the bias, it failed."""
    model, tok = tiny(initializer_range=0.05)
    eos, L, n = tok.eos_token_id, 12, 2
    script = torch.randint(eos + 1, len(tok), (6, L), generator=torch.Generator().manual_seed(0))
    script[0, 1] = script[1, 1] = script[3, 3] = eos
    seen = scripted(monkeypatch, script)
    ro = static(model, tok).generate(PROMPTS, n, 1.0, max_new_tokens=L)
    assert [len(s) for s in seen] == [6] * L  # every row, every step
    for t, logits in enumerate(seen):
        for r, row_logits in logits.items():
            prefix = ro.prompt_ids[r // n] + script[r, :t].tolist()
            assert torch.allclose(row_logits, last_logits(model, prefix), atol=1e-5), (t, r)
    ends = [2, 2, L, 4, L, L]  # through the EOS, or all L tokens
    assert ro.completion_ids == [script[r, :k].tolist() for r, k in enumerate(ends)]
    assert ro.finished == [k < L for k in ends]


@pytest.mark.parametrize("late_row", [False, True])
def test_static_rows_stop_at_their_first_eos(monkeypatch, late_row):
    """A row's completion ends at its first EOS (a later EOS in its junk changes nothing) and is
    finished; the batch stops at the step where its last row ends. With `late_row`, row 5 never
    emits one: it is cut at L tokens with finished False and the loop runs all L steps.
    Broken on purpose: row 0's EOS left out of the step's check (`active`), this test failed (the
    batch ran on to L); the completions cut at the last EOS instead of the first, it failed too."""
    model, tok = tiny()
    eos, L = tok.eos_token_id, 10
    script = torch.randint(eos + 1, len(tok), (6, L), generator=torch.Generator().manual_seed(1))
    ends = [2, 5, 3, 1, 4, L if late_row else 6]  # tokens through each row's first EOS
    for r, k in enumerate(ends):
        if k < L or not late_row:
            script[r, k - 1] = eos
    script[2, 4] = eos  # a second EOS in row 2's junk
    seen = scripted(monkeypatch, script)
    ro = static(model, tok).generate(PROMPTS, 2, 1.0, max_new_tokens=L)
    assert len(seen) == max(ends)  # no step after the last row's EOS
    assert ro.completion_ids == [script[r, :k].tolist() for r, k in enumerate(ends)]
    assert ro.finished == [not (late_row and r == 5) for r in range(6)]
    assert all(len(lp) == k for lp, k in zip(ro.logprobs, ends))


def reference_tokens(model, tok, prompts, n, L, seed, batch_size, options):
    """What the static loop must draw, computed naively: in batches of `batch_size` rows, each
    step a full forward of every row (finished or not), then common._pick over all of the batch's
    rows with the one generator seeded by `seed`, until every row of the batch has an EOS."""
    eos, gen = tok.eos_token_id, torch.Generator().manual_seed(seed)
    rows = [p for p in tok(prompts, add_special_tokens=False)["input_ids"] for _ in range(n)]
    out = []
    for s in range(0, len(rows), batch_size):
        batch = rows[s:s + batch_size]
        comps = [[] for _ in batch]
        for _ in range(L):
            logits = torch.stack([last_logits(model, r + c) for r, c in zip(batch, comps)])
            for c, x in zip(comps, S._pick(logits, gen=gen, **options).tolist()):
                c.append(x)
            if all(eos in c for c in comps):
                break
        out += [c[:c.index(eos) + 1] if eos in c else c for c in comps]
    return out


@pytest.mark.parametrize("eos_logit,options", [
    (2.5, dict(temperature=0.7, top_p=1.0, top_k=0, bottom_p=1.0, bottom_p_freq=1.0)),
    (2.0, dict(temperature=1.0, top_p=0.95, top_k=20, bottom_p=0.5, bottom_p_freq=0.5)),
])
def test_every_row_draws_from_one_stream_each_step(eos_logit, options):
    """Each step every row of a batch draws from the one generator seeded by `seed`, finished or
    not, and the stream runs on from batch to batch (8 rows in batches of 3, 3 and 2): a row's
    sample does not depend on which others finished, and the graph can replay the step. The
    tokens are the naive reference's (reference_tokens).
    Broken on purpose: row 0's draws from a generator of its own (a reseeded row), this test
    failed; the generator reseeded at each batch, it failed; draws for unfinished rows only (the
    dynamic loop's), it failed."""
    model, tok = tiny(eos_logit)
    prompts, n, L = PROMPTS + ["User: 4 4"], 2, 16
    ro = static(model, tok, batch_size=3).generate(prompts, n, max_new_tokens=L, seed=5, **options)
    ref = reference_tokens(model, tok, prompts, n, L, 5, 3, options)
    assert 0 < sum(ro.finished) < len(ro.finished)
    assert ro.completion_ids == ref


def test_same_seed_same_tokens_twice():
    """One generator seeded by `seed` serves the call: the same seed gives the same tokens and
    log-probs twice, another seed other tokens.
    Broken on purpose: the draws from torch's global generator (no `generator=`), this test
    failed."""
    model, tok = tiny(2.0)
    a, b, c = (static(model, tok).generate(PROMPTS, 4, 1.0, max_new_tokens=16, seed=s)
               for s in (7, 7, 8))
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert a.completion_ids != c.completion_ids


@pytest.mark.parametrize("L", [16, 2])
def test_the_graph_loop_is_the_static_loop_with_replays(monkeypatch, L):
    """decode="graph" with its CUDA part stood in for (the capture needs a GPU): _graphed runs the
    step once, the warm-up, and returns a replay that runs it again. The tokens and log-probs are
    the static loop's: the warm-up step counts as a token, no step is skipped or run twice, and a
    batch with nothing left to replay (L = 2) captures nothing.
    Broken on purpose: the loop replaying right after the capture too, this test failed."""
    model, tok = tiny(eos_logit=2.0)
    ref = static(model, tok).generate(PROMPTS, 3, 1.0, max_new_tokens=L, seed=4)
    captures = []

    def graphed(step, gen):
        captures.append(gen)
        step()
        return step
    monkeypatch.setattr(F, "_graphed", graphed)
    monkeypatch.setattr(S.HFSampler, "decode_mode", lambda self: "graph")
    ro = S.HFSampler(model, tok).generate(PROMPTS, 3, 1.0, max_new_tokens=L, seed=4)
    assert len(captures) == (L > 2)  # one batch: one capture, with the sampling generator
    assert ro.completion_ids == ref.completion_ids and ro.logprobs == ref.logprobs
    assert max(map(len, ro.completion_ids)) == L


@pytest.mark.parametrize("temperature,eos_logit,batch_size", [(0.7, 2.0, 8), (1.5, 4.0, 1024)])
def test_static_logprobs_match_the_trainers_forward(temperature, eos_logit, batch_size):
    """Log-probs of softmax(logits / T) of the sampled tokens equal token_stats(temperature=T) on
    the same rows, to 1e-5 in fp32, some rows finished early, in one batch or several.
    Broken on purpose: keys and values one slot later, this test failed."""
    model, tok = tiny(eos_logit)
    ro = static(model, tok, batch_size=batch_size).generate(PROMPTS, 6, temperature,
                                                            max_new_tokens=24, seed=1)
    assert 0 < sum(ro.finished) < len(ro.finished)
    assert_logprobs_are_the_trainers(model, tok, ro, temperature)


def test_static_lora_and_llama_go_through_their_own_modules(tiny_ckpt):
    """A peft model with trained adapters samples with its own log-probs (the adapters change
    them), and Llama (no q/k/v biases) decodes too."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model, _, _ = harness.load_policy(tiny_ckpt, False, lora_rank=4)
    tok = M.build_tiny_tokenizer()
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    model.eval()
    ro = static(model, tok).generate(PROMPTS, 3, 0.7, max_new_tokens=16, seed=0)
    assert_logprobs_are_the_trainers(model, tok, ro, 0.7)
    with model.disable_adapter():
        with pytest.raises(AssertionError):
            assert_logprobs_are_the_trainers(model, tok, ro, 0.7)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, initializer_range=0.2)).eval()
    ro = static(llama, tok).generate(PROMPTS, 2, 1.0, max_new_tokens=12, seed=0)
    assert_logprobs_are_the_trainers(llama, tok, ro, 1.0)


def test_decode_modes_by_device_and_refusals():
    """By default a CPU decodes with the dynamic loop (faster there) and a GPU with the graph; the
    graph on a CPU model, or an unknown mode, is one line naming the way out."""
    model, tok = tiny()
    assert S.HFSampler(model, tok).decode_mode() == "dynamic"
    on_gpu = SimpleNamespace(decode=None, model=SimpleNamespace(device=torch.device("cuda")))
    if hasattr(torch.cuda.CUDAGraph, "register_generator_state"):  # a CUDA build of torch
        assert S.HFSampler.decode_mode(on_gpu) == "graph"
    else:  # this CPU build has no CUDA graphs: the graph was chosen, and refused
        with pytest.raises(CountdownError, match="decode='graph'"):
            S.HFSampler.decode_mode(on_gpu)
    assert static(model, tok).decode_mode() == "static"
    with pytest.raises(CountdownError, match="decode='static'"):
        S.HFSampler(model, tok, decode="graph").generate(PROMPTS, 1, max_new_tokens=2)
    with pytest.raises(CountdownError, match="dynamic, static, graph"):
        S.HFSampler(model, tok, decode="fast")
