"""More than one process: `torchrun --nproc_per_node 2` with gloo on the tiny model, DDP and FSDP2,
against one process with the same global batch and seed (fp32: float rounding only)."""
import json
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import GEN, ROOT, run_cli
from safetensors.torch import load_file

import common as S
from plumbing import distributed as D
from plumbing import harness as H
from plumbing.models import load_model

EVAL = ["--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "4", "--eval_samples", "2",
        "--eval_max_new_tokens", "12"]
SFT = ["sft.py", "--init", "tiny", *EVAL, "--batch_size", "8", "--micro_batch", "2", "--num_train", "40",
       "--max_response_len", "48", "--eval_every", "2", "--tiny_hidden", "32", "--tiny_layers", "2", "--lr", "1e-3"]
RLOO = ["rloo.py", *EVAL, "--batch_size", "4", "--group_size", "3", "--micro_batch", "6", "--max_response_len", "12",
        "--lr", "1e-3", "--save_every", "1"]
FP32 = {"COUNTDOWN_CPU_BF16": "0", "OMP_NUM_THREADS": "1"}  # bf16 rounds differently per batch split


def launch(nproc, args, out, wait=True):
    """`torchrun --nproc_per_node nproc` of a script's command line into `out`; 0: one process, this
    one (run_cli: no interpreter to start)."""
    if nproc == 0:
        env, threads = dict(os.environ), torch.get_num_threads()
        os.environ.update(FP32)
        torch.set_num_threads(1)  # as each rank
        try:
            r = run_cli(*args, "--output_dir", str(out))
        finally:
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(threads)
        assert r.returncode == 0, r.stderr[-3000:]
        return r
    head = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                "--nproc_per_node", str(nproc)]
    cmd = [*head, os.path.join(ROOT, args[0]), *args[1:], "--output_dir", str(out)]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **FP32}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **FP32}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def weights(out):
    return load_file(os.path.join(out, "model.safetensors"))


def rows(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def assert_same_run(a, b, atol=2e-6):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < atol
    ra, rb = rows(a), rows(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]  # one row a step: one writer
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k in x:
            if k.startswith(("train/", "eval/")) and k != "train/grad_norm":
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5), (x["step"], k)


def test_sft_on_two_ranks_is_the_one_process_run(tmp_path):
    """Same global batch and seed: plain `python sft.py` and 2 DDP ranks reach the same weights and
    log the same losses; rank 0 alone wrote the log (one row a step) and the checkpoint."""
    launch(0, [*SFT, "--max_steps", "3"], tmp_path / "one")
    launch(2, [*SFT, "--max_steps", "3"], tmp_path / "two")
    assert_same_run(tmp_path / "one", tmp_path / "two", atol=1e-6)
    assert len(rows(tmp_path / "two")) == 3


def test_rloo_on_two_ranks_is_the_one_process_run_and_a_killed_run_resumes(tiny_ckpt, tmp_path, monkeypatch):
    """RLOO for 3 steps: each rank samples its own whole groups (per-prompt draws: the same rollouts
    for any N), and the update equals one rank's, with DDP and with FSDP2. Then a 2-rank run killed
    after a saved state resumes and ends where the unbroken one did."""
    cmd = [*RLOO, "--init", tiny_ckpt, "--max_steps", "3"]
    monkeypatch.setattr(D, "keyed", lambda: True)  # one process drawing per prompt, as a rank does
    launch(0, cmd, tmp_path / "one")
    monkeypatch.undo()
    for name, flags in (("ddp", []), ("fsdp", ["--fsdp"])):
        launch(2, [*cmd, *flags], tmp_path / name)
        assert_same_run(tmp_path / "one", tmp_path / name)
        assert [r["step"] for r in rows(tmp_path / name)] == [0, 1, 2, 3]
    p = launch(2, cmd, tmp_path / "killed", wait=False)
    state = tmp_path / "killed" / "state"
    while not [n for n in (os.listdir(state) if state.is_dir() else []) if n.startswith("step_")]:
        assert p.poll() is None, p.stderr.read()[-3000:]
        time.sleep(0.02)
    p.terminate()  # torchrun stops its ranks (a SIGKILL of torchrun alone would leave them running)
    p.wait()
    time.sleep(1)  # nothing writes any more: the newest state stays where the kill left it
    assert max(int(n[5:]) for n in os.listdir(state) if n.startswith("step_")) < 3  # killed before its end
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    launch(2, [*cmd, "--resume", str(tmp_path / "killed")], tmp_path / "killed")
    assert_same_run(tmp_path / "ddp", tmp_path / "killed")


def test_keyed_draws_sample_the_same_rollouts_in_any_batching(tiny_ckpt, monkeypatch):
    """Under torchrun the HF sampler draws per prompt: a row's tokens do not depend on the batch it
    decodes in (how many rows, which finished first), so N ranks sample what one does."""
    model, tok = load_model(tiny_ckpt, "cpu", torch.float32)
    prompts = [S.make_prompt([1, 2, k], 7 + k, "compact") for k in range(1, 6)]
    monkeypatch.setattr(D, "keyed", lambda: True)
    out = {}
    for decode in ("plain", "dynamic"):
        for size in (15, 4, 1):  # rows decoded together
            sampler = S.HFSampler(model, tok, batch_size=size, decode=decode)
            whole = sampler.generate(prompts, 3, 1.0, max_new_tokens=16, seed=5)
            halves = [sampler.generate(prompts[:2], 3, 1.0, max_new_tokens=16, seed=5),
                      sampler.generate(prompts[2:], 3, 1.0, max_new_tokens=16, seed=5)]
            assert whole.completion_ids == halves[0].completion_ids + halves[1].completion_ids
            out[decode, size] = whole.completion_ids
    assert len({json.dumps(v) for v in out.values()}) == 1
    rows_ = out["plain", 15]
    assert len({json.dumps(r) for r in rows_}) > 10  # a prompt's 3 samples differ
    monkeypatch.setattr(D, "keyed", lambda: False)  # a plain run: one generator for the call
    sampler = S.HFSampler(model, tok, batch_size=15, decode="plain")
    assert sampler.generate(prompts, 3, 1.0, max_new_tokens=16, seed=5).completion_ids != rows_


def test_each_rank_takes_its_share_of_the_one_process_batch(monkeypatch):
    """Run.next_indices: rank r's k of the step's k x N, in order, are the one-process batch of k x N."""
    def batches(n, r):
        monkeypatch.setattr(D, "world", lambda: n)
        monkeypatch.setattr(D, "rank", lambda: r)
        run = SimpleNamespace(order=[], pool_size=None, rng=random.Random(3), share=H.Run.share)
        return [H.Run.next_indices(run, range(10), 4 // n)[0] for _ in range(5)]
    one = batches(1, 0)
    assert [a + b for a, b in zip(batches(2, 0), batches(2, 1))] == one
    assert [a + b + c + d for a, b, c, d in zip(*(batches(4, r) for r in range(4)))] == one


def test_only_rank_0_writes(tiny_ckpt, tmp_path, monkeypatch):
    """A rank but 0 opens no log, writes no checkpoint and no state (and prints nothing: distributed())."""
    monkeypatch.setattr(D, "rank", lambda: 1)
    model, tok = load_model(tiny_ckpt, "cpu", torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    run = H.Run(str(tmp_path / "out"), 2, model, tok, opt, config={"x": 1})
    run.log(0, {"eval/pass@1": 0.5})
    run.checkpoint()
    run.save(1)
    run.close()
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
