import functools
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import GEN, ROOT, run_cli
from test_graded import check_opd_loss, check_reward_parts, check_rlt_reward

from plumbing import flags as C
from plumbing import tasks as D
import common as LP
from plumbing import models as M
import opd
import rlt
import common as S
from plumbing import explanations as RD
import sft
from plumbing import traces as TR
from plumbing.checkpoints import save_checkpoint
from verifier import extract_answer, score

# rlt.score_explanations, and the reward 004 §A.1 makes of its parts
SCORE = dict(template="compact", micro_batch=2, temperature=1.0, kl_estimator="exact")
RWD = dict(alpha=0.01, lam=3.0, penalty=-1.0)
ROW = functools.partial(D.student_row, template="compact")  # an export's row


def scorer(teacher, student, tok, **kw):
    """score_fn as rlt.main builds it: (tasks, sols, explanations, penalized) -> r, r_SS, r_KL."""
    parts_of = functools.partial(rlt.score_explanations, teacher, student, tok, **{**SCORE, **kw}, device="cpu")
    return lambda t, s, e, p: rlt.rlt_reward(parts_of(t, s, e), p, **RWD)
FAST = ["--term_grads", "--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "4", "--eval_samples", "2",
        "--eval_max_new_tokens", "8", "--batch_size", "2", "--group_size", "3", "--micro_batch", "4",
        "--max_response_len", "12", "--max_steps", "2", "--lr", "1e-3"]


def tiny_model(seed):
    torch.manual_seed(seed)
    tok = M.build_tiny_tokenizer()
    return M.build_tiny_model(tok).eval(), tok


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny checkpoints with one tokenizer (student and teacher) and one with another tokenizer."""
    out = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        model, tok = tiny_model(seed)
        out[name] = str(tmp_path_factory.mktemp(name))
        save_checkpoint(model, tok, out[name])
    other = M.build_tiny_tokenizer(vocab_size=300)
    out["other"] = str(tmp_path_factory.mktemp("other"))
    save_checkpoint(M.build_tiny_model(other), other, out["other"])
    return out


# ---- opd.py --------------------------------------------------------------------------------------
def test_opd_loss_by_hand():
    check_opd_loss(opd.opd_loss)  # the graded exercise's check (tests/test_graded.py)


@pytest.mark.parametrize("reverse", [False, True])
def test_opd_kl_step_moves_student_toward_teacher(reverse):
    """One SGD step on the distillation term alone lowers the KL it names (forward KL(teacher ‖
    student), or --kd_loss reverse's KL(student ‖ teacher)) on the same tokens."""
    student, _ = tiny_model(0)
    teacher, _ = tiny_model(1)
    student.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 12), generator=g)
    attn, mask = torch.ones(2, 12, dtype=torch.long), torch.ones(2, 12, dtype=torch.long)
    args = SimpleNamespace(kl_coef=1.0, rl_coef=0.0, entropy_coef=0.0, is_clip=10.0)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    kls = []
    for _ in range(2):
        st = LP.token_stats(student, ids, attn, mask, entropy=True, teacher=teacher, kd_temperature=1.3,
                            kd_reverse=reverse)
        m = mask[:, 1:].float()
        loss, _ = opd.opd_loss(st["logp"], st["logp"].detach(), st["kl"], st["entropy"], m, torch.zeros(2), **vars(args))
        kls.append(loss.mean().item())
        loss.mean().backward()
        opt.step()
        opt.zero_grad()
    assert kls[1] < kls[0], kls


