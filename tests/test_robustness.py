"""A student's first hour: killed runs, blown-up learning rates, typos and odd data. Each ends in
one line on stderr (exit code 2, no traceback) or in a run that goes on exactly where it stopped."""
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import GEN, ROOT
from conftest import run_cli as cli

from plumbing import checkpoints
from plumbing import flags as C
from plumbing import models as M
from plumbing.checkpoints import latest_state, save_checkpoint

EVAL = ["--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "4", "--eval_samples", "2",
        "--eval_max_new_tokens", "8"]
RL = [*EVAL, "--batch_size", "2", "--group_size", "3", "--micro_batch", "4", "--max_response_len", "12", "--lr", "1e-3"]


def run(*args, env=None):
    """A script's command line: in this process (cli, no interpreter to start), or with an
    environment of its own in a subprocess."""
    if env is None:
        return cli(*args)
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env})


def one_line_error(r, message):
    """Exit code 2 and one `error:` line holding `message` (a progress bar may have been drawn
    before it)."""
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("error: ") == 1, r.stderr[-2000:]
    line = r.stderr.split("error: ")[1].strip()
    assert message in line and "\n" not in line, r.stderr[-2000:]


@pytest.fixture
def ckpt(tiny_ckpt):  # tests/conftest.py
    return tiny_ckpt


def commands(ckpt):
    """Three steps of every training script on the tiny model."""
    return {
        "sft": ["sft.py", "--init", "tiny", *EVAL, "--batch_size", "4", "--micro_batch", "2", "--max_steps", "3",
                "--lr", "1e-3", "--dead_ends", "1"],
        "ipo": ["ipo.py", "--init", ckpt, *EVAL, "--pairs", "solver", "--num_prompts", "16", "--heldout", "0.25",
                "--batch_size", "4", "--micro_batch", "2", "--epochs", "1", "--lr", "1e-3"],
        "rloo": ["rloo.py", "--init", ckpt, *RL, "--max_steps", "3"],
        "grpo": ["grpo.py", "--init", ckpt, *RL, "--max_steps", "3", "--ref_sync_every", "1", "--num_iterations", "2"],
        # the sampler two steps ahead: step 3's rollouts, sampled before the state of step 2, ride in it
        "grpo_async": ["grpo.py", "--init", ckpt, *RL, "--max_steps", "3", "--async_steps", "2", "--is_correction",
                       "token_mask", "--log_rollouts", "1"],
        "opd": ["opd.py", "--init", ckpt, "--teacher", ckpt, *RL, "--max_steps", "3"],
        "rlt": ["rlt.py", "--init", ckpt, "--student", ckpt, *RL, "--max_steps", "3", "--ref_sync_every", "1",
                "--max_response_len", "30"],
    }


def metrics(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("time/") and k != "wall"}


@pytest.mark.parametrize("script", ["sft", "ipo", "rloo", "grpo", "grpo_async", "opd", "rlt"])
def test_a_resumed_run_continues_exactly(script, ckpt, tmp_path):
    """Kill after step 2, resume: step 3 is the uninterrupted run's step 3, to the last digit (CPU,
    fixed seed). The killed run is the full run's directory as it was after step 2: its newest
    state is step 2's."""
    cmd, full, cut = commands(ckpt)[script], str(tmp_path / "full"), str(tmp_path / "cut")
    r = run(*cmd, "--save_every", "1", "--output_dir", full)
    assert r.returncode == 0, r.stderr[-3000:]
    # the newest 2 kept
    assert sorted(os.listdir(os.path.join(full, "state"))) == ["step_0000002", "step_0000003"]
    shutil.copytree(full, cut)
    shutil.rmtree(os.path.join(cut, "state", "step_0000003"))
    # a line logged after the last state: must go
    with open(os.path.join(cut, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 3, "train/loss": -1.0}) + "\n")
    r = run(*cmd, "--resume", cut, "--output_dir", "ignored")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stdout
    a, b = metrics(full), metrics(cut)
    assert [x["step"] for x in a] == [x["step"] for x in b]
    assert comparable(a[-1]) == comparable(b[-1])
    sa, sb = (torch.load(os.path.join(d, "state", "step_0000003", "state.pt"), weights_only=False) for d in (full, cut))
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
    if script == "grpo_async":  # and the rollouts' log, step 3 sampled by the init in both
        logs = [open(os.path.join(d, "rollouts.jsonl")).read() for d in (full, cut)]
        assert logs[0] == logs[1] and json.loads(logs[1].splitlines()[-1])["version"][0] == 0


