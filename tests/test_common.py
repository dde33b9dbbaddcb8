import dataclasses
import json
import os

import pytest
import torch
from conftest import ROOT, run_cli

from plumbing import flags as C
from plumbing import tasks as D
import common as LP
from plumbing import harness as L
from plumbing import models as M
import common as S
from plumbing import traces as TR
import verifier as V
from plumbing.checkpoints import save_checkpoint
from benchmarks.vllm_check import logprob_gap


def qwen_like(vocab, seed=0, hidden=32):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def naive_stats(model, ids, attn, temperature=1.0):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    return logp_all, logp_all.gather(-1, ids[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def big_vocab_model():
    return qwen_like(151_936)


def batch(vocab, B=3, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, -5:] = 0  # right padding
    mask = attn.clone()
    mask[:, :6] = 0   # prompt
    return ids, attn, mask


def test_chunked_logprobs_and_entropy_match_naive_at_qwen_vocab(big_vocab_model):
    ids, attn, mask = batch(151_936)
    stats = LP.token_stats(big_vocab_model, ids, attn, mask, entropy=True, chunk_size=7)
    logp_all, logp = naive_stats(big_vocab_model, ids, attn)
    sel = mask[:, 1:].bool()
    assert torch.allclose(stats["logp"][sel], logp[sel], atol=1e-5)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    assert torch.allclose(stats["entropy"][sel], entropy[sel], atol=1e-5)
    assert (stats["logp"][~sel] == 0).all() and (stats["entropy"][~sel] == 0).all()


def test_correct_is_where_the_target_is_the_argmax():
    """token_stats' `correct` (SFT's train/token_acc) marks the tokens that are the logits' argmax: a
    greedy continuation with every fourth token replaced holds both kinds. Broken on purpose: `>`
    for `>=` (no token ever correct) and the amax over positions, not the vocab, both failed."""
    model = qwen_like(50, seed=1)
    ids = model.generate(torch.randint(2, 50, (3, 4)), max_new_tokens=16, do_sample=False,
                         min_new_tokens=16, pad_token_id=0)
    ids[:, 5::4] = (ids[:, 5::4] + 7) % 50
    attn, mask = torch.ones_like(ids), torch.ones_like(ids)
    mask[:, :4] = 0
    stats = LP.token_stats(model, ids, attn, mask, temperature=0.7, chunk_size=9)
    logits = model(input_ids=ids).logits[:, :-1]
    sel = mask[:, 1:].bool()
    want = (logits.argmax(-1) == ids[:, 1:]).float()
    assert 0 < want[sel].mean() < 1 and torch.equal(stats["correct"][sel], want[sel])
    assert (stats["correct"][~sel] == 0).all()


def test_chunked_logprobs_gradient_matches_naive():
    model = qwen_like(1000)
    ids, attn, mask = batch(1000)
    sel = mask[:, 1:].bool()
    LP.token_stats(model, ids, attn, mask, temperature=0.7, chunk_size=5)["logp"].sum().backward()
    g_chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, logp = naive_stats(model, ids, attn, temperature=0.7)
    logp[sel].sum().backward()
    for a, p in zip(g_chunked, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-5)


def test_right_padding_drops_the_mask_and_left_padding_keeps_it(monkeypatch):
    """token_stats runs right-padded rows under the causal mask alone (faster, same values) and
    left-padded ones under their mask; both match the naive forward with the mask."""
    model = qwen_like(1000)
    ids, right, mask = batch(1000)
    left = right.flip(1)
    masks = []
    decoder = model.get_decoder()
    monkeypatch.setattr(model, "get_decoder",
                        lambda: lambda **kw: masks.append(kw["attention_mask"]) or decoder(**kw))
    for attn in (right, left):
        sel = (mask * attn)[:, 1:].bool()
        logp = LP.token_stats(model, ids, attn, mask * attn)["logp"]
        assert torch.allclose(logp[sel], naive_stats(model, ids, attn)[1][sel], atol=1e-5)
    assert masks[0] is None and masks[1] is left


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_forward_and_reverse_kl_match_naive_with_padded_teacher_vocab(temperature, reverse):
    # teacher vocab padded by 24; forward KL(teacher ‖ student) (000 Eq. 4), reverse KL(student ‖ teacher) (GKD)
    student, teacher = qwen_like(1000, seed=0), qwen_like(1024, seed=1)
    with torch.no_grad():  # a peaked teacher: near-uniform ones make the two directions equal to 1e-4
        teacher.get_output_embeddings().weight.mul_(30)
    ids, attn, mask = batch(1000)
    stats = LP.token_stats(student, ids, attn, mask, teacher=teacher, kd_temperature=temperature, chunk_size=4,
                           kd_reverse=reverse)
    zs = student(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    zt = teacher(input_ids=ids, attention_mask=attn).logits[:, :-1, :1000].float()
    ps, pt = torch.log_softmax(zs / temperature, -1), torch.log_softmax(zt / temperature, -1)
    p, q = (ps, pt) if reverse else (pt, ps)
    kl = (p.exp() * (p - q)).sum(-1)
    other = (q.exp() * (q - p)).sum(-1)  # the other direction: a different number here
    sel = mask[:, 1:].bool()
    assert torch.allclose(stats["kl"][sel], kl[sel], atol=1e-5)
    assert (stats["kl"][sel] - other[sel]).abs().min() > 1e-3
    assert (stats["kl"][sel] > 0).all()
    assert LP.token_stats(student, ids, attn, mask, teacher=student, kd_reverse=reverse)["kl"].abs().max() < 1e-5


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return M.load_model("tiny")


@pytest.mark.parametrize("bf16", [True, False])
def test_the_cpu_attention_is_transformers_eager_one(bf16):
    """plumbing/models.py's cpu_attention (in bf16 a KV head's query heads as rows of one matmul, the
    softmax over bf16 scores; in fp32 torch's fused kernel with grouped-query heads) against
    transformers' eager attention under the same autocast, or none (fp32), rows left-padded (a row
    all padding must not turn NaN): the same hidden states within bf16 rounding, or fp32's. Broken on
    purpose (the KV heads swapped; the mask's -inf from fp32's min in bf16; the mask left out in
    fp32), it failed. The causal-alone fp32 path (is_causal) is held by the autocast test below."""
    model = qwen_like(64).eval()
    ids = torch.randint(0, 64, (3, 12))
    attn = (torch.arange(12)[None] >= torch.tensor([0, 3, 7])[:, None]).long()  # left padding
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for impl in ("eager", "cpu_attention"):
            model.set_attn_implementation(impl)
            out[impl] = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=pos
                                            ).last_hidden_state.float()
    assert torch.isfinite(out["cpu_attention"]).all()
    real = attn.bool()
    diff = (out["eager"] - out["cpu_attention"])[real].abs().max()
    assert diff < (0.05 if bf16 else 1e-5) * out["eager"][real].abs().max(), diff


def test_autocast_bf16_on_cpu_switches_attention_and_restores_it(monkeypatch):
    """CPU bf16 (cpu_bf16()): bf16 compute with cpu_attention inside, the model as it was after,
    even after an error; values within bf16 rounding of fp32. COUNTDOWN_CPU_BF16=0: fp32, the same
    attention, causal alone (is_causal), equal to transformers' sdpa's; with is_causal False it
    failed."""
    model = qwen_like(64).train()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 64, (3, 12))
    attn, mask = torch.ones_like(ids), torch.ones_like(ids)
    fp32 = LP.token_stats(model, ids, attn, mask)["logp"]
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "1")
    with LP.autocast("cpu", model, None):
        assert model.config._attn_implementation == "cpu_attention"
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
        bf16 = LP.token_stats(model, ids, attn, mask)["logp"]
    assert model.config._attn_implementation == "sdpa" and not torch.is_autocast_enabled("cpu")
    assert bf16.dtype == torch.float32 and 0 < (bf16 - fp32).abs().max() < 0.05
    with pytest.raises(RuntimeError), LP.autocast("cpu", model):
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")
    with LP.autocast("cpu", model):  # fp32: the same attention, not autocast
        assert model.config._attn_implementation == "cpu_attention" and not torch.is_autocast_enabled("cpu")
        assert torch.allclose(LP.token_stats(model, ids, attn, mask)["logp"], fp32, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_mask_keeps_eos_and_drops_prompt_and_padding():
    tok = M.build_tiny_tokenizer()
    prompts = [D.make_prompt([3, 5, 4], 32, "compact"), D.make_prompt([10, 2, 7, 1], 99, "compact")]
    responses = [" 3 + 5 = 8.\n</think>\n<answer>(3 + 5) * 4</answer>", " x"]
    ids, attn, mask = LP.tokenize_pairs(tok, prompts, responses)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n_p = len(tok(p)["input_ids"])
        n_r = len(tok(r, add_special_tokens=False)["input_ids"]) + 1
        assert mask[i, :n_p].sum() == 0 and mask[i, n_p:n_p + n_r].all() and mask[i, n_p + n_r:].sum() == 0
        assert ids[i, n_p + n_r - 1] == tok.eos_token_id  # the EOS is the last masked token
        assert tok.decode(ids[i][mask[i].bool()][:-1]) == r
        assert attn[i].sum() == n_p + n_r
    # pad == eos, as for Qwen base: masks come from lengths, so the real EOS still counts
    ids, attn, mask = LP.pack([[5, 6], [5]], [[7, 1], [1]], pad_id=1)
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]] and attn.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_prompt_longer_than_max_is_a_clear_error():
    tok = M.build_tiny_tokenizer()
    with pytest.raises(C.CountdownError, match="max_prompt_len"):
        LP.tokenize_pairs(tok, [D.make_prompt([1, 2, 3], 6)], ["x"], max_prompt_len=10)


