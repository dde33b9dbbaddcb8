"""What the real pipeline (Qwen2.5, a bf16 vLLM engine, one 80 GB GPU) needs of the code, checked
on CPU: the engine's sleep and wake order and its seeds (a fake `vllm` that records its calls),
π_old and μ under a sampler whose log-probs are off on purpose, the order of checkpoint and
evaluation, one EOS for teacher and student, frozen models in bf16 on a GPU, and an install that
carries every module the scripts import."""
import ast
import copy
import json
import os
import shutil
import subprocess
import sys
import types
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import GEN, ROOT

from plumbing import checkpoints
from plumbing import flags as C
import grpo
from plumbing import harness as L
from plumbing import models as M
import opd
import rloo
import common as S

FAST = ["--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "2", "--eval_samples", "2",
        "--eval_max_new_tokens", "4", "--batch_size", "2", "--group_size", "3", "--micro_batch", "6",
        "--max_response_len", "12", "--max_steps", "1", "--lr", "1e-3"]


# ---- the vLLM engine's memory dance and seeds, against a fake vllm that records its calls ---------
class FakeLLM:
    """Records what VLLMSampler asks of vLLM's LLM; generate answers EOS at once."""
    log, weights = None, None

    def __init__(self, **kwargs):
        self.eos = None

    def sleep(self, level=1):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tags))

    def collective_rpc(self, name, kwargs=None):
        FakeLLM.weights = dict(kwargs["weights_iterator"])  # consumed as vLLM's reload does
        self.log.append(name)

    def reset_prefix_cache(self):
        self.log.append("reset_prefix_cache")

    def generate(self, prompts, params, use_tqdm=False):
        self.log.append(("generate", [p.seed for p in params]))
        done = SimpleNamespace(token_ids=[self.eos], logprobs=[{self.eos: SimpleNamespace(logprob=-0.1)}],
                               finish_reason="stop")
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[done] * sp.n)
                for p, sp in zip(prompts, params)]


@pytest.fixture
def fake_engine(monkeypatch, tiny_ckpt):
    """(engine, its call log, trainer model, tokenizer): VLLMSampler on a fake vllm, sleep mode on as
    on a GPU, torch.cuda.empty_cache recorded in the same log."""
    log = []
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = FakeLLM, lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(FakeLLM, "log", log)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    model, tok = M.load_model(tiny_ckpt)
    engine = S.VLLMSampler(tiny_ckpt, tok, seed=3, sleep_mode=True)
    engine.llm.eos = tok.eos_token_id
    return engine, log, model, tok


def test_vllm_sleeps_at_level_2_and_wakes_weights_then_sync_then_kv_cache(fake_engine):
    """Level 2 (nothing copied to the host only to be overwritten), and TRL's colocate order: the
    caching allocator emptied before each wake, the weights mapped, written by the sync, and only
    then the KV cache. RL rollouts carry no per-request seed (the engine's, seeded once)."""
    engine, log, model, tok = fake_engine
    engine.sleep()
    tasks = [{"nums": [1, 2, 3], "target": 6}, {"nums": [4, 5, 6], "target": 15}]
    ro = S.rollouts(engine, model, tok, tasks, 2, "compact", 512, 1.0, 8, seed=5)
    assert log == [("sleep", 2), "empty_cache", ("wake_up", ["weights"]), "reload_weights",
                   "reset_prefix_cache", "empty_cache", ("wake_up", ["kv_cache"]),
                   ("generate", [None, None]), ("sleep", 2)]
    assert ro.finished == [True] * 4 and engine.asleep
    with pytest.raises(C.CountdownError, match="sleeping"):
        engine.generate(["x"])


def test_vllm_evaluation_requests_keep_their_own_seeds(fake_engine):
    engine, log, model, tok = fake_engine
    engine.sync(model)  # awake: the sync alone
    engine.generate(["a", "b", "c"], n=4, seed=7)
    assert log == ["reload_weights", "reset_prefix_cache", ("generate", [7, 11, 15])]


