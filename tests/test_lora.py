"""LoRA through peft (--lora_rank): only the adapters train, log-probs go through the adapted
decoder, and a checkpoint is saved merged, an ordinary HF checkpoint for the next script's --init."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import GEN, ROOT

from plumbing import checkpoints
from plumbing import harness
from plumbing import models as M
from common import token_stats, tokenize_pairs
import common as LP


def logp_of(model, tok):
    ids, attn, mask = tokenize_pairs(tok, ["User: 1 2 3\nAssistant: <think>"], [" 1 + 2 = 3"])
    with torch.no_grad():
        return token_stats(model, ids, attn, mask)["logp"]


def test_lora_trains_only_adapters_and_saves_merged(tmp_path, tiny_ckpt):
    base, tok = M.load_model(tiny_ckpt)
    model, _, _ = harness.load_policy(tiny_ckpt, False, lora_rank=4)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n_lora < 0.2 * sum(p.numel() for p in base.parameters())
    assert torch.allclose(logp_of(model, tok), logp_of(base, tok), atol=1e-6)  # B = 0 at init: no change
    for n, p in model.named_parameters():  # a trained adapter: B != 0
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    adapted = logp_of(model, tok)
    assert not torch.allclose(adapted, logp_of(base, tok), atol=1e-4)
    checkpoints.save_checkpoint(model, tok, str(tmp_path))
    assert not [f for f in os.listdir(tmp_path) if "adapter" in f]               # no peft files: merged
    merged, _ = M.load_model(str(tmp_path))
    assert torch.allclose(logp_of(merged, tok), adapted, atol=1e-5)             # W + BA, as trained
    assert any("lora_" in n for n, _ in model.named_parameters())               # the trainer keeps its adapters


@pytest.mark.parametrize("script,extra", [
    ("grpo.py", ["--group_size", "3", "--max_response_len", "12", "--max_steps", "2", "--beta", "0.04"]),
    ("sft.py", ["--max_steps", "2"]),
])
def test_scripts_run_with_lora_and_write_a_plain_checkpoint(tmp_path, tiny_ckpt, script, extra):
    out = tmp_path / "run"
    cmd = [sys.executable, script, "--init", tiny_ckpt, "--data", GEN, "--eval_data", GEN, "--template", "compact",
           "--eval_problems", "2", "--eval_samples", "2", "--eval_max_new_tokens", "8", "--batch_size", "2",
           "--micro_batch", "2", "--lr", "1e-3", "--lora_rank", "4", "--output_dir", str(out), *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    model, _ = M.load_model(str(out))                                            # an ordinary checkpoint
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_unknown_lora_target_is_one_line(tmp_path, tiny_ckpt):
    r = subprocess.run([sys.executable, "rloo.py", "--init", tiny_ckpt, "--data", GEN, "--eval_data", GEN,
                        "--lora_rank", "4", "--lora_targets", "no_such_proj", "--output_dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: --lora_targets no_such_proj")
    assert "Traceback" not in r.stderr


def trained_lora(tiny_ckpt, seed=0):
    model, tok, _ = harness.load_policy(tiny_ckpt, False, lora_rank=4)
    torch.manual_seed(seed)
    for n, p in model.named_parameters():  # a trained adapter: B != 0
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    return model, tok


def test_a_lora_checkpoint_is_merged_without_copying_the_model(tmp_path, tiny_ckpt, monkeypatch):
    """save_checkpoint merges W + BA a layer at a time (checkpoints.plain_weights): the deep copy that
    merge_and_unload needed held a second 7B model. The same file, and the trainer keeps its adapters."""
    import copy
    model, tok = trained_lora(tiny_ckpt)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real = copy.deepcopy  # a config's copy is fine; the model's is the 7B-sized one
    monkeypatch.setattr(copy, "deepcopy", lambda x, *a: pytest.fail("deep copy of the model")
                        if isinstance(x, torch.nn.Module) else real(x, *a))
    checkpoints.save_checkpoint(model, tok, str(tmp_path))
    merged, _ = M.load_model(str(tmp_path))
    assert merged.state_dict().keys() == want.keys()
    assert all(torch.equal(merged.state_dict()[k], want[k]) for k in want)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


def test_a_lora_state_keeps_the_adapters_not_the_base(tmp_path, tiny_ckpt):
    """A resumable state of a LoRA run holds the adapters (and the optimizer), not the frozen base
    at every save; --resume loads them back into a fresh --init."""
    model, tok = trained_lora(tiny_ckpt)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    checkpoints.save_state(str(tmp_path), 1, model, opt)
    saved = torch.load(tmp_path / "state" / "step_0000001" / "state.pt", weights_only=False)["model"]
    assert saved and all("lora_" in k for k in saved)
    fresh, _ = trained_lora(tiny_ckpt, seed=1)
    checkpoints.load_state(str(tmp_path), fresh, opt)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_on_a_gpu_the_lora_base_is_bf16_and_the_adapters_fp32(tiny_ckpt, monkeypatch):
    """A frozen 7B base in fp32 is 30 GB: on a GPU load_policy holds it in bf16 (models.frozen_dtype),
    while the adapters, the only weights the optimizer steps, stay fp32. Forced here on CPU, under
    the bf16 autocast a GPU trainer always runs."""
    monkeypatch.setattr(harness, "frozen_dtype", lambda device: torch.bfloat16)
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "1")
    model, tok, device = harness.load_policy(tiny_ckpt, False, lora_rank=4)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    ids, attn, mask = tokenize_pairs(tok, ["User: 1 2 3\nAssistant: <think>"], [" 1 + 2 = 3"])
    with LP.autocast(device, model):
        (-token_stats(model, ids, attn, mask)["logp"].sum()).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    unloaded, _, _ = harness.load_policy(tiny_ckpt, False)  # full fine-tuning: fp32 master weights
    assert {p.dtype for p in unloaded.parameters()} == {torch.float32}