def test_tiny_tokenizer_round_trips_any_text():
    tok = M.build_tiny_tokenizer()
    for text in [D.make_prompt([12, 7, 99, 1], 100), TR.make_trace([7, 4, 5], 55, dead_ends=2),
                 "<answer> 123 / (4-5) </answer>\n\t ünïcode ✓ \x00", ""]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tok("<answer>", add_special_tokens=False)["input_ids"]) == 1
    assert tok.pad_token_id != tok.eos_token_id


def test_hf_sampler_stops_at_eos_and_respects_max_tokens(tiny):
    model, tok = tiny
    prompts = [D.make_prompt([3, 5, 4], 32, "compact"), D.make_prompt([1, 2], 3, "compact")]
    # point the EOS row of the (tied) head along the mean hidden state: EOS logit ~4, the rest ~0,
    # so some rows finish and others run out of budget
    model = M.build_tiny_model(tok)
    model.load_state_dict(tiny[0].state_dict())
    with torch.no_grad():
        h = model.base_model(input_ids=torch.tensor([tok(prompts[0])["input_ids"]])).last_hidden_state.mean((0, 1))
        model.get_output_embeddings().weight[tok.eos_token_id] = 4 * h / h.norm() ** 2
    ro = S.HFSampler(model, tok, batch_size=5).generate(prompts, n=6, temperature=1.0, max_new_tokens=12, seed=3)
    assert len(ro.completion_ids) == 12 and len(ro.prompt_ids) == 2
    for ids, lps, done in zip(ro.completion_ids, ro.logprobs, ro.finished):
        assert 1 <= len(ids) <= 12 and len(lps) == len(ids)
        assert (tok.eos_token_id in ids) == done
        if done:
            assert ids.index(tok.eos_token_id) == len(ids) - 1  # nothing after the EOS
        else:
            assert len(ids) == 12
    assert 0 < sum(ro.finished) < 12
    again = S.HFSampler(model, tok, batch_size=5).generate(prompts, n=6, temperature=1.0, max_new_tokens=12, seed=3)
    assert again.completion_ids == ro.completion_ids  # seeded: same draw