# ---- token_stats with a teacher in another context (RLT's r_KL) ----------------------------------
def test_teacher_inputs_left_padded_match_unpadded_runs():
    student, _ = tiny_model(0)
    teacher, _ = tiny_model(1)
    p_s, p_t, resp = [5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24]
    T = len(p_t) + len(resp)
    ids_t = torch.tensor([p_t + resp])
    # left-padded: responses line up
    ids_s = torch.tensor([[0] * (len(p_t) - len(p_s)) + p_s + resp])
    attn_t = torch.ones(1, T, dtype=torch.long)
    attn_s = (torch.arange(T) >= len(p_t) - len(p_s)).long()[None]
    mask = (torch.arange(T) >= len(p_t)).long()[None]
    st = LP.token_stats(student, ids_s, attn_s, mask, teacher=teacher, teacher_inputs=(ids_t, attn_t))
    with torch.no_grad():  # each model on its own unpadded sequence
        zs = student(input_ids=torch.tensor([p_s + resp])).logits[0, len(p_s) - 1:-1]
        zt = teacher(input_ids=ids_t).logits[0, len(p_t) - 1:-1]
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    sel = mask[0, 1:].bool()
    assert torch.allclose(st["logp"][0, sel], ls.gather(-1, torch.tensor(resp)[:, None])[:, 0], atol=1e-5)
    assert torch.allclose(st["kl"][0, sel], (lt.exp() * (lt - ls)).sum(-1), atol=1e-5)


def test_different_tokenizers_are_refused():
    a, b = M.build_tiny_tokenizer(), M.build_tiny_tokenizer(vocab_size=300)
    M.check_same_tokenizer(a, a, "x", "y")
    with pytest.raises(C.CountdownError, match="different tokenizers"):
        M.check_same_tokenizer(a, b, "out/sft", "out/teacher")


# ---- rlt.py --------------------------------------------------------------------------------------
def test_rlt_reward_by_hand():
    check_reward_parts(rlt.reward_parts)
    check_rlt_reward(rlt.rlt_reward)


def test_balance_weights_make_the_four_terms_equal_in_magnitude():
    """004 §A.1: λ and α such that each term has about the same expected magnitude over the
    initial completions. Parts (N, 4): avg log p, min log p, avg KL_t, max KL_t."""
    from plumbing.explanations import balance_weights
    parts = torch.tensor([[-2.0, -8.0, 0.05, 0.5], [-4.0, -12.0, 0.15, 1.5]])  # |means| 3, 10, 0.1, 1
    alpha, lam = balance_weights(parts)
    assert alpha == pytest.approx((3 / 10 * 0.1 / 1) ** 0.5)  # one α for the ratios 3 / 10 and 0.1 / 1
    r_ss, r_kl = parts[:, 0] + alpha * parts[:, 1], parts[:, 2] + alpha * parts[:, 3]
    assert lam == pytest.approx(r_ss.abs().mean() / r_kl.abs().mean())  # λ E|r_KL| = E|r_SS|
    assert lam == pytest.approx((3 + alpha * 10) / (0.1 + alpha * 1))  # by hand
    with pytest.raises(C.CountdownError, match="cannot balance"):
        balance_weights(torch.tensor([[-2.0, -8.0, 0.0, 0.0]]))


def test_explanation_is_penalized_only_without_the_closing_tag():
    assert rlt.explanation_of(" 3 + 4 = 7. Found 7.\n</think>\n<answer>3 + 4</answer>") == (" 3 + 4 = 7. Found 7.\n", False)
    # never closed
    assert rlt.explanation_of(" 3 + 4 = 7. Found 7.\n") == (" 3 + 4 = 7. Found 7.\n", True)
    # closed </think>, then cut at max tokens while it went on: the explanation itself is whole
    assert rlt.explanation_of(" 3 + 4 = 7.</think>\n<answer>3 + 4</answ") == (" 3 + 4 = 7.", False)