def test_vllm_sync_streams_a_lora_models_merged_weights_without_copying_it(fake_engine, monkeypatch,
                                                                          tiny_ckpt):
    engine, log, _, _ = fake_engine
    model, _, _ = L.load_policy(tiny_ckpt, lora_rank=4)
    for n, p in model.named_parameters():  # a trained adapter: B != 0
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    real = copy.deepcopy  # a config's copy is fine; the model's is the 7B-sized one
    monkeypatch.setattr(copy, "deepcopy", lambda x, *a: pytest.fail("deep copy of the model")
                        if isinstance(x, torch.nn.Module) else real(x, *a))
    engine.sync(model)
    assert FakeLLM.weights.keys() == want.keys()
    assert all(torch.equal(FakeLLM.weights[k], want[k]) for k in want)


# ---- π_old and μ under a sampler whose log-probs are off on purpose -----------------------------
class Perturbed(S.HFSampler):
    """The HF sampler with every sampled token's log-prob moved by `shift`: an engine whose numbers
    differ from the trainer's (a bf16 vLLM), here by far more than its ~1e-2."""
    shift = 0.0

    def generate(self, *args, **kwargs):
        ro = super().generate(*args, **kwargs)
        ro.logprobs = [[x + self.shift for x in lp] for lp in ro.logprobs]
        return ro


def run_perturbed(module, shift, flags, tmp_path, monkeypatch, tiny_ckpt):
    """metrics of step 1 of `module`'s run with the Perturbed sampler, in fp32."""
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")
    monkeypatch.setattr(Perturbed, "shift", shift)
    monkeypatch.setattr(module, "make_sampler", lambda backend, model, tok, *a: Perturbed(model, tok))
    out = tmp_path / f"{module.__name__}{shift}{'_'.join(flags)}"
    module.main(["--init", tiny_ckpt, *FAST, *flags, "--output_dir", str(out)])
    return [json.loads(x) for x in open(out / "metrics.jsonl")][1]


def test_grpo_takes_pi_old_from_the_trainer_and_the_sampler_is_the_canary(tmp_path, monkeypatch, tiny_ckpt):
    """ρ = 1 on the first pass whatever the sampler says (as TRL and verl); the sampler's offset
    shows in train/sampler_gap and train/mismatch; --is_correction token_truncate weighs tokens by
    min(π_old/π_sampler, C)."""
    row = run_perturbed(grpo, 0.3, [], tmp_path, monkeypatch, tiny_ckpt)
    assert row["train/ratio"] == pytest.approx(1, abs=1e-6) and row["train/clip_frac"] == 0
    assert row["train/sampler_gap"] == pytest.approx(0.3, abs=1e-4) and row["train/is_correction"] == 1
    assert row["train/mismatch"] == pytest.approx(torch.tensor(-0.3).exp().item() - 1 + 0.3, abs=1e-4)  # k3
    row = run_perturbed(grpo, -0.3, ["--is_correction", "token_truncate"], tmp_path, monkeypatch, tiny_ckpt)
    assert row["train/is_correction"] == pytest.approx(torch.tensor(0.3).exp().item(), abs=1e-4)
    assert row["train/is_truncated"] == 0
    row = run_perturbed(grpo, -1.0, ["--is_correction", "token_truncate"], tmp_path, monkeypatch, tiny_ckpt)
    assert row["train/is_correction"] == pytest.approx(2.0, abs=1e-6)  # e^1, truncated at C
    assert row["train/is_truncated"] == 1
    row = run_perturbed(grpo, -1.0, ["--is_correction", "token_mask"], tmp_path, monkeypatch, tiny_ckpt)
    assert row["train/is_correction"] == 0 and row["train/is_masked"] == 1  # e^1 > C: every token dropped