def test_sampler_logprobs_match_trainer_logprobs(tiny):
    """The weight-sync canary: the sampler's log-probs of its own tokens equal a fresh forward pass."""
    model, tok = tiny
    prompts = [D.make_prompt([3, 5, 4], 32, "compact"), D.make_prompt([10, 2, 7, 1], 99, "base")]
    ro = S.HFSampler(model, tok).generate(prompts, n=3, temperature=1.0, max_new_tokens=20, seed=0)
    ids, attn, mask, sampler_lp = LP.rollout_batch(ro, list(range(6)), tok.pad_token_id)[:4]
    with torch.no_grad():
        logp = LP.token_stats(model, ids, attn, mask)["logp"]
    assert (logp - sampler_lp).abs().max() < 1e-4 and (sampler_lp != 0).sum() == sum(map(len, ro.logprobs))
    assert logprob_gap(model, tok, ro, 1.0) == pytest.approx((logp - sampler_lp)[mask[:, 1:].bool()].abs().mean().item())


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_sampler_logprobs_are_of_the_sampling_distribution(tiny, temperature):
    """Rollouts drawn at T carry log softmax(logits / T), what token_stats(temperature=T) gives the
    trainer: ρ = π_θ/μ is 1 on the first pass at any T, and the update trains the policy that
    sampled."""
    model, tok = tiny
    prompts = [D.make_prompt([3, 5, 4], 32, "compact"), D.make_prompt([10, 2, 7], 99, "compact")]
    ro = S.HFSampler(model, tok).generate(prompts, n=3, temperature=temperature, max_new_tokens=20, seed=0)
    ids, attn, mask, sampler_lp = LP.rollout_batch(ro, list(range(6)), tok.pad_token_id)[:4]
    m = mask[:, 1:].bool()
    with torch.no_grad():
        tempered = LP.token_stats(model, ids, attn, mask, temperature=temperature)["logp"]
        raw = LP.token_stats(model, ids, attn, mask)["logp"]
    assert (tempered - sampler_lp)[m].abs().max() < 1e-4  # ρ = 1 to fp32 precision
    assert (raw - sampler_lp)[m].abs().mean() > 1e-2  # and not the T = 1 log-probs