def test_an_existing_run_is_never_overwritten_silently(tmp_path):
    cmd = ["sft.py", "--init", "tiny", *EVAL, "--batch_size", "4", "--micro_batch", "2", "--max_steps", "2",
           "--save_every", "1", "--output_dir", str(tmp_path)]
    assert run(*cmd).returncode == 0
    before = (tmp_path / "model.safetensors").read_bytes()
    one_line_error(run(*cmd), "is not empty: pass --overwrite")
    assert (tmp_path / "model.safetensors").read_bytes() == before
    r = run(*cmd, "--overwrite", "--lr", "1e-2")
    # old metrics gone, not appended
    assert r.returncode == 0 and [x["step"] for x in metrics(tmp_path)] == [1, 2]
    one_line_error(run(*cmd[:-2], "--resume", str(tmp_path / "nothing")), "no saved training state")


def test_nonfinite_loss_stops_and_keeps_the_last_good_state(tmp_path):
    """lr 1e30: step 1 is fine, then the weights are astronomically large and step 2's loss is not
    finite."""
    cmd = ["sft.py", "--init", "tiny", *EVAL, "--batch_size", "4", "--micro_batch", "2", "--max_steps", "4",
           "--save_every", "1", "--lr", "1e30", "--warmup", "0"]
    r = run(*cmd, "--output_dir", str(tmp_path / "stop"))
    one_line_error(r, "non-finite loss at step 2")
    assert "step_0000001" in r.stderr and latest_state(str(tmp_path / "stop")).endswith("step_0000001")
    state = torch.load(os.path.join(latest_state(str(tmp_path / "stop")), "state.pt"), weights_only=False)
    assert state["step"] == 1 and all(torch.isfinite(v).all() for v in state["model"].values())
    # --skip_nonfinite cannot save weights that are already astronomically large: sampling says so
    # in one line
    one_line_error(run(*cmd, "--skip_nonfinite", "--output_dir", str(tmp_path / "skip")), "weights have blown up")


@pytest.mark.parametrize("script", ["sft", "rloo"])
def test_skip_nonfinite_drops_a_transient_bad_step_and_counts_it(script, ckpt, tmp_path, monkeypatch):
    """NaN log-probs in step 2's training forward only: without the flag the run stops there; with
    it, step 2 leaves the weights as step 1 left them, is counted, and step 3 trains on."""
    module, step = importlib.import_module(script), {"n": 1}
    real_stats, real_clip = module.token_stats, torch.nn.utils.clip_grad_norm_

    def flaky_stats(model, *args, **kwargs):
        out = real_stats(model, *args, **kwargs)
        if torch.is_grad_enabled() and step["n"] == 2:
            out["logp"] = out["logp"] * float("nan")
        return out

    def clip_then_count(*args, **kwargs):  # once per optimizer step, after its backward passes
        norm = real_clip(*args, **kwargs)
        step["n"] += 1
        return norm
    monkeypatch.setattr(module, "token_stats", flaky_stats)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_then_count)
    monkeypatch.setattr(checkpoints, "STATE_KEEP", 10)
    argv = [*commands(ckpt)[script][1:], "--save_every", "1"]
    with pytest.raises(C.CountdownError, match="non-finite loss at step 2"):
        module.main([*argv, "--output_dir", str(tmp_path / "stop")])
    step["n"] = 1
    module.main([*argv, "--skip_nonfinite", "--output_dir", str(tmp_path / "skip")])
    assert [x["train/skipped_steps"] for x in metrics(tmp_path / "skip") if x["step"] > 0] == [0, 1, 1]
    w = [torch.load(tmp_path / "skip" / "state" / f"step_000000{k}" / "state.pt", weights_only=False)["model"]
         for k in (1, 2, 3)]
    assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])          # the bad step changed nothing
    assert any(not torch.equal(w[1][k], w[2][k]) for k in w[0])      # and training went on