def test_the_off_policy_weight_and_its_place_in_the_grpo_loss_by_hand():
    old, samp = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -1.0, -3.0]])
    w, _ = grpo.off_policy_weight(old, samp, torch.ones(1, 3), "token_truncate", 2.0)
    assert torch.allclose(w, torch.tensor([[0.5, -1.0, 2.5]]).exp().clamp(max=2.0))
    logp, adv = torch.tensor([[-0.9, -2.0, -0.5]]), torch.tensor([1.0])
    per_token, parts = grpo.grpo_loss(logp, old, None, adv, 0.0, 0.2, is_weight=w)
    ratio = (logp - old).exp()
    assert torch.allclose(per_token, -torch.min(ratio, ratio.clamp(0.8, 1.2)) * w)  # the PG term only


@pytest.mark.parametrize("module,flags", [(rloo, []), (opd, ["--teacher", "TINY"])])
def test_rloo_and_opd_mu_is_the_sampler_unless_mu_trainer(module, flags, tmp_path, monkeypatch, tiny_ckpt):
    """Paper 000's μ is the sampler (Eq. 3): its offset moves w = π_θ/μ; --mu trainer takes μ from
    the trainer's forward, w = 1. Either way the canary sees the offset."""
    flags = [tiny_ckpt if f == "TINY" else f for f in flags]
    row = run_perturbed(module, 0.02, flags, tmp_path, monkeypatch, tiny_ckpt)
    assert row["train/is_weight_raw"] < 0.99 and row["train/sampler_gap"] == pytest.approx(0.02, abs=1e-4)
    row = run_perturbed(module, 0.02, [*flags, "--mu", "trainer"], tmp_path, monkeypatch, tiny_ckpt)
    assert row["train/is_weight_raw"] == 1 and row["train/sampler_gap"] == pytest.approx(0.02, abs=1e-4)


# ---- checkpoints, tokenizers, frozen models --------------------------------------------------------
@pytest.mark.parametrize("module", [rloo])
def test_the_checkpoint_is_written_before_the_evaluation_that_may_fail(module, tmp_path, tiny_ckpt, monkeypatch):
    """The loop's last step writes its checkpoint, then evaluates: an evaluation that fails (a GPU out
    of memory in the final one) loses no training. Broken on purpose (the two lines swapped), it failed."""
    from test_rl_signal import ONE_STEP
    calls = []

    def eval_metrics(*a, **kw):  # step 0's evaluation passes, the last one fails
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("CUDA out of memory in the final evaluation")
        return {}
    monkeypatch.setattr(module, "eval_metrics", eval_metrics)
    with pytest.raises(RuntimeError):
        module.main(["--init", tiny_ckpt, *ONE_STEP, "--output_dir", str(tmp_path)])
    assert os.path.isfile(tmp_path / "config.json") and os.path.isfile(tmp_path / "model.safetensors")


def test_a_checkpoint_names_the_eos_its_targets_end_with(tmp_path, tiny_ckpt):
    """An -Instruct base lists <|im_end|> and <|endoftext|> in its configs; every script trains on
    its tokenizer's EOS, so the saved configs name that one (vLLM stops where the trainer does)."""
    model, tok = M.load_model(tiny_ckpt)
    model.config.eos_token_id = model.generation_config.eos_token_id = [5, tok.eos_token_id]
    checkpoints.save_checkpoint(model, tok, str(tmp_path))
    for name in ("config.json", "generation_config.json"):
        assert json.load(open(tmp_path / name))["eos_token_id"] == tok.eos_token_id, name


@pytest.mark.parametrize("what", ["eos", "pad"])
def test_a_teacher_that_ends_on_another_token_is_refused(what):
    """Qwen2.5-7B-Instruct ends on <|im_end|>, the 0.5B base on <|endoftext|>: same vocabulary,
    and OPD's KL would teach a stop token the student's sampler never stops on."""
    tok = M.build_tiny_tokenizer()
    other = copy.deepcopy(tok)
    setattr(other, f"{what}_token", "<answer>")
    with pytest.raises(C.CountdownError, match=f"different {what.upper()} tokens") as e:
        M.check_same_tokenizer(tok, other, "out/sft", "out/teacher")
    assert "\n" not in str(e.value)