def test_rollout_batch_aligns_rows_with_their_prompts():
    ro = S.Rollouts([[1, 2], [3]], [[5], [6, 7], [8, 9, 10], [11]], [[-.5], [-.6, -.7], [-.8, -.9, -1.0], [-1.1]],
                    ["a", "b", "c", "d"], [True] * 4)
    # row 1 is prompt 0's, row 2 prompt 1's
    ids, attn, mask, old = LP.rollout_batch(ro, [1, 2], pad_id=0)[:4]
    assert ids.tolist() == [[1, 2, 6, 7], [3, 8, 9, 10]] and attn.tolist() == [[1] * 4] * 2
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert torch.allclose(old, torch.tensor([[0, -.6, -.7], [-.8, -.9, -1.0]]))


def test_inverse_cdf_sampling_matches_the_distribution_and_the_filters():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, float("-inf")]]).repeat(100_000, 1)
    freq = torch.bincount(S._sample(logits, gen), minlength=5).float() / 100_000
    # 4 sigma at these counts
    assert (freq - logits[0].softmax(-1)).abs().max() < 0.006 and freq[4] == 0
    # top-k 2: only tokens 0 and 2
    kept = S._sample(S._filter_logits(logits[:1000], 1.0, 2, 1.0), gen)
    assert set(kept.tolist()) == {0, 2}


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(S._filter_logits(logits, 1.0, **kw)).tolist()[0]
    assert kept(top_k=2, top_p=1.0) == [True, True, False, False]
    assert kept(top_k=0, top_p=0.7) == [True, True, False, False]   # 0.5 < 0.7 <= 0.8
    assert kept(top_k=0, top_p=0.9) == [True, True, True, False]    # 0.8 < 0.9 <= 0.95
    assert kept(top_k=0, top_p=1.0) == [True] * 4


