import json
import math
import os
import re
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import GEN, ROOT, gap_bound, run_cli
from test_graded import (check_aggregate, check_grpo_advantages, check_grpo_loss, check_importance_weights,
                         check_rloo_advantages, check_rloo_loss)

from plumbing import tasks as D
import grpo
from plumbing import models as M
import opd
import rloo
import common as S
from plumbing import traces as TR

FAST = ["--term_grads", "--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "4", "--eval_samples", "2",
        "--eval_max_new_tokens", "8", "--batch_size", "2", "--group_size", "3", "--micro_batch", "4",
        "--max_response_len", "12", "--max_steps", "2", "--lr", "1e-3"]


def test_rloo_advantages_leave_one_out_by_hand():
    check_rloo_advantages(rloo.rloo_advantages)  # the graded exercise's check (tests/test_graded.py)


@pytest.mark.parametrize("module", ["rloo", "opd"])
def test_w_reinforce_scales_only_positive_advantages_by_hand(module):
    """W-REINFORCE (Zhu et al., 2025): positive advantages x λ, negative ones kept; λ = 1 is Eq. 3."""
    adv_fn = (rloo if module == "rloo" else opd).rloo_advantages
    reward = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv = adv_fn(reward, 0.1)
    assert torch.allclose(adv[0], torch.tensor([0.1, -1 / 3, -1 / 3, -1 / 3]))
    assert torch.allclose(adv[1], torch.tensor([0.1 * 2 / 3, 0.1 * 2 / 3, -2 / 3, -2 / 3]))
    assert torch.equal(adv_fn(reward, 1.0), adv_fn(reward)) and torch.equal(adv_fn(reward, 0.0)[adv > 0], torch.zeros(3))


def test_grpo_advantages_group_normalized_by_hand():
    check_grpo_advantages(grpo.grpo_advantages)


def test_importance_weights_are_clipped_and_detached():
    check_importance_weights(rloo.importance_weights)


@pytest.mark.parametrize("k3", [S.k3_kl])
def test_k3_kl_nonnegative_zero_at_match_and_unbiased(k3):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=g), torch.randn(50, generator=g)
    assert (k3(a, b) >= 0).all() and torch.equal(k3(a, a), torch.zeros(50))
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)  # tokens sampled from π_θ = p
    est = k3(p.log()[x], q.log()[x]).mean()
    assert abs(est - (p * (p / q).log()).sum()) < 0.01  # E_p[k3] = KL(p ‖ q)


def test_ppo_clip_by_hand():
    """The clip by hand, clip-higher, the clipped token's zero gradient and the β-weighted KL term."""
    check_grpo_loss(grpo.grpo_loss)


def test_loss_aggregation_modes_by_hand_and_over_micro_batches():
    check_aggregate(grpo.aggregate)


def test_rloo_loss_by_hand():
    check_rloo_loss(rloo.rloo_loss)  # both kl_ratio settings


def test_rloo_logs_the_importance_weight_before_its_clip():
    """Paper 000 (App. B) watches the IS-weight mean reach ~12.4 under a clip of 10: only the raw w
    can."""
    args = SimpleNamespace(is_clip=10.0, entropy_coef=0.0, kl_coef=0.0, kl_ratio=True)
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    old = logp - torch.tensor([[5.0, 0.0], [0.0, 0.0]])  # row 0: π/μ = e^5 ≈ 148
    _, parts = rloo.rloo_loss(logp, old, torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([1.0, -1.0]), **vars(args))
    assert parts["is_weight"].tolist() == [10.0, 1.0]
    assert torch.allclose(parts["is_weight_raw"], torch.tensor([math.exp(5), 1.0]))


def exact_kl_grads(logits, other_logp):
    """∇ KL(π ‖ other) and ∇ KL(other ‖ π) with respect to the logits of a categorical π, by
    autograd of the exact sums over the vocabulary."""
    grads = []
    for forward in (False, True):
        z = logits.detach().clone().requires_grad_(True)
        p = z.log_softmax(-1)
        kl = (other_logp.exp() * (other_logp - p)).sum() if forward else (p.exp() * (p - other_logp)).sum()
        kl.backward()
        grads.append(z.grad)
    return grads  # reverse, forward