def test_frozen_models_are_bf16_on_a_gpu_and_grpos_reference_is_one(tmp_path, monkeypatch, tiny_ckpt):
    assert M.frozen_dtype("cuda") == torch.bfloat16 and M.frozen_dtype("cpu") == torch.float32
    model, _ = M.load_model(tiny_ckpt)
    ref = L.frozen_copy(model)
    assert ref.dtype == torch.float32 and not ref.training
    assert not any(p.requires_grad for p in ref.parameters()) and model.dtype == torch.float32
    # as on a GPU: GRPO's π_ref (bf16 autocast on this CPU, as a GPU trainer always computes)
    monkeypatch.setattr(L, "frozen_dtype", lambda device: torch.bfloat16)
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "1")
    policy, ref = grpo.main(["--init", tiny_ckpt, *FAST, "--beta", "0.04", "--output_dir", str(tmp_path)])
    assert ref.dtype == torch.bfloat16 and policy.dtype == torch.float32


def test_no_deprecated_checkpointing_names(tiny_ckpt):
    """transformers 5.24 warns that gradient_checkpointing_enable and is_gradient_checkpointing go
    in v6: load_policy calls the new name (peft's read of the old one is silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model, _, _ = L.load_policy(tiny_ckpt, gradient_checkpointing=True)
        L.load_policy(tiny_ckpt, gradient_checkpointing=True, lora_rank=4)
    assert model.is_activation_checkpointing


# ---- the install -----------------------------------------------------------------------------------
SCRIPTS = ["sft", "ipo", "rloo", "grpo", "opd", "rlt", "evaluate"]


def imported_modules():
    """Every module of the repo that a script imports, directly or through another: top-level names
    ("common") and the package's ("plumbing.traces")."""
    def path(name):
        return os.path.join(ROOT, *name.split(".")) + ".py"
    seen, todo = set(), list(SCRIPTS)
    while todo:
        for node in ast.walk(ast.parse(open(path(todo.pop())).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = []
            for name in {n for n in names if os.path.isfile(path(n))} - seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_pip_install_carries_every_module_the_scripts_import(tmp_path):
    """`pip install .` then `import plumbing.models` from anywhere: pyproject names every top-level
    module a script imports and the package (plumbing/traces.py was once missing), and an install
    from a copy of the sources, imported from outside it, loads each."""
    import tomllib
    tool = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    listed = set(tool["py-modules"]) | {f"plumbing.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "plumbing"))
                                        if f.endswith(".py") and "plumbing" in tool["packages"]}
    needed = imported_modules()
    assert {"plumbing.traces", "plumbing.models", "plumbing.fast_decode", "common"} <= needed, sorted(needed)
    assert needed <= listed, sorted(needed - listed)
    src, site = tmp_path / "src", tmp_path / "site"
    shutil.copytree(os.path.join(ROOT, "plumbing"), src / "plumbing",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in os.listdir(ROOT):
        if f.endswith(".py") or f == "pyproject.toml":
            shutil.copy(os.path.join(ROOT, f), src)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(site), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.rmtree(src)  # nothing left to import but the install
    r = subprocess.run([sys.executable, "-c", f"import {', '.join(sorted(needed))}"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_checkpointed_lora_trains_under_cpu_bf16(tmp_path, monkeypatch):
    """Step 5's flags (LoRA + gradient checkpointing) on a CPU with native bf16: common.autocast
    switches attention to eager for the forward, so the recompute in backward must run eager too
    (it ran SDPA, and torch's checkpoint refused the mismatch: CheckpointError)."""
    import sft
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "1")
    sft.main(["--init", "tiny", "--data", GEN, "--eval_data", GEN, "--template", "compact",
              "--gradient_checkpointing", "--lora_rank", "4", "--batch_size", "4", "--micro_batch", "2",
              "--max_steps", "1", "--eval_every", "0", "--eval_problems", "2", "--eval_samples", "1",
              "--eval_max_new_tokens", "4", "--num_train", "8", "--output_dir", str(tmp_path)])
    assert os.path.isfile(tmp_path / "model.safetensors")