def test_checkpoint_round_trip(tiny, tmp_path):
    model, tok = tiny
    out = tmp_path / "ckpt"
    save_checkpoint(model, tok, str(out))
    assert not [p for p in os.listdir(out) if p.startswith(".tmp")]
    loaded, tok2 = M.load_model(str(out))
    ids = torch.tensor([tok(D.make_prompt([1, 2, 3], 6, "compact"))["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    assert tok2.get_vocab() == tok.get_vocab() and tok2.eos_token_id == tok.eos_token_id
    text = D.make_prompt([3, 17, 9], 21, "compact") + TR.make_trace([3, 7, 9], 21, dead_ends=2)
    # same pre-tokenizer after the round trip
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]


def test_clear_errors_for_bad_models_and_data(tmp_path, monkeypatch):
    with pytest.raises(C.CountdownError, match="no such checkpoint dir"):
        M.load_model(str(tmp_path / "missing"))
    with pytest.raises(C.CountdownError, match="not a checkpoint dir"):
        M.load_model(str(tmp_path))
    def offline(*a, **k):
        raise OSError("Name or service not known")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(D.socket, "create_connection", offline)  # as on this machine: no hub
    with pytest.raises(C.CountdownError, match="cannot reach huggingface.co .* --init tiny"):
        M.load_model("Qwen/Qwen2.5-0.5B")
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"nums": [1, 2], "target": 3}\n\n{"numbers": [1], "target": 1}\n')
    with pytest.raises(C.CountdownError, match=r"tasks.jsonl:3: missing field\(s\) \['nums'\]; the line has \['numbers', 'target'\]"):
        D.load_tasks(str(bad), "test")
    bad.write_text('{"nums": [1, 2], "target": 3}\n{"nums": [1, 2], "target": \n')
    with pytest.raises(C.CountdownError, match=r"tasks.jsonl:2: not valid JSON"):
        D.load_tasks(str(bad), "test")
    bad.write_text('{"nums": "1 2", "target": 3}\n')
    with pytest.raises(C.CountdownError, match="row 1: nums must be a list of ints"):
        D.load_tasks(str(bad), "test")
    with pytest.raises(C.CountdownError, match="bad --data"):
        D.load_tasks("gen:numbers=3", "test")
    with pytest.raises(C.CountdownError, match="--data gen"):
        D.load_tasks("nobody/no-such-dataset", "test")


def test_load_tasks_from_generator_and_jsonl(tmp_path):
    test = D.load_tasks("gen:nums=3,range=1-9,target=10-100,test=50,val=20", "test")
    train = D.load_tasks("gen:nums=3,range=1-9,target=10-100,test=50,val=20", "train", 200)
    assert len(test) == 50 and len(train) == 200
    assert not {(tuple(sorted(t["nums"])), t["target"]) for t in test} & {(tuple(sorted(t["nums"])), t["target"]) for t in train}
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in test))
    assert D.load_tasks(str(path), "test") == test


def test_a_kept_training_split_is_the_generators_own(tmp_path, monkeypatch):
    """load_tasks' file of generated splits (tasks.generated): every train size it serves is the
    generator's own; a size past the one it was made for is generated (unless that ran dry); a
    generator edited since is never served the old file; a broken file is generated over."""
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path))
    data, args = "gen:nums=3,range=1-5,test=10,val=5", (0, (3,), (1, 5), (10, 100))

    def own(n):
        return V.generate_splits({"test": 10, "val": 5, "train": n}, *args)["train"]
    assert D.load_tasks(data, "train", 20) == own(20)  # made for 20: no file yet
    assert [f.name.endswith(".json") for f in tmp_path.iterdir()] == [True]
    assert D.load_tasks(data, "train", 7) == own(7)  # a prefix of the file's
    assert D.generated({"test": 10, "val": 5, "train": 7}, *args) == V.generate_splits(
        {"test": 10, "val": 5, "train": 7}, *args)
    assert D.load_tasks(data, "train", 40) == own(40) and len(own(40)) == 40  # past it: generated
    assert len(own(10_000)) < 1_000  # this space runs dry: the file then serves any size
    assert D.load_tasks(data, "train", 10_000) == own(10_000) == D.load_tasks(data, "train", 5_000)
    assert D.load_tasks(data, "test") == V.generate_splits({"test": 10}, *args)["test"]
    (file,) = tmp_path.iterdir()
    file.write_text('{"train_asked": 10000, "splits": {"train": [')  # cut short: generated again
    assert D.load_tasks(data, "train", 30) == own(30)
    kept = D.load_tasks(data, "train", 30)

    def edited(sizes, seed=0, num_numbers=(3, 4), num_range=(1, 99), target_range=(10, 100)):
        """Another generator: its file is another one."""
        return {name: [{"nums": [1, 1, 1], "target": 10}] * n for name, n in sizes.items()}
    monkeypatch.setattr(V, "generate_splits", edited)
    assert D.load_tasks(data, "train", 30) == [{"nums": [1, 1, 1], "target": 10}] * 30 != kept