@pytest.mark.parametrize("module", [S])
def test_k3_gradients_are_the_kl_their_docstrings_name(module):
    """On an exact categorical (every token weighted by the probability that it is drawn): plain
    k3's expected gradient is KL(other ‖ π_θ)'s, and k3 times π_θ/μ has KL(π_θ ‖ other)'s, for
    tokens drawn from μ = π_θ (GRPO's first pass) and from a lagging μ (rloo's snapshot) alike."""
    torch.manual_seed(0)
    z = torch.randn(7, dtype=torch.float64)                                      # π_θ = softmax(z)
    ref = torch.randn(7, dtype=torch.float64).log_softmax(-1)
    reverse, forward = exact_kl_grads(z, ref)

    # Σ_y μ(y) ∇ loss(y): the gradient a batch of μ's tokens averages to
    def expected_grad(ratio, mu):
        zz = z.clone().requires_grad_(True)
        # (V,) each entry "sampled"
        per_token = module.k3_kl(zz.log_softmax(-1), ref, mu if ratio else None)
        (mu.exp() * per_token).sum().backward()
        return zz.grad

    on_policy = z.log_softmax(-1)
    assert torch.allclose(expected_grad(False, on_policy), forward)              # DeepSeekMath's k3
    assert torch.allclose(expected_grad(True, on_policy), reverse)  # --kl_ratio (default)
    assert not torch.allclose(forward, reverse, atol=1e-3)  # the two really differ here
    lagging = torch.randn(7, dtype=torch.float64).log_softmax(-1)
    assert torch.allclose(expected_grad(True, lagging), reverse)  # exact for any sampler
    assert not torch.allclose(expected_grad(False, lagging), forward, atol=1e-3)
    # plain k3: neither KL
    assert not torch.allclose(expected_grad(False, lagging), reverse, atol=1e-3)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
@pytest.mark.parametrize("module,ratio", [(rloo, "is_weight_raw"), (grpo, "ratio")])
def test_ratio_is_one_on_the_first_pass_at_any_temperature(module, ratio, temperature, tiny_ckpt, tmp_path,
                                                           monkeypatch):
    """Sampler and trainer both score logits / T, so nothing is off-policy before the first update."""
    # fp32 training forwards: agreement to float precision
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")
    module.main(["--init", tiny_ckpt, *FAST, "--temperature", str(temperature), "--output_dir", str(tmp_path)])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")][1:]
    for row in rows:
        assert abs(row[f"train/{ratio}"] - 1) < 1e-4 and abs(row[f"train/{ratio}_max"] - 1) < 1e-3, row
        assert row["train/sampler_gap"] < 1e-5, row


def test_score_rollouts_sparse_dense_and_wrong_reward():
    texts = ["<answer>1 + 2</answer>", "<answer>1 - 2</answer>", "no answer", "<answer>3 * 3</answer>"]
    ro = S.Rollouts([[1], [2]], [[0]] * 4, [[0.0]] * 4, texts, [True] * 4)
    tasks = [{"nums": [1, 2], "target": 3}, {"nums": [3, 3], "target": 10}]
    exact, reward = S.score_rollouts(ro, tasks, "sparse")
    assert torch.allclose(exact, torch.tensor([1.0, 0.1, 0.0, 0.1])) and torch.equal(reward, exact.view(2, 2))
    exact, reward = S.score_rollouts(ro, tasks, "dense")  # 9 vs 10: 0.1 + 0.5 · 0.9
    assert torch.allclose(exact, torch.tensor([1.0, 0.1, 0.0, 0.1]))
    assert torch.allclose(reward, torch.tensor([[1.0, 0.1], [0.0, 0.55]]))
    for wrong in (0.0, -0.5):  # a wrong answer earns as much as none, or less
        exact, reward = S.score_rollouts(ro, tasks, "sparse", wrong)
        assert torch.allclose(exact, torch.tensor([1.0, 0.1, 0.0, 0.1]))
        assert torch.equal(reward, torch.tensor([[1.0, wrong], [0.0, wrong]]))
    # a search cut short (no answer) costs what a wrong answer does: only solving pays
    exact, reward = S.score_rollouts(ro, tasks, "sparse", -0.5, -0.5)
    assert torch.equal(reward, torch.tensor([[1.0, -0.5], [-0.5, -0.5]]))
    exact, reward = S.score_rollouts(ro, tasks, "dense", -0.5, -0.5)  # dense keeps its own scale
    assert torch.allclose(reward, torch.tensor([[1.0, 0.1], [0.0, 0.55]]))


