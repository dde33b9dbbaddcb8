"""The sampler k steps ahead (--async_steps, plumbing/async_sampler.py) and the corrections for what
it brings (grpo.off_policy_weight): which weights sampled which step, the weights by hand, a rerun
and a resume, and the process gone however the trainer ends."""
import copy
import gc
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import GEN, ROOT
from conftest import run_cli as cli

import grpo
import opd
import rloo
from common import HFSampler, rollouts
from plumbing import async_sampler
from plumbing import rollout_log
from plumbing.async_sampler import AheadSampler
from plumbing.flags import CountdownError
from plumbing.harness import step_seed
from plumbing.models import load_model
from plumbing.tasks import load_tasks

FAST = ["--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "2", "--eval_samples", "2",
        "--eval_max_new_tokens", "4", "--batch_size", "2", "--group_size", "3", "--micro_batch", "6",
        "--max_response_len", "12", "--lr", "1e-3", "--temperature", "1.0"]
OPTIONS = dict(n=2, template="compact", max_prompt_len=512, max_new_tokens=10, decode=None, bottom_p=1.0,
               bottom_p_freq=1.0)


def children(pid):
    """The live sampler processes whose parent is `pid` (multiprocessing's spawned children; not its
    resource tracker, not the suite's warm interpreter)."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{d}/cmdline").read()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == pid and stat[0] != "Z" and "spawn_main" in cmd:
            out.append(int(d))
    return out


def gone(pid, seconds=10):
    end = time.time() + seconds
    while time.time() < end:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def perturb(model, seed):
    """An 'update': every weight moved, so that each version samples otherwise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def same_rollouts(a, b):
    return a.completion_ids == b.completion_ids and all(
        torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4) for x, y in zip(a.logprobs, b.logprobs))


def test_at_k_1_step_t_is_sampled_by_the_weights_after_step_t_minus_2(tiny_ckpt):
    """The hand-off: steps 1 and 2 by the init (version 0), step 3 by the weights after step 1; each
    the very rollouts this process samples from those weights with the step's seed."""
    model, tok = load_model(tiny_ckpt, torch.device("cpu"))
    tasks = load_tasks(GEN, "train")
    batches = {t: tasks[2 * t:2 * t + 2] for t in (1, 2, 3)}
    threads = torch.get_num_threads()
    ahead = AheadSampler(1, HFSampler(model, tok), rollouts, model, tok, OPTIONS)
    weights = {0: copy.deepcopy(model)}
    got = {}
    for step in (1, 2, 3):
        for t in ahead.due(step, 3):
            ahead.put(t, batches[t], model, step - 1, 1.0, step_seed(3, t))
        got[step], _ = ahead.take(step)
        assert ahead.metrics(step)["train/staleness"] == (0 if step == 1 else 1)
        perturb(model, step)  # the update of step `step`
        weights[step] = copy.deepcopy(model)
    ahead.close()
    assert torch.get_num_threads() == threads and ahead.proc is None

    def here(version, step):
        w = weights[version]
        return rollouts(HFSampler(w, tok), w, tok, batches[step], 2, "compact", 512, 1.0, 10,
                        step_seed(3, step))
    assert [got[s].versions[0] for s in (1, 2, 3)] == [0, 0, 1]
    assert same_rollouts(got[1], here(0, 1)) and same_rollouts(got[2], here(0, 2))
    assert same_rollouts(got[3], here(1, 3)) and not same_rollouts(got[3], here(0, 3))