@dataclasses.dataclass
class _Args:
    output_dir: str = C.arg("out", "where")
    lr: float = C.arg(1e-5, "learning rate")
    steps: int = C.arg(3, "steps")
    gradient_checkpointing: bool = C.arg(False, "recompute activations")


def test_parse_args_dashes_underscores_and_bools():
    a = C.parse_args(_Args, ["--output-dir", "x", "--lr", "3e-4", "--steps", "7", "--gradient_checkpointing"])
    assert a == _Args("x", 3e-4, 7, True)
    assert C.parse_args(_Args, ["--no-gradient_checkpointing"]).gradient_checkpointing is False


def test_logger_writes_jsonl(tmp_path):
    log = L.Logger(str(tmp_path), total_steps=2, config=dataclasses.asdict(_Args()))
    log.log(1, {"train/loss": 0.5, "train/reward": torch.tensor(0.25)})
    log.close()
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows[0]["step"] == 1 and rows[0]["train/reward"] == 0.25
    assert json.load(open(tmp_path / "args.json"))["lr"] == 1e-5


def test_cli_errors_are_one_line(tmp_path):
    r = run_cli("evaluate.py", "--model", str(tmp_path / "nope"))  # in this process
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no such checkpoint dir" in r.stderr


@pytest.mark.parametrize("script", ["sft.py", "ipo.py", "rloo.py", "grpo.py", "evaluate.py"])
def test_every_script_has_help(script):
    r = run_cli(script, "--help")  # in this process: argparse prints it and exits 0
    assert r.returncode == 0 and "--output_dir" in r.stdout or "--out" in r.stdout
    assert "usage:" in r.stdout and "(default:" in r.stdout


def test_warmup_lr_ramps_linearly_then_holds_and_sets_every_group():
    opt = torch.optim.AdamW([{"params": [torch.zeros(1, requires_grad=True)]},
                             {"params": [torch.zeros(1, requires_grad=True)]}], lr=1.0)
    got = [L.warmup_lr(opt, 2e-4, step, 4) for step in range(1, 7)]
    assert got == pytest.approx([5e-5, 1e-4, 1.5e-4, 2e-4, 2e-4, 2e-4])
    assert [g["lr"] for g in opt.param_groups] == [2e-4, 2e-4]
    assert L.warmup_lr(opt, 3e-4, 1, 0) == 3e-4  # 0: constant from the first step (paper 000)


def test_gradient_checkpointing_keeps_less_for_backward_with_the_same_gradients(tiny_ckpt):
    """--gradient_checkpointing acts: load_policy leaves the model in train mode, where transformers
    checkpoints its layers (from_pretrained's eval mode silently turned the flag off). Measured by
    what autograd keeps for backward; the loss and every gradient stay the same."""
    from plumbing.harness import load_policy
    out = {}
    for flag in (False, True):
        model, tok, _ = load_policy(tiny_ckpt, flag)
        ids = torch.randint(0, len(tok), (4, 64), generator=torch.Generator().manual_seed(0))
        ones = torch.ones_like(ids)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = -LP.token_stats(model, ids, ones, ones)["logp"].mean()
        loss.backward()
        out[flag] = sum(kept), loss.item(), [p.grad for p in model.parameters()]
    assert out[True][0] < 0.5 * out[False][0], (out[True][0], out[False][0])
    assert out[True][1] == pytest.approx(out[False][1], abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out[True][2], out[False][2]))