@pytest.mark.parametrize("bf16", ["0", "1"])
@pytest.mark.parametrize("script", ["rloo.py", "grpo.py"])
def test_two_steps_in_a_subprocess(script, bf16, tiny_ckpt, tmp_path):
    """The command line end to end on both training paths: fp32, and bf16 autocast forced on (this
    CPU may lack AVX512-BF16: slower, but the same code). The learning signal itself is checked in
    tests/test_rl_signal.py, with a reward that is not always 0."""
    extra = ["--num_iterations", "2"] if script == "grpo.py" else []
    r = subprocess.run([sys.executable, script, "--init", tiny_ckpt, *FAST, *extra, "--reward", "dense",
                        "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "COUNTDOWN_CPU_BF16": bf16})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/pass@1" in rows[0] and "eval/pass@2" in rows[-1]
    assert "eval/strategy/backward" in rows[0]
    keys = {"train/loss", "train/reward", "train/accuracy", "train/reward_std", "train/adv_std", "train/zero_adv_groups",
            "train/resp_len", "train/no_answer", "train/cut", "train/entropy", "train/kl", "train/sampler_gap",
            "train/grad_norm", "time/sample", "time/update", "grad/pg", "grad/kl",
            "train/strategy/random", "train/strategy/backward",  # shares of the rollouts (plumbing/traces.py)
            *(f"train/mistake/{k}" for k in TR.MISTAKES)}  # and of each mistake kind
    keys |= {"train/ratio", "train/ratio_max"} if script == "grpo.py" else \
        {"train/is_weight", "train/is_weight_raw", "train/is_weight_raw_max", "grad/entropy"}
    assert keys <= set(rows[-1]) and all(math.isfinite(v) for v in rows[-1].values())
    assert "grad/pg" in rows[1]  # the first step and every evaluating one measure the terms
    # the HF sampler is the policy: its log-probs must agree, to the trainer's precision
    assert rows[-1]["train/sampler_gap"] < gap_bound(bf16 == "1")
    assert json.load(open(tmp_path / "args.json"))["train_compute"] == ("bf16" if bf16 == "1" else "fp32")
    assert {"config.json", "model.safetensors", "tokenizer.json", "args.json"} <= set(os.listdir(tmp_path))


@pytest.mark.parametrize("module", [rloo, grpo])
def test_fixed_seed_is_deterministic_on_cpu(module, tiny_ckpt, tmp_path):
    runs = []
    for i in range(2):
        out = module.main(["--init", tiny_ckpt, *FAST, "--output_dir", str(tmp_path / str(i))])
        model = out[0] if isinstance(out, tuple) else out
        rows = [{k: v for k, v in json.loads(x).items() if not k.startswith("time/") and k != "wall"}
                for x in open(tmp_path / str(i) / "metrics.jsonl")]
        runs.append((rows, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.parametrize("module", [rloo, grpo, opd])
def test_a_step_is_the_same_in_any_micro_batches(module, tiny_ckpt, tmp_path, monkeypatch):
    """run_cpu.sh sizes --micro_batch and --forward_rows for speed, which is free only if each
    micro-batch adds its share of the step's loss, divided by the whole step's counts: one step in
    micro-batches of 1 and of all 6 rollouts (shared: one group, two) logs one loss and gradient,
    with each prompt's forward shared by its rollouts (a CPU's default) or every row whole.
    Rewards 0, 1, 0, ... (a random model earns none), so that every term pulls. Broken on purpose
    (the prompts' cache detached in decoder_states: their share of the gradient lost), the shared
    steps' grad_norm moved, and this failed for each script."""
    def alternating(*args, **kwargs):
        scores, reward = S.score_rollouts(*args, **kwargs)
        return scores, torch.arange(reward.numel()).remainder(2).float().view_as(reward)
    monkeypatch.setattr(module, "score_rollouts", alternating)
    flags = dict(zip(FAST[1::2], FAST[2::2]), **{"--max_steps": "1"})
    teacher = ["--teacher", tiny_ckpt] if module is opd else []
    rows = []
    for size, forward in (("1", "per_row"), ("6", "per_row"), ("1", "shared"), ("6", "shared")):
        flags["--micro_batch"], flags["--prompt_forward"] = size, forward
        module.main(["--init", tiny_ckpt, *teacher, *(x for kv in flags.items() for x in kv),
                     "--output_dir", str(tmp_path / (size + forward))])
        rows.append(json.loads(open(tmp_path / (size + forward) / "metrics.jsonl").readlines()[-1]))
    assert rows[0]["train/grad_norm"] > 0
    for a, b in (rows[:2], rows[2:]):  # the same forward in other micro-batches: fp32 sums, other orders
        for key in ("train/loss", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=2e-4, abs=1e-6), key
    # the two forwards: in bf16 they round apart (the loss, a sum of terms cancelling to ~0.1, by more)
    rel = 1e-2 if M.trains_in_bf16("cpu") else 2e-4
    assert rows[2]["train/grad_norm"] == pytest.approx(rows[0]["train/grad_norm"], rel=rel)


def random_rollouts(gen, prompt_lens, completion_lens):
    """Rollouts of random tokens: len(completion_lens) // len(prompt_lens) a prompt."""
    prompts = [torch.randint(5, 300, (n,), generator=gen).tolist() for n in prompt_lens]
    completions = [torch.randint(5, 300, (n,), generator=gen).tolist() for n in completion_lens]
    return S.Rollouts(prompts, completions, [[0.0] * len(c) for c in completions],
                      [""] * len(completions), [True] * len(completions))


def shared_or_per_row(model, samples, shared, size, teacher=None, terms=lambda s: s["logp"]):
    """Each row's masked log-probs, entropy and KL to `teacher` (row -> (3, n)), and the weights'
    gradient of terms(stats) summed over the rows, one backward per micro-batch as the scripts do."""
    model.zero_grad()
    values = {}
    for rows, ids, attn, mask, _, prompts in S.micro_batches(samples, size, 1, "cpu", shared):
        assert (prompts is not None) == shared
        stats = S.token_stats(model, ids, attn, mask, 0.7, entropy=True, teacher=teacher, prompts=prompts)
        (terms(stats) * mask[:, 1:]).sum().backward()
        for i, r in enumerate(rows):
            values[r] = torch.stack([stats[k][i][mask[i, 1:].bool()] for k in ("logp", "entropy", "kl")]).detach()
    return values, [p.grad.clone() for p in model.parameters() if p.requires_grad]


def tiny_llama(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def tiny_lora(tiny_ckpt):
    from peft import LoraConfig, get_peft_model
    model, _ = M.load_model(tiny_ckpt)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # B = 0 at init: a LoRA that does something
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("arch", ["qwen2", "llama", "lora"])
def test_the_shared_prompt_forward_is_the_per_row_forward(arch, tiny_ckpt):
    """common.decoder_states, the RL updates' forward on a CPU (each prompt once for its group, its
    keys and values the cache its rows continue from), against the same model's forward of every row
    whole, in fp32: each rollout's log-probs, entropy and KL to a teacher (OPD's, whose prompts are
    shared too), and the weights' gradient from the one backward a micro-batch, the prompts' share
    included: no second backward anywhere. Qwen2, Llama and a LoRA-wrapped Qwen2; prompts of 4-12
    tokens, rollouts of 1-9, micro-batches of one group and of two. Broken on purpose, each failed:
    the rollouts' positions one further on, the prompts' left padding attended to, the cache detached
    before it is expanded (the prompts' share of the gradient lost), the rows' prompts one group off."""
    _, tok = M.load_model(tiny_ckpt)
    model = {"qwen2": lambda: M.load_model(tiny_ckpt)[0], "llama": lambda: tiny_llama(len(tok)),
             "lora": lambda: tiny_lora(tiny_ckpt)}[arch]()
    teacher, _ = M.load_model(tiny_ckpt)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # another model, so that the KL is not 0
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    samples = random_rollouts(gen, (7, 12, 4), (5, 1, 9, 3, 8, 2, 6, 4, 7))
    terms = lambda s: s["logp"] + 0.3 * s["entropy"] + s["kl"]  # noqa: E731
    per_row, g_per_row = shared_or_per_row(model, samples, False, 4, teacher, terms)
    for size in (3, 6):  # a group, two groups
        shared, g_shared = shared_or_per_row(model, samples, True, size, teacher, terms)
        for r in per_row:
            assert torch.allclose(per_row[r], shared[r], atol=2e-5), (r, (per_row[r] - shared[r]).abs().max())
        assert sum(v[2].sum() for v in shared.values()) > 0.1
        assert sum(g.abs().sum() for g in g_per_row) > 0
        for a, b in zip(g_per_row, g_shared):  # fp32 sums in other orders
            assert (a - b).norm() <= 1e-4 * a.norm() + 1e-7, ((a - b).norm(), a.norm())


def test_micro_batches_of_whole_groups_keep_their_rows_aligned():
    """Shared: every micro-batch holds whole groups (at least one), each row's prompt is its group's,
    the inputs are the prompt's last token then the completion, the mask the completion, and the
    sampler's log-probs sit where token_stats puts the trainer's. Broken on purpose (a group split
    over two micro-batches, the last prompt token left out), it failed."""
    gen = torch.Generator().manual_seed(4)
    samples = random_rollouts(gen, (5, 3, 8), (4, 2, 7, 1, 3, 6))
    samples.logprobs = [[-(r + 1) - 0.01 * t for t in range(len(c))] for r, c in enumerate(samples.completion_ids)]
    seen = []
    for rows, ids, attn, mask, lp, prompts in S.micro_batches(samples, 3, 1, "cpu", True):
        assert len(rows) == 2 and rows[0] // 2 == rows[1] // 2  # one whole group of 2
        seen += rows
        for i, r in enumerate(rows):
            p, c = samples.prompt_ids[r // 2], samples.completion_ids[r]
            g = prompts.group[i]
            assert prompts.ids[g][prompts.attention_mask[g].bool()].tolist() == p[:-1]
            assert ids[i, :len(c) + 1].tolist() == [p[-1]] + c
            assert mask[i].tolist() == [0] + [1] * len(c) + [0] * (ids.shape[1] - len(c) - 1)
            assert lp[i][mask[i, 1:].bool()].tolist() == pytest.approx(samples.logprobs[r])
    assert sorted(seen) == list(range(6))


@pytest.mark.parametrize("module", [rloo, grpo])
def test_per_term_backwards_only_when_asked(module, tiny_ckpt, tmp_path):
    """Each loss term's own backward keeps the graph for it: on one H100 that made an RLOO step of
    the walkthrough peak at 60.4 GB against 26.85 and OPD and GRPO run out of memory (docs/gpu.md). So
    grad/<term> is measured only with --term_grads; the same run without it logs none."""
    module.main(["--init", tiny_ckpt, *FAST[1:], "--max_steps", "1", "--output_dir", str(tmp_path)])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows[-1]["step"] == 1 and not any(k.startswith("grad/") for r in rows for k in r)


def test_grpo_reference_stays_frozen_and_syncs_when_asked(tiny_ckpt, tmp_path, monkeypatch):
    """No weight decay and a scripted reward that is not always 0: only a live GRPO gradient moves the
    policy, and it must, while π_ref stays the init; a sync with mix 1 makes π_ref a copy."""
    from test_rl_signal import ONE_STEP, fake_score_rollouts
    monkeypatch.setattr(grpo, "score_rollouts", fake_score_rollouts)
    init, _ = M.load_model(tiny_ckpt)
    model, ref = grpo.main(["--init", tiny_ckpt, *ONE_STEP, "--beta", "0.04", "--output_dir", str(tmp_path / "a")])
    assert all(torch.equal(p0, p) for p0, p in zip(init.parameters(), ref.parameters()))
    assert any(not torch.equal(p0, p) for p0, p in zip(init.parameters(), model.parameters()))
    model, ref = grpo.main(["--init", tiny_ckpt, *ONE_STEP, "--beta", "0.04", "--ref_sync_every", "1",
                            "--ref_sync_mix", "1.0", "--output_dir", str(tmp_path / "b")])
    # mix 1: a copy
    assert all(torch.equal(p_ref, p) for p_ref, p in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize("script,flag,value,message", [
    ("rloo.py", "--reward", "exact", "--reward must be sparse or dense"),
    ("grpo.py", "--loss_agg", "sum", "--loss_agg must be seq-mean, token-mean or constant"),
    ("grpo.py", "--group_size", "1", "--group_size must be at least 2"),
    ("rloo.py", "--backend", "sglang", "--backend must be hf or vllm"),
])
def test_bad_flags_are_one_line_errors(script, flag, value, message, tiny_ckpt, tmp_path):
    r = run_cli(script, "--init", tiny_ckpt, *FAST, flag, value, "--output_dir", str(tmp_path))  # in this process
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """A half-trained SFT model on 3 numbers in 1-20 (600 steps, about 5 minutes on 2 cores; the
    pipeline's is 1,200). At 300 steps it solves almost nothing, which leaves RL no signal."""
    import sft
    out = tmp_path_factory.mktemp("sft")
    sft.main(["--init", "tiny", "--data", "gen:nums=3,range=1-20,test=200,val=100", "--eval_data", GEN, "--template", "compact",
              "--dead_ends", "1", "--lr", "2e-3", "--batch_size", "64", "--micro_batch", "64", "--max_steps", "600",
              "--eval_every", "0", "--eval_problems", "2", "--eval_samples", "1", "--eval_max_new_tokens", "8",
              "--output_dir", str(out)])
    return str(out)


@pytest.mark.slow
@pytest.mark.parametrize("module", [rloo, grpo])
def test_rl_learns_a_fixed_problem_set(module, sft_model, tmp_path):
    """The learning check, with the RL flags run_cpu.sh gives its rloo and grpo stages (its RL=(...)
    array: lr, steps, temperature, batch geometry, budget, rewards; rloo adds PG=(...),
    grpo β 0.04): on 32 problems seen every step, training accuracy must climb. New problems every
    step do not move it as much on the tiny model: docs/studies/arithmetic.md."""
    tasks = D.load_tasks("gen:nums=3,range=1-20,test=200,val=100", "train", 32)
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"nums": t["nums"], "target": t["target"]}) + "\n" for t in tasks))
    script = open(os.path.join(ROOT, "run_cpu.sh")).read()
    flags = {name: shlex.split(re.search(rf"^{name}=\((.*?)\)", script, re.S | re.M).group(1))
             for name in ("RL", "PG")}
    assert {"--lr", "--max_steps", "--wrong_reward", "--no_answer_reward"} <= set(flags["RL"]) and "--pg_norm" in flags["PG"]
    pipeline = flags["RL"] + (["--beta", "0.04"] if module is grpo else flags["PG"])
    module.main(["--init", sft_model, *pipeline, "--data", str(data), "--eval_data", GEN, "--template", "compact",
                 "--eval_problems", "4", "--eval_samples", "2", "--eval_max_new_tokens", "8",
                 "--eval_every", "0", "--max_steps", "50",  # 50 of the pipeline's 100: the climb shows by then
                 "--output_dir", str(tmp_path / "rl")])
    acc = [r["train/accuracy"] for r in map(json.loads, open(tmp_path / "rl" / "metrics.jsonl")) if r["step"] > 0]
    first, last = sum(acc[:4]) / 4, sum(acc[-4:]) / 4
    print(f"{module.__name__}: training accuracy {first:.2f} in its first 4 steps, {last:.2f} in its last 4")  # -rP shows it
    assert last > first + 0.05, acc


def test_the_bf16_shared_forward_is_as_close_to_fp32_as_the_per_row_one(tiny_ckpt, monkeypatch):
    """Under bf16 autocast (a CPU with native bf16) the shared forward runs transformers' own eager
    attention over the prompts' cache: its log-probs and gradient must stay as near the fp32 forward's
    as the per-row bf16 forward's are (the same kernels, other shapes). Broken on purpose, it failed:
    the padding's mask cast to bf16 as it is (fp32's min rounds to -inf: a padded prompt's NaN)."""
    model, _ = M.load_model(tiny_ckpt)
    samples = random_rollouts(torch.Generator().manual_seed(2), (9, 12), (60, 41, 55, 30, 64, 48))

    def step(bf16, shared):
        monkeypatch.setenv("COUNTDOWN_CPU_BF16", bf16)
        with S.autocast("cpu", model):
            values, grads = shared_or_per_row(model, samples, shared, 6)  # both groups: one prompt padded
        return torch.cat([values[r][0] for r in sorted(values)]), torch.cat([g.flatten() for g in grads])
    logp32, g32 = step("0", False)
    (logp_hf, g_hf), (logp_shared, g_shared) = step("1", False), step("1", True)
    err_hf, err_shared = (g_hf - g32).norm() / g32.norm(), (g_shared - g32).norm() / g32.norm()
    assert 0 < err_shared < 1.25 * err_hf, (err_shared, err_hf)
    assert (logp_shared - logp32).abs().mean() < 1.25 * (logp_hf - logp32).abs().mean()