def test_the_corrections_weights_by_hand():
    """ρ_t = π_old/μ per token, ρ = Π_t ρ_t per rollout; C = 2: truncate at 2, mask outside [1/2, 2]."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-1.0, -1.0, -1.0, -1.0]])
    mu = torch.tensor([[-1.5, -1.0, -3.0, 0.0], [-1.2, -0.9, -1.0, -5.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    e = torch.tensor(1.0).exp
    w, cut = grpo.off_policy_weight(old, mu, mask, "token_truncate", 2.0)
    assert torch.allclose(w[0, :3], torch.stack([e() ** 0.5, e() ** -1, torch.tensor(2.0)]))
    assert cut[0, :3].tolist() == [False, False, True]
    w, cut = grpo.off_policy_weight(old, mu, mask, "token_mask", 2.0)
    assert torch.allclose(w[0, :3], torch.stack([e() ** 0.5, torch.tensor(0.0), torch.tensor(0.0)]))
    assert cut[0, :3].tolist() == [False, True, True]  # e^-1 < 1/2 and e^2.5 > 2 both dropped
    # a rollout's ρ: e^(0.5 − 1 + 2.5) = e^2 (the masked token left out), and e^(0.2 − 0.1)
    w, cut = grpo.off_policy_weight(old, mu, mask, "sequence_truncate", 2.0)
    assert torch.allclose(w[0], torch.full((4,), 2.0)) and cut[0].all()
    assert torch.allclose(w[1], torch.full((4,), e() ** 0.1)) and not cut[1].any()
    w, cut = grpo.off_policy_weight(old, mu, mask, "sequence_mask", 2.0)
    assert torch.equal(w[0], torch.zeros(4)) and cut[0].all()
    assert torch.allclose(w[1], torch.full((4,), e() ** 0.1)) and not cut[1].any()
    w, cut = grpo.off_policy_weight(old, mu, mask, "none", 2.0)
    assert torch.equal(w, torch.ones(2, 4)) and not cut.any()
    # and the loss weighs each token's surrogate by it (ρ_θ = 1 on the first pass: −A·w)
    per_token, _ = grpo.grpo_loss(old, old, None, torch.tensor([1.0, -1.0]), 0.0, 0.2, is_weight=w * 0.5)
    assert torch.allclose(per_token, torch.tensor([[-0.5], [0.5]]).expand(2, 4))


def run_grpo(out, k, *flags):
    grpo.main(["--init", os.environ["TINY"], *FAST, "--max_steps", "3", "--async_steps", str(k), "--log_rollouts",
               "1", "--output_dir", str(out), "--overwrite", *flags])
    return [json.loads(x) for x in open(out / "metrics.jsonl")]


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("time/") and k != "wall"}


def test_grpo_k_steps_ahead_logs_its_staleness_reruns_the_same_and_leaves_no_process(tiny_ckpt, tmp_path,
                                                                                      monkeypatch, capsys):
    """On scripted rewards, k = 2: steps 1-3 sampled by version 0 (staleness 0, 1, 2); a rerun is the same run;
    step 1 is k = 0's step 1 (the same weights and seed); the sampler process is gone after; one
    command prints two steps side by side."""
    monkeypatch.setenv("TINY", tiny_ckpt)
    real = grpo.score_rollouts

    def scripted(samples, tasks, *args):  # the verifier's scores, the rewards a coin of each rollout's tokens
        scores, _ = real(samples, tasks, *args)
        return scores, torch.tensor([float(sum(c) % 2) for c in samples.completion_ids]).view(len(tasks), -1)
    monkeypatch.setattr(grpo, "score_rollouts", scripted)
    a = run_grpo(tmp_path / "a", 2, "--is_correction", "sequence_mask")
    assert not children(os.getpid())
    assert [r["train/staleness"] for r in a[1:]] == [0, 1, 2]
    assert [json.loads(x)["version"][0] for x in open(tmp_path / "a" / "rollouts.jsonl")] == [0, 0, 0]
    b = run_grpo(tmp_path / "b", 2, "--is_correction", "sequence_mask")
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    on = run_grpo(tmp_path / "on", 0, "--is_correction", "sequence_mask")
    assert on[1]["train/reward"] == a[1]["train/reward"] and on[1]["train/resp_len"] == a[1]["train/resp_len"]
    assert on[1]["train/loss"] == pytest.approx(a[1]["train/loss"], abs=1e-5)
    assert a[3]["train/mismatch"] > 10 * on[3]["train/mismatch"]  # two versions behind at lr 1e-3
    capsys.readouterr()
    rollout_log.main([str(tmp_path / "a"), "1", "3", "--width", "40"])
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("step 1: ") and "|  step 3: " in head


def test_grpo_corrects_a_sampler_ahead_unless_told_otherwise():
    """--is_correction auto: sequence MIS at k ≥ 1 (without a correction k = 1 collapsed on both seeds;
    MIS held where token TIS did not, docs/studies/off_policy.md), none at k = 0 (the loop that takes
    turns, unchanged)."""
    def resolved(*flags):
        args = grpo.parse_args(grpo.Args, list(flags))
        grpo.check_grpo(args)
        return args.is_correction
    assert resolved() == "none" and resolved("--async_steps", "1") == "sequence_mask"
    assert resolved("--async_steps", "1", "--is_correction", "none") == "none"


def test_rloo_k_1_and_the_lines_for_what_cannot_run_ahead(tiny_ckpt, tmp_path, monkeypatch):
    """RLOO at k = 1 trains on rollouts one version behind (its w = π_θ/μ then moves off 1); what
    cannot run ahead says so in one line."""
    rloo.main(["--init", tiny_ckpt, *FAST, "--max_steps", "3", "--async_steps", "1", "--output_dir", str(tmp_path)])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["train/staleness"] for r in rows[1:]] == [0, 1, 1] and not children(os.getpid())
    assert abs(rows[3]["train/is_weight_raw"] - 1) > 1e-3 and rows[3]["train/is_ess"] < 1
    base = ["--init", tiny_ckpt, *FAST, "--max_steps", "1", "--output_dir", str(tmp_path / "x")]
    for script, flags, says in (
            ("grpo.py", ["--async_steps", "1", "--backend", "vllm"], "--async_steps 1 with --backend vllm"),
            ("rloo.py", ["--async_steps", "2", "--lora_rank", "4"], "--async_steps 2 with --lora_rank"),
            ("grpo.py", ["--async_steps", "1", "--dynamic_sampling"], "--async_steps 1 with --dynamic_sampling"),
            ("rloo.py", ["--async_steps", "-1"], "--async_steps must be 0"),
            ("grpo.py", ["--is_correction", "token"], "--is_correction must be"),
            ("grpo.py", ["--is_cap", "1"], "--is_cap must be above 1"),
            ("rlt.py", ["--student", tiny_ckpt, "--async_steps", "1"], "rlt.py samples and trains in turns"),
            ("opd.py", ["--teacher", tiny_ckpt, "--async_steps", "1", "--backend", "vllm"], "with --backend vllm")):
        r = cli(script, *base, *flags)
        assert r.returncode == 2 and r.stderr.count("error: ") == 1 and says in r.stderr, r.stderr[-800:]
    monkeypatch.setattr(async_sampler.ranks, "world", lambda: 2)
    model, tok = load_model(tiny_ckpt, torch.device("cpu"))
    with pytest.raises(CountdownError, match="--async_steps 1 under torchrun"):
        AheadSampler(1, None, rollouts, model, tok, OPTIONS)


def test_opd_runs_ahead_as_rloo_does(tiny_ckpt, tmp_path):
    opd.main(["--init", tiny_ckpt, "--teacher", tiny_ckpt, *FAST, "--max_steps", "3", "--async_steps", "1",
              "--log_rollouts", "1", "--output_dir", str(tmp_path)])
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["train/staleness"] for r in rows[1:]] == [0, 1, 1] and not children(os.getpid())
    assert [json.loads(x)["version"][0] for x in open(tmp_path / "rollouts.jsonl")] == [0, 0, 1]


def test_a_nan_stop_ends_the_sampler_process(tiny_ckpt, tmp_path):
    r = cli("rloo.py", "--init", tiny_ckpt, *FAST, "--max_steps", "4", "--lr", "1e30", "--async_steps", "1",
            "--output_dir", str(tmp_path))
    assert r.returncode == 2 and "non-finite loss at step 2" in r.stderr, r.stderr[-800:]
    gc.collect()
    assert all(gone(p, 10) for p in children(os.getpid()))


def start(tiny_ckpt, out):
    """A long grpo.py run at k = 1 in a process of its own, and its sampler's pid once it runs."""
    p = subprocess.Popen([sys.executable, "grpo.py", "--init", tiny_ckpt, *FAST, "--max_steps", "500",
                          "--async_steps", "1", "--output_dir", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    end = time.time() + 180  # a loaded machine (the suite's other worker) starts it slowly
    while time.time() < end and not (os.path.exists(out / "metrics.jsonl") and children(p.pid)):
        time.sleep(0.2)
    kids = children(p.pid)
    assert len(kids) == 1, (kids, p.poll())
    return p, kids[0]


def test_the_sampler_process_ends_with_a_killed_or_interrupted_trainer_and_a_dead_one_ends_the_run(tiny_ckpt,
                                                                                                     tmp_path):
    p, kid = start(tiny_ckpt, tmp_path / "kill")
    p.kill()
    p.wait()
    assert gone(kid, 15), "a SIGKILLed trainer's sampler outlived it"
    p, kid = start(tiny_ckpt, tmp_path / "ctrl_c")
    p.send_signal(signal.SIGINT)
    p.wait(30)
    assert gone(kid, 15), "a Ctrl-C'd trainer's sampler outlived it"
    p, kid = start(tiny_ckpt, tmp_path / "sampler")
    os.kill(kid, signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "Traceback" not in err and err.count("error: ") == 1, err[-800:]
    assert "the sampler process died (exit code -9)" in err