def test_compile_runs_the_training_forward_compiled_with_the_same_loss_and_gradients(monkeypatch):
    """--compile: token_stats' decoder forward goes through torch.compile, one graph for two
    lengths (dynamic shapes), with the eager loss and gradients (fp32, 1e-5); the sampler, which
    runs the layers one by one, draws the same tokens. A 1-layer model keeps the compile short.
    It compiles on either CPU kind (harness.compile_pays says where it pays: tests/test_pipeline.py)."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(L, "compile_pays", lambda device: True)
    torch._dynamo.reset()
    counters.clear()
    out = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model, tok, _ = L.load_policy("tiny", compile=flag, hidden_size=32, num_hidden_layers=1)
        losses = []
        for T in (24, 37):
            ids = torch.randint(0, len(tok), (3, T), generator=torch.Generator().manual_seed(T))
            ones = torch.ones_like(ids)
            loss = -LP.token_stats(model, ids, ones, ones)["logp"].mean()
            loss.backward()
            losses.append(loss.item())
        tokens = S.HFSampler(model, tok).generate(["12 3 4"], n=2, max_new_tokens=8, seed=0)
        out[flag] = losses, [p.grad for p in model.parameters()], tokens.completion_ids
    assert counters["stats"]["unique_graphs"] == 1  # compiled, and not again for the new length
    assert out[True][0] == pytest.approx(out[False][0], abs=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out[True][1], out[False][1]))
    assert out[True][2] == out[False][2]


def lane_data(lane):
    """run_cpu.sh's --data: the default's (3 numbers) or NUMBERS=3to4's (the balanced 3/4 mix)."""
    import re
    import shlex
    script = open(os.path.join(ROOT, "run_cpu.sh")).read()
    line = r'^DATA="(.*)"' if lane == "" else r'^if \[\[ -n \$LANE \]\]; then DATA="(.*?)"'
    return shlex.split(re.search(line, script, re.M).group(1))[0]


@pytest.mark.parametrize("lane", ["", "-3to4"])
def test_the_shipped_base_is_run_cpu_sh_base_stage_output(lane):
    """pretrained/tiny-base is what `run_cpu.sh --rebuild-base` trains: its args.json holds stage 0's
    flags as the script writes them today, on the model and tokenizer `--init tiny` builds. So copying
    it (the default, like downloading a pretrained model) changes the time, not the recipe. Likewise
    the 3to4 lane's (NUMBERS=3to4) pretrained/tiny-base-3to4, on the lane's data."""
    import re
    base = os.path.join(ROOT, "pretrained", "tiny-base" + lane)
    args = json.load(open(os.path.join(base, "args.json")))
    script = open(os.path.join(ROOT, "run_cpu.sh")).read()
    command = script[script.index("stage base python sft.py"):].split("elif")[0]
    flags = dict(re.findall(r"--(\w+) ([\w.-]+)", command))
    assert args["init"] == "tiny" and args["data"] == "arith:" + lane_data(lane)[4:] and len(flags) >= 7
    assert all(float(args[k]) == float(v) for k, v in flags.items() if k not in ("init", "output_dir")), flags
    model, tok = M.load_model(base)
    assert tok.get_vocab() == M.build_tiny_tokenizer().get_vocab()
    assert all(getattr(model.config, k) == v for k, v in M.TINY.items())


@pytest.mark.parametrize("lane", ["", "-3to4"])
def test_the_shipped_teacher_is_run_cpu_sh_teacher_command_output(lane):
    """pretrained/tiny-teacher is what `run_cpu.sh --rebuild-teacher` trains: its args.json holds the
    teacher command's flags and the SFT=(...) array's as the script writes them today (the
    teacher's own win), trained from the shipped base, with the base's tokenizer; likewise the 3to4
    lane's pretrained/tiny-teacher-3to4, on the lane's data."""
    import re
    teacher = os.path.join(ROOT, "pretrained", "tiny-teacher" + lane)
    args = json.load(open(os.path.join(teacher, "args.json")))
    script = open(os.path.join(ROOT, "run_cpu.sh")).read()
    values = lambda text: dict(re.findall(r"--(\w+) (?!-)([\w.:,-]+)", text))  # noqa: E731
    flags = values(re.search(r"^SFT=\((.*?)\)", script, re.S | re.M).group(1))
    flags.update(values(re.search(r"^TRACES=\((.*?)\)", script, re.S | re.M).group(1)))
    command = script[script.index("stage teacher python sft.py"):].split("--output_dir")[0]
    flags.update(values(command))
    assert "--verified" in command and args["verified"] and flags["max_steps"] == "2000"
    for k, v in flags.items():
        if k in ("init", "output_dir", "data", "eval_data"):
            continue
        assert str(args[k]) == v or float(args[k]) == float(v), (k, args[k], v)
    assert args["data"] == lane_data(lane) and args["eval_max_new_tokens"] == (256 if lane else 160)
    _, tok = M.load_model(teacher)
    assert tok.get_vocab() == M.build_tiny_tokenizer().get_vocab()