@pytest.mark.parametrize("kl_estimator,T", [("exact", 1.0), ("exact", 0.7), ("sampled", 0.7)])
def test_score_explanations_matches_per_row_naive_and_penalizes(kl_estimator, T, monkeypatch):
    """Per row, from two plain forwards: the student's log-probs of the solution, and KL_t over the
    explanation, exact (over the vocabulary) or sampled (the authors' log-ratio of the written
    token), both models at logits / T (the authors score at the sampling temperature)."""
    monkeypatch.setenv("COUNTDOWN_CPU_BF16", "0")  # checks the row alignment against fp32, to 1e-4
    teacher, tok = tiny_model(1)
    student, _ = tiny_model(0)
    tasks = [{"nums": [3, 4, 5], "target": 35}, {"nums": [2, 9, 7], "target": 25}, {"nums": [1, 2, 3], "target": 6}]
    sols = ["(3 + 4) * 5", "2 * 9 + 7", "1 + 2 + 3"]
    expl = [" 3 + 4 = 7, left 5 7. 5 * 7 = 35. Found 35.\n", " 2 * 9 = 18, left 7", ""]
    pen = [False, True, False]  # row 1 never closed </think>
    score_fn = scorer(teacher, student, tok, kl_estimator=kl_estimator, temperature=T)
    r, r_ss, r_kl = score_fn(tasks, sols, expl, pen)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for i in (0, 1, 2):
        ps, pt = enc(D.student_prompt(tasks[i], "compact")), enc(D.teacher_prompt(tasks[i], sols[i], "compact"))
        e, tail, s = enc(expl[i]), enc("</think>\n<answer>"), enc(sols[i] + "</answer>")
        with torch.no_grad():
            ls = (student(input_ids=torch.tensor([ps + e + tail + s])).logits[0] / T).log_softmax(-1)
            lt = (teacher(input_ids=torch.tensor([pt + e + tail + s])).logits[0] / T).log_softmax(-1)
        sol_lp = ls[len(ps) + len(e) + len(tail) - 1:-1].gather(-1, torch.tensor(s)[:, None])[:, 0]
        want_ss = sol_lp.mean() + 0.01 * sol_lp.min()
        lt_e, ls_e = lt[len(pt) - 1:len(pt) + len(e) - 1], ls[len(ps) - 1:len(ps) + len(e) - 1]  # (len(e), V)
        if kl_estimator == "exact":
            kl = (lt_e.exp() * (lt_e - ls_e)).sum(-1)
        else:  # the token the teacher wrote
            kl = (lt_e - ls_e).gather(-1, torch.tensor(e, dtype=torch.long)[:, None])[:, 0]
        want_kl = kl.mean() + 0.01 * kl.max() if len(e) else torch.tensor(0.0)
        assert abs(r_ss[i] - want_ss) < 1e-4 and abs(r_kl[i] - want_kl) < 1e-4, i
        assert abs(r[i] - (want_ss - 3 * want_kl - int(pen[i]))) < 1e-3  # 004 §A.1: the −1 is added
    unpenalized, _, _ = score_fn(tasks, sols, expl, [False] * 3)
    # so being penalized never pays
    assert torch.allclose(r, unpenalized - torch.tensor([0.0, 1.0, 0.0]))
    if kl_estimator == "sampled":  # it differs from the exact KL: another quantity, not a copy
        _, _, exact_kl = scorer(teacher, student, tok, temperature=T)(tasks, sols, expl, pen)
        assert (exact_kl[:2] - r_kl[:2]).abs().min() > 1e-3


def test_formats_round_trip_through_export_into_sft_loader(tmp_path):
    task, sol = {"nums": [3, 4, 5], "target": 35}, "(3 + 4) * 5"
    tp = D.teacher_prompt(task, sol, "compact")
    assert tp.endswith(f"<answer>{sol}</answer>\n<think>") and "[3, 4, 5]" in tp and "35" in tp
    teacher_out = " 3 + 4 = 7, left 5 7. 5 * 7 = 35. Found 35.\n</think>\n<answer>(3 + 4) * 5</answer>"
    completion = D.student_completion(rlt.explanation_of(teacher_out)[0], sol)
    assert completion == teacher_out and score(completion, task["nums"], task["target"]) == 1.0
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps({"query": D.student_prompt(task, "compact"), "completion": completion}) + "\n")
    prompts, responses = D.sft_data(str(path), "train", None, "compact", 0)
    assert prompts == [D.make_prompt([3, 4, 5], 35, "compact")] and responses(None) == [completion]