def test_clear_one_line_errors(ckpt, tmp_path):
    """Every mistake in the issue's list, through the real CLIs (in this process, but the hub's: its
    environment)."""
    no_ckpt = tmp_path / "empty_dir"
    no_ckpt.mkdir()
    one_line_error(cli("rloo.py", "--init", str(tmp_path / "typo"), *RL, "--output_dir", str(tmp_path / "a")),
                   "no such checkpoint dir")
    one_line_error(cli("grpo.py", "--init", str(no_ckpt), *RL, "--output_dir", str(tmp_path / "b")), "not a checkpoint dir")
    one_line_error(run("sft.py", "--init", "Qwen/Qwen2.5-0.5B", *EVAL, "--output_dir", str(tmp_path / "c"),
                       env={"HF_ENDPOINT": "http://127.0.0.1:9"}), "--init tiny")
    wrong = tmp_path / "wrong_fields.jsonl"
    wrong.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    one_line_error(cli("sft.py", "--init", "tiny", *EVAL, "--data", str(wrong), "--output_dir", str(tmp_path / "d")),
                   "missing field(s) ['query', 'completion']; the line has ['prompt', 'response']")
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"nums": [1, 2, 3], "target": 6}\n{"nums": [1, 2\n')
    one_line_error(cli("rloo.py", "--init", ckpt, *RL, "--data", str(bad), "--output_dir", str(tmp_path / "e")),
                   "tasks.jsonl:2: not valid JSON")
    unsolvable = tmp_path / "unsolvable.jsonl"
    unsolvable.write_text(json.dumps({"nums": [1, 1, 1], "target": 97}) + "\n")
    one_line_error(cli("rlt.py", "--init", ckpt, "--student", ckpt, *RL, "--data", str(unsolvable),
                       "--output_dir", str(tmp_path / "f")), "no solvable tasks")
    other = M.build_tiny_tokenizer(vocab_size=300)
    save_checkpoint(M.build_tiny_model(other), other, str(tmp_path / "other"))
    one_line_error(cli("opd.py", "--init", ckpt, "--teacher", str(tmp_path / "other"), *RL, "--output_dir",
                       str(tmp_path / "g")), "different tokenizers")
    one_line_error(cli("sft.py", "--init", "tiny", *EVAL, "--strategies", "random:0.5,sideways:0.5", "--output_dir",
                       str(tmp_path / "j")), "--strategies / --mistakes: unknown strategy or negative weight 'sideways:0.5'")
    one_line_error(cli("ipo.py", "--init", ckpt, *EVAL, "--batch_size", "6", "--micro_batch", "4", "--output_dir",
                       str(tmp_path / "h")), "not a multiple")
    one_line_error(cli("rloo.py", "--init", ckpt, *RL, "--max_prompt_len", "5", "--output_dir", str(tmp_path / "i")),
                   "longer than --max_prompt_len 5")
    # a traceback (`step % 0`) at the first save before it was checked
    one_line_error(cli("sft.py", "--init", "tiny", *EVAL, "--save_every", "0", "--output_dir", str(tmp_path / "k")),
                   "--save_every must be at least 1")
    one_line_error(cli("evaluate.py", "--model", ckpt, "--data", GEN, "--num_problems", "2", "--batch_size", "0"),
                   "--batch_size (rows decoded together) must be at least 1, not 0")
    # the main venv: the vLLM lane has a venv of its own
    if importlib.util.find_spec("vllm") is None:
        one_line_error(cli("evaluate.py", "--model", ckpt, "--backend", "vllm", "--data", GEN, "--num_problems", "2"),
                       "--backend vllm needs vLLM")


def test_a_missing_local_init_names_the_folder_and_the_stage_that_makes_it(tmp_path):
    """`python rloo.py --init out/sft` before SFT ran: `out/sft` has a hub id's shape, and was
    taken for one; now one line names the missing folder and the command that writes it."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "rloo.py"), "--init", "out/sft", "--output_dir",
                        str(tmp_path / "rloo")], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "no such checkpoint dir: out/sft" in r.stderr and "python sft.py" in r.stderr, r.stderr