def test_rlt_sft_data_is_the_teacher_format_explaining_its_own_solution():
    """004 §A.1: the teacher's SFT before RL sees the solution and learns to write the trace that
    reaches it, up to </think>."""
    prompts, responses = D.teacher_sft_data("rlt:" + GEN.removeprefix("gen:"), "train", 6, "compact", dead_ends=1)
    tasks = D.load_tasks(GEN, "train", 6)
    for task, prompt, expl in zip(tasks, prompts, responses(None)):
        sol = prompt.split("<answer>")[-1].split("</answer>")[0]
        assert prompt == D.teacher_prompt(task, sol, "compact") and expl.endswith("</think>")
        assert expl.count("</think>") == 1 and "<answer>" not in expl
        assert score(D.student_completion(expl.removesuffix("</think>"), sol), task["nums"], task["target"]) == 1.0


def test_rlt_warmup_from_a_file_rewrites_the_teachers_accepted_samples(tmp_path, tiny_ckpt):
    """004 §A.1 as the paper does it: the warm-up rewrites the baseline's own samples (here an
    evaluate.py --export file) into the teacher's format: the prompt names the sample's own answer,
    the target is the sample up to </think>. A sample the verifier rejects is no teacher example;
    the file's last row is held out, as sft.py holds out a file's; sft.py trains on it as written
    (no query matching: these prompts are the teacher's)."""
    import random
    tasks = D.load_tasks(GEN, "train", 12)
    rows = [{"query": D.make_prompt(t["nums"], t["target"], "compact"), "nums": t["nums"], "target": t["target"],
             "completion": TR.make_trace(t["nums"], t["target"], random.Random(i))} for i, t in enumerate(tasks)]
    rows[0]["completion"] = rows[0]["completion"].replace("<answer>", "<answer>1 + ")  # rejected
    path = tmp_path / "accepted.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, responses = D.teacher_sft_data(f"rlt:{path}", "train", None, "compact", eval_problems=4)
    kept = rows[1:-1]  # the rejected one out, the last (min(4, 12 // 10) = 1) held out
    assert prompts == [D.teacher_prompt(r, extract_answer(r["completion"]), "compact") for r in kept]
    assert responses(None) == [r["completion"].split("</think>")[0] + "</think>" for r in kept]
    assert D.teacher_sft_data(f"rlt:{path}", "val", None, "compact", eval_problems=4)[0] == [
        D.teacher_prompt(rows[-1], extract_answer(rows[-1]["completion"]), "compact")]
    (tmp_path / "none.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(C.CountdownError, match="no sample the verifier accepts"):
        D.teacher_sft_data(f"rlt:{tmp_path / 'none.jsonl'}", "train", None, "compact")
    sft.main(["--init", tiny_ckpt, "--data", f"rlt:{path}", "--eval_data", GEN, "--template", "compact",
              "--batch_size", "4", "--micro_batch", "4", "--max_steps", "2", "--eval_problems", "4",
              "--eval_samples", "2", "--eval_max_new_tokens", "8", "--output_dir", str(tmp_path / "warm")])
    assert len(open(tmp_path / "warm" / "metrics.jsonl").readlines()) == 2

def test_sft_cosine_ends_at_final_lr(tmp_path):
    """004 Table 5's student recipe decays to 1e-6, not 0."""
    sft.main(["--init", "tiny", "--data", "rlt:" + GEN.removeprefix("gen:"), "--eval_data", GEN, "--template",
              "compact", "--eval_problems", "2", "--eval_samples", "1", "--eval_max_new_tokens", "4", "--batch_size",
              "2", "--micro_batch", "2", "--max_steps", "4", "--warmup", "0.25", "--lr", "1e-4", "--final_lr", "1e-6",
              "--output_dir", str(tmp_path)])
    lrs = [json.loads(x)["train/lr"] for x in open(tmp_path / "metrics.jsonl")]
    assert lrs[0] == pytest.approx(1e-4) and lrs[-1] == pytest.approx(1e-6) and lrs[1] > lrs[2] > lrs[3]


def test_opd_two_steps_in_a_subprocess(ckpts, tmp_path):
    r = subprocess.run([sys.executable, "opd.py", "--init", ckpts["student"], "--teacher", ckpts["teacher"], *FAST,
                        "--kd_temperature", "1.3", "--entropy_coef", "1e-2", "--temperature", "0.7", "--output_dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "COUNTDOWN_CPU_BF16": "0"})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/pass@1" in rows[-1]
    keys = {"train/loss", "train/kl", "train/pg", "train/entropy", "train/reward", "train/is_weight",
            "train/is_weight_raw", "train/is_weight_raw_max", "train/sampler_gap", "time/sample", "time/update"}
    assert keys <= set(rows[-1]) and all(math.isfinite(v) for v in rows[-1].values())
    # rollouts at T 0.7: logits / 0.7 both sides
    assert rows[-1]["train/kl"] > 0 and rows[-1]["train/sampler_gap"] < 1e-5
    assert abs(rows[-1]["train/is_weight_raw"] - 1) < 1e-4 and abs(rows[-1]["train/is_weight_raw_max"] - 1) < 1e-3
    assert os.path.isfile(tmp_path / "config.json")


def test_rlt_two_steps_export_then_sft_on_the_traces(ckpts, tmp_path):
    traces = tmp_path / "traces.jsonl"
    r = subprocess.run([sys.executable, "rlt.py", "--init", ckpts["student"], "--student", ckpts["teacher"], *FAST,
                        "--export", str(traces), "--export_problems", "5", "--export_best_of", "2",
                        "--max_response_len", "40", "--output_dir", str(tmp_path / "rlt")], cwd=ROOT, capture_output=True, text=True,
                       # fp32 forwards: the sampler gap to float precision
                       env={**os.environ, "COUNTDOWN_CPU_BF16": "0"})
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in open(tmp_path / "rlt" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/r_ss" in rows[-1]
    assert {"train/reward", "train/r_ss", "train/r_kl", "train/penalized", "train/expl_len"} <= set(rows[-1])
    # An untrained teacher rarely closes </think> in 40 tokens: most rows get the −1 on top of r_SS
    # − λ r_KL ≤ 0.
    assert rows[-1]["train/reward"] <= 0 and 0 <= rows[-1]["train/penalized"] <= 1
    # sampled at T 0.7, both sides scored at logits / 0.7
    assert rows[-1]["train/sampler_gap"] < 1e-5
    # (an untrained teacher's lines: test_export_keeps_the_best_explanation checks content)
    assert traces.exists()
    traces.write_text(json.dumps({"query": D.make_prompt([1, 2, 3], 6, "compact"),
                                  "completion": D.student_completion(" 1 + 2 = 3.\n", "1 + 2 + 3")}) + "\n")
    r = subprocess.run([sys.executable, "sft.py", "--init", "tiny", "--data", str(traces), "--eval_data", GEN, "--template",
                        "compact", "--eval_problems", "2", "--eval_samples", "1", "--eval_max_new_tokens", "4", "--batch_size",
                        "2", "--micro_batch", "2", "--max_steps", "2", "--output_dir", str(tmp_path / "student")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


class ScriptedSampler:
    """Stands in for the teacher's sampler: returns fixed completions, so the exporter's choices are
    known."""

    def __init__(self, tok, texts, finished):
        self.tok, self.texts, self.finished = tok, texts, finished

    sync = lambda self, model: None  # noqa: E731
    sleep = wake = lambda self: None  # noqa: E731

    def generate(self, prompts, n, *a, **k):
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] for t in self.texts]
        return S.Rollouts([[0]] * len(prompts), ids, [[0.0] * len(x) for x in ids], self.texts, self.finished)


def test_export_keeps_the_best_explanation_and_skips_all_penalized(tmp_path):
    teacher, tok = tiny_model(1)
    student, _ = tiny_model(0)
    tasks = [{"nums": [3, 4, 5], "target": 35}, {"nums": [2, 9, 7], "target": 25}]
    sols = ["(3 + 4) * 5", "2 * 9 + 7"]
    # task 1: two tries
    texts = [" 3 + 4 = 7. 5 * 7 = 35. Found 35.\n</think>\n<answer>x</answer>", " no.\n</think>",
             " 2 * 9 = 18", " 2 * 9 = 18, left 7 18."]  # task 2: cut, untagged
    sampler = ScriptedSampler(tok, texts, [True, True, False, True])
    explain = functools.partial(rlt.explain, sampler, teacher, tok, template="compact", max_prompt_len=512, temperature=1.0,
                                max_new_tokens=40, seed=0)
    score_fn = scorer(teacher, student, tok, micro_batch=4)
    rlt.export_traces(str(tmp_path / "x.jsonl"), explain, score_fn, tasks, sols, 2, ROW, 0)
    lines = [json.loads(x) for x in open(tmp_path / "x.jsonl")]
    assert len(lines) == 1 and lines[0]["nums"] == [3, 4, 5]  # task 2: both penalized, left out
    expl = [rlt.explanation_of(t)[0] for t in texts[:2]]
    _, r_ss, _ = score_fn(tasks[:1] * 2, sols[:1] * 2, expl, [False] * 2)
    best = expl[int(r_ss.argmax())]
    assert lines[0]["completion"] == D.student_completion(best, sols[0]) and abs(lines[0]["r_ss"] - r_ss.max()) < 1e-5
    assert lines[0]["query"] == D.make_prompt([3, 4, 5], 35, "compact")
    assert score(lines[0]["completion"], [3, 4, 5], 35) == 1.0


class CallsSampler(ScriptedSampler):
    """A scripted sampler whose every call returns the next batch of texts (finished at EOS iff
    closed), and records the prompts it was given."""

    def __init__(self, tok, batches):
        self.tok, self.batches, self.prompts = tok, list(batches), []

    def generate(self, prompts, n, *a, **k):
        self.prompts.append(list(prompts))
        self.texts = self.batches.pop(0)
        self.finished = ["</think>" in t for t in self.texts]
        return super().generate(prompts, n)


@pytest.mark.parametrize("redraws,exported", [(0, 1), (1, 2)])
def test_export_draws_again_only_for_problems_with_no_closed_explanation(redraws, exported, tmp_path):
    """004 §B: up to N draws for a question, any one within the budget kept. Task 2's first
    explanation runs past the budget; with one redraw it is drawn again, alone, and kept."""
    teacher, tok = tiny_model(1)
    student, _ = tiny_model(0)
    tasks = [{"nums": [3, 4, 5], "target": 35}, {"nums": [2, 9, 7], "target": 25}]
    sols = ["(3 + 4) * 5", "2 * 9 + 7"]
    sampler = CallsSampler(tok, [[" 3 + 4 = 7. 5 * 7 = 35.\n</think>", " 2 * 9 = 18"], [" 2 * 9 = 18. 18 + 7 = 25.\n</think>"]])
    explain = functools.partial(rlt.explain, sampler, teacher, tok, template="compact", max_prompt_len=512, temperature=1.0,
                                max_new_tokens=40, seed=0)
    path = str(tmp_path / "x.jsonl")
    rlt.export_traces(path, explain, scorer(teacher, student, tok, micro_batch=4), tasks, sols, 1, ROW, 0, redraws=redraws)
    rows = [json.loads(x) for x in open(path)]
    assert [r["nums"] for r in rows] == [[3, 4, 5], [2, 9, 7]][:exported]
    assert len(sampler.prompts) == redraws + 1
    if redraws:  # the second draw: task 2 alone
        assert sampler.prompts[1] == [D.teacher_prompt(tasks[1], sols[1], "compact")]
    stats = json.load(open(path + ".stats.json"))
    assert stats["closed_first_draw"] == 0.5 and stats["explanations"] == 2 + redraws


@pytest.mark.parametrize("kd_loss", ["forward", "reverse"])
def test_opd_kd_loss_flag_picks_the_kl_direction(kd_loss, ckpts, tmp_path, monkeypatch):
    """--kd_loss reverse reaches token_stats as kd_reverse (its values: test_common's naive check)."""
    seen = []
    real = opd.token_stats
    monkeypatch.setattr(opd, "token_stats", lambda *a, **k: seen.append(k.get("kd_reverse")) or real(*a, **k))
    opd.main(["--init", ckpts["student"], "--teacher", ckpts["teacher"], *FAST, "--max_steps", "1", "--kd_loss", kd_loss,
              "--output_dir", str(tmp_path)])
    assert seen and set(seen) == {kd_loss == "reverse"}


def test_rlt_export_only_with_zero_steps(ckpts, tmp_path):
    traces = tmp_path / "t.jsonl"
    r = subprocess.run([sys.executable, "rlt.py", "--init", ckpts["student"], "--student", ckpts["student"], *FAST,
                        "--max_steps", "0", "--export", str(traces), "--export_problems", "3", "--output_dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "of 3 problems" in r.stdout and traces.exists() and not (tmp_path / "config.json").exists()


def test_rlt_explains_solutions_the_traces_format_can_write():
    """The solver's first expression has a negative or fractional step for 7.5 % of the first 2,000
    embedded training problems, which no `a op b = v` line can write: the restricted solver's is
    explained instead, and a problem with no such solution is left out."""
    from plumbing.explanations import solved
    tasks = [{"nums": [1, 7, 18], "target": 24}, {"nums": [1, 5, 5, 5], "target": 24}, {"nums": [15, 9, 15], "target": 25}]
    assert solved(tasks) == [(tasks[0], "18 + (7 - 1)"), (tasks[2], "(15 * 15) / 9")]


@pytest.mark.parametrize("flags,budget", [([], 24), (["--export_max_new_tokens", "50"], 50)])
def test_export_budget_is_above_training_and_its_lengths_are_saved(flags, budget, ckpts, tmp_path, monkeypatch):
    """004 Table 4: the export's budget is twice the training budget (32,764 against 16,384) unless
    given; the balance and the training draw at the training budget (FAST: 12 tokens)."""
    seen, real = [], rlt.explain
    monkeypatch.setattr(rlt, "explain", lambda *a, **k: seen.append((len(a[3]) * a[5], k["max_new_tokens"])) or real(*a, **k))
    traces = tmp_path / "t.jsonl"
    rlt.main(["--init", ckpts["student"], "--student", ckpts["student"], *FAST, "--max_steps", "0", "--export", str(traces),
              "--export_problems", "3", "--export_best_of", "2", *flags, "--output_dir", str(tmp_path / "run")])
    assert seen[0] == (2 * 3, 12) and seen[-1] == (3 * 2, budget)  # balance: B x G; export: 3 problems x 2
    stats = json.load(open(str(traces) + ".stats.json"))
    assert stats["problems"] == 3 and stats["explanations"] == 6 and 0 <= stats["closed"] <= 1
    assert json.load(open(tmp_path / "run" / "balance.json"))["explanations"] == 6


def test_balance_is_measured_once_and_kept_by_a_resumed_run(tmp_path):
    from plumbing.explanations import balanced
    calls = []
    measure = lambda: calls.append(1) or (0.1, 20.0, {})  # noqa: E731
    run, init = tmp_path / "run", tmp_path / "init"
    init.mkdir()
    assert balanced(str(run), str(init), measure) == (0.1, 20.0) and len(calls) == 1
    assert balanced(str(run), str(init), lambda: (9, 9, {})) == (0.1, 20.0)  # resumed: the saved pair
    # exported from a trained teacher (--init its run, --max_steps 0): the pair it was trained with
    assert balanced(str(tmp_path / "export"), str(run), lambda: (9, 9, {})) == (0.1, 20.0)


@pytest.mark.parametrize("script,flags,message", [
    ("opd.py", ["--teacher", "OTHER"], "different tokenizers"),
    ("rlt.py", ["--student", "OTHER"], "different tokenizers"),
    ("opd.py", ["--teacher", "STUDENT", "--kd_temperature", "0"], "--kd_temperature must be positive"),
    ("opd.py", ["--teacher", "/nonexistent/teacher"], "no such checkpoint dir"),
    ("opd.py", ["--teacher", "STUDENT", "--kd_loss", "backward"], "--kd_loss must be forward or reverse"),
    ("opd.py", ["--teacher", "STUDENT", "--positive_weight", "-1"], "--positive_weight must be >= 0"),
    ("rloo.py", ["--positive_weight", "-0.1"], "--positive_weight must be >= 0"),
])
def test_bad_input_is_a_one_line_error(script, flags, message, ckpts, tmp_path):
    flags = [ckpts["other"] if f == "OTHER" else ckpts["student"] if f == "STUDENT" else f for f in flags]
    r = run_cli(script, "--init", ckpts["student"], *FAST, *flags, "--output_dir", str(tmp_path))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("script", ["rloo", "grpo", "opd", "rlt"])
def test_no_vocab_wide_graph_outlives_an_update(script, ckpts, tmp_path, monkeypatch):
    """A branch of the graph that the loss never reaches is never freed by backward: GRPO's and
    RLT's entropy, only logged, held two (N, V) tensors per chunk from one update into the next
    (63.4 GB at the peak of a walkthrough GRPO step on the H200, 21 of them this; docs/gpu.md).
    When a step ends, no tensor as wide as the vocabulary may still carry a graph."""
    import gc

    from plumbing import harness
    module = __import__(script)
    alive, log = [], harness.Run.log
    gc.collect()  # graphs an earlier test in this process left (gradient checkpointing's keeps a (252, V) one)
    before = {id(t) for t in gc.get_objects() if torch.is_tensor(t) and t.grad_fn is not None}

    def spy(run, *a, **kw):
        gc.collect()
        V = run.model.get_output_embeddings().weight.shape[0]
        alive.extend(tuple(t.shape) for t in gc.get_objects() if torch.is_tensor(t) and t.grad_fn is not None
                     and t.shape[-1:] == (V,) and id(t) not in before)
        return log(run, *a, **kw)
    monkeypatch.setattr(harness.Run, "log", spy)
    other = {"opd": ["--teacher", ckpts["teacher"]], "rlt": ["--student", ckpts["teacher"]]}.get(script, [])
    module.main(["--init", ckpts["student"], *other, *FAST[1:], "--max_steps", "1", "--output_dir", str(tmp_path)])
    assert alive == []


def test_export_verified_keeps_only_explanations_whose_steps_are_right(tmp_path):
    """--export_verified: r_SS checks no step, so an explanation that reaches the given solution
    through a wrong sum scores like a right one; the gate (traces.arithmetic) drops it."""
    teacher, tok = tiny_model(1)
    student, _ = tiny_model(0)
    tasks = [{"nums": [3, 4, 5], "target": 35}, {"nums": [2, 9, 7], "target": 25}]
    sols = ["(3 + 4) * 5", "2 * 9 + 7"]
    texts = [" 3 + 4 = 7. 5 * 7 = 35.\n</think>", " 3 + 4 = 8. 8 * 5 = 40.\n</think>",
             " 2 * 9 = 19. 19 + 7 = 26.\n</think>", " 2 * 9 = 17.\n</think>"]  # task 2: both wrong
    score_fn = scorer(teacher, student, tok, micro_batch=4)
    out = {}
    for verified in (False, True):
        explain = functools.partial(rlt.explain, ScriptedSampler(tok, texts, [True] * 4), teacher, tok, template="compact",
                                    max_prompt_len=512, temperature=1.0, max_new_tokens=40, seed=0)
        rlt.export_traces(str(tmp_path / f"{verified}.jsonl"), explain, score_fn, tasks, sols, 2, ROW, 0, verified)
        out[verified] = [json.loads(x) for x in open(tmp_path / f"{verified}.jsonl")]
    assert [r["nums"] for r in out[False]] == [[3, 4, 5], [2, 9, 7]]
    assert [r["nums"] for r in out[True]] == [[3, 4, 5]]
    assert out[True][0]["completion"] == D.student_completion(rlt.explanation_of(texts[0])[0], sols[0])
