import functools
import json
import os
import random

import pytest
import torch
from conftest import GEN, ROOT, run_cli
from test_graded import check_ipo_loss, check_rpo_nll, check_sequence_logp, check_sft_loss

from plumbing import flags as C
from plumbing import tasks as D
import ipo
import common as LP
from plumbing import harness as loop
from plumbing import models as M
import sft
from plumbing import traces as TR
import verifier as V

FAST = ["--data", GEN, "--eval_data", GEN, "--template", "compact", "--eval_problems", "4", "--eval_samples", "2",
        "--eval_max_new_tokens", "8", "--micro_batch", "4"]


def run(script, *args):
    return run_cli(script, *args)  # in this process: no interpreter to start


def test_sft_loss_counts_response_tokens_only():
    check_sft_loss(sft.sft_loss)  # the graded exercise's check (tests/test_graded.py)


def test_ipo_loss_hand_computed():
    check_ipo_loss(ipo.ipo_loss)


def test_length_norm_and_rpo_anchor():
    check_sequence_logp(ipo.sequence_logp)
    check_rpo_nll(ipo.rpo_nll)


def test_solver_pairs_are_verified_and_hard():
    pairs, report = ipo.build_pairs("solver", GEN, 20, "compact", None, 8, 1.0, 64, "any", 0)
    tasks = D.load_tasks(GEN, "train", 20)
    assert len(pairs) >= 18 and "solver pairs" in report
    for (p, chosen, rejected), t in zip(pairs, tasks):
        assert V.score(chosen, t["nums"], t["target"]) == 1.0 and V.score(rejected, t["nums"], t["target"]) == 0.1
        # same trace, other answer
        assert chosen.split("<answer>")[0] == rejected.split("<answer>")[0]


@pytest.fixture(scope="module")
def sft_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    r = run("sft.py", "--init", "tiny", *FAST, "--batch_size", "8", "--max_steps", "2", "--lr", "1e-3",
            "--output_dir", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_sft_two_steps_writes_a_checkpoint(sft_ckpt):
    assert {"config.json", "model.safetensors", "tokenizer.json", "args.json", "metrics.jsonl"} <= set(os.listdir(sft_ckpt))
    rows = [json.loads(x) for x in open(sft_ckpt / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert {"train/loss", "train/token_acc", "train/lr", "train/grad_norm", "time/tokens_per_s", "eval/loss",
            "eval/pass@1", "eval/pass@2"} <= set(rows[-1])


def test_ipo_chains_from_sft_and_keeps_the_reference_frozen(sft_ckpt, tmp_path):
    init, _ = M.load_model(str(sft_ckpt))
    model, ref = ipo.main(["--init", str(sft_ckpt), *FAST, "--pairs", "solver", "--num_prompts", "16", "--batch_size", "8",
                           "--lr", "1e-3", "--heldout", "0.25", "--output_dir", str(tmp_path / "ipo")])
    for (name, p0), p_ref, p in zip(init.named_parameters(), ref.parameters(), model.parameters()):
        assert torch.equal(p0, p_ref), name
    assert any(not torch.equal(p0, p) for p0, p in zip(init.parameters(), model.parameters()))
    rows = [json.loads(x) for x in open(tmp_path / "ipo" / "metrics.jsonl")]
    assert rows[0]["step"] == 0 and rows[0]["eval/pref_acc"] == 0.5 and rows[0]["eval/margin"] == 0.0
    assert {"train/loss", "train/pref_acc", "train/margin", "train/chosen_delta", "train/rejected_delta"} <= set(rows[-1])
    assert os.path.isfile(tmp_path / "ipo" / "config.json")


def test_ipo_onpolicy_subprocess(sft_ckpt, tmp_path):
    r = run("ipo.py", "--init", str(sft_ckpt), *FAST, "--num_prompts", "8", "--group_size", "2", "--max_new_tokens", "4",
            "--output_dir", str(tmp_path / "ipo"))
    # a 2-step SFT model never solves anything, so on-policy pairing must say so clearly
    assert r.returncode == 2 and "no training pairs (0 on-policy pairs from 8 prompts x 2 samples)" in r.stderr


def test_clear_errors_for_datasets_without_expected_fields(sft_ckpt, tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "p", "chosen": "c"}\n')
    r = run("ipo.py", "--init", str(sft_ckpt), *FAST, "--pairs", str(bad), "--output_dir", str(tmp_path / "x"))
    assert r.returncode == 2 and "pairs.jsonl:1: missing field(s) ['rejected']" in r.stderr
    bad.write_text('{"prompt": "p", "response": "c"}\n')
    r = run("sft.py", "--init", "tiny", "--data", str(bad), "--output_dir", str(tmp_path / "y"))
    assert r.returncode == 2 and "missing field(s) ['query', 'completion']" in r.stderr
    r = run("sft.py", "--init", "tiny", *FAST, "--batch_size", "6", "--micro_batch", "4", "--output_dir", str(tmp_path / "z"))
    assert r.returncode == 2 and "not a multiple" in r.stderr


def test_sft_on_a_query_completion_file(tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    tasks = D.load_tasks(GEN, "train", 20)
    data.write_text("".join(json.dumps({"query": D.make_prompt(t["nums"], t["target"], "compact"),
                                        "completion": TR.make_trace(t["nums"], t["target"])}) + "\n" for t in tasks))
    model = sft.main(["--init", "tiny", "--data", str(data), "--eval_data", GEN, "--template", "compact", "--batch_size", "4",
                      "--micro_batch", "2", "--max_steps", "1", "--eval_problems", "2", "--eval_samples", "1",
                      "--eval_max_new_tokens", "4", "--output_dir", str(tmp_path / "out")])
    assert model is not None and os.path.isfile(tmp_path / "out" / "model.safetensors")
    # a file's last rows (here 2) are held out
    assert "18 training examples" in capsys.readouterr().out
    args = sft.parse_args(sft.Args, ["--data", str(data), "--template", "compact", "--eval_problems", "2",
                                     "--num_train", "5"])
    prompts, write = D.sft_data(args.data, "train", args.num_train, args.template, args.eval_problems)   # --num_train keeps a file's first rows
    assert prompts == [json.loads(x)["query"] for x in data.read_text().splitlines()[:5]] and len(write(None)) == 5


def test_sft_compile_flag_compiles_the_forward_and_saves_a_plain_checkpoint(tmp_path, monkeypatch):
    """sft.py --compile (run_cpu.sh's sft and teacher stages) trains through the compiled decoder
    and saves the ordinary checkpoint the next stage loads; the RL scripts refuse the flag. The
    CPU is taken for one where it pays (harness.compile_pays), so that it compiles on either kind."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(loop, "compile_pays", lambda device: True)
    counters.clear()
    model = sft.main(["--init", "tiny", "--tiny_hidden", "32", "--tiny_layers", "1", *FAST, "--batch_size", "4",
                      "--micro_batch", "2", "--max_steps", "1", "--compile", "--output_dir", str(tmp_path / "c")])
    assert counters["stats"]["unique_graphs"] >= 1
    again, _ = M.load_model(str(tmp_path / "c"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    r = run("rloo.py", "--compile")
    assert r.returncode == 2 and "unrecognized arguments: --compile" in r.stderr


def test_base_stage_trains_on_plain_arithmetic(tmp_path):
    """--data arith:...: no prompt, the whole text is the target; fresh random paths each epoch; the
    run's held-out check is eval/loss (a base model writes no answers to sample pass@k from)."""
    args = sft.parse_args(sft.Args, ["--data", "arith:nums=3,range=1-20,test=5,val=5"])
    prompts, write = D.sft_data(args.data, "train", 30, args.template, args.eval_problems)
    a, b = write(random.Random(1)), write(random.Random(2))
    assert prompts == [""] * 30 and a != b and all("=" in x and "Target" not in x for x in a)
    _, _, mask = LP.tokenize_pairs(M.build_tiny_tokenizer(), prompts[:2], a[:2])
    assert mask[:, 0].all()  # every token is a target (the first one conditions the rest)
    sft.main(["--init", "tiny", "--data", "arith:nums=3,range=1-20,test=5,val=5", "--eval_data", GEN,
              "--batch_size", "4", "--micro_batch", "4", "--max_steps", "2", "--num_train", "20", "--eval_problems", "4",
              "--output_dir", str(tmp_path / "base")])
    last = [json.loads(x) for x in open(tmp_path / "base" / "metrics.jsonl")][-1]
    assert "eval/loss" in last and "eval/pass@1" not in last


def test_generated_traces_are_new_each_epoch_unless_fixed():
    data = functools.partial(D.sft_data, "gen:nums=3,range=1-20,test=5,val=5", "train", 50, "base", 5, dead_ends=3)
    prompts, write = data()
    a, b = write(random.Random(1)), write(random.Random(2))
    assert len(prompts) == len(a) == 50 and a != b  # another solution path, other dead ends
    _, write = data(fixed_traces=True)
    assert write(random.Random(1)) == write(random.Random(2))    # one dataset for the whole run


def test_micro_batches_are_bounded_by_tokens_not_only_rows():
    """64 of the longest SFT rows (~1,000 tokens each) under autocast ran out of memory: a
    micro-batch also holds at most --micro_batch_tokens padded tokens, so long rows go fewer at a
    time, short ones up to --micro_batch. Every row once, in length order."""
    assert LP.spans([2, 3, 3, 5, 9, 9, 9, 20], 4) == [(0, 4), (4, 8)]
    assert LP.spans([2, 3, 3, 5, 9, 9, 9, 20], 4, 18) == [(0, 3), (3, 5), (5, 7), (7, 8)]  # 4 x 5 > 18
    tok = M.build_tiny_tokenizer()
    rng = random.Random(0)
    responses = ["1+2=3." * rng.randint(1, 30) for _ in range(40)]  # the traces' steps
    prompts = [D.make_prompt([1, 2, 3], 6, "compact")] * 40
    mbs = list(sft.micro_batches(tok, prompts, responses, 16, 512, 1024, "cpu", max_tokens=2000))
    assert sum(len(ids) for ids, _, _ in mbs) == 40 and len(mbs) > 40 // 16 + 1
    assert all(ids.numel() <= 2000 or len(ids) == 1 for ids, _, _ in mbs)
    assert max(len(ids) for ids, _, _ in mbs) == 16  # the short rows still go 16 at a time
    unbounded = list(sft.micro_batches(tok, prompts, responses, 16, 512, 1024, "cpu"))
    assert [len(ids) for ids, _, _ in unbounded] == [16, 16, 8]


def test_a_partial_last_batch_counts_and_keeps_the_warmup(tmp_path, capsys):
    """18 rows at batch 4 are 5 steps an epoch, not 4; a warm-up fraction of a few steps is at
    least one step (int() made 0.05 x 5 none), so step 1 trains at lr 0 and step 2 at the peak."""
    data = tmp_path / "sft.jsonl"
    tasks = D.load_tasks(GEN, "train", 20)
    data.write_text("".join(json.dumps({"query": D.make_prompt(t["nums"], t["target"], "compact"),
                                        "completion": TR.make_trace(t["nums"], t["target"])}) + "\n" for t in tasks))
    sft.main(["--init", "tiny", "--data", str(data), "--eval_data", GEN, "--template", "compact", "--batch_size", "4",
              "--micro_batch", "2", "--epochs", "1", "--eval_problems", "2", "--eval_samples", "1", "--eval_every", "0",
              "--eval_max_new_tokens", "4", "--lr", "1e-3", "--output_dir", str(tmp_path / "out")])
    assert "18 training examples, 5 steps/epoch, 5 steps" in capsys.readouterr().out
    rows = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["train/lr"] == pytest.approx(1e-3)  # logged after the step: step 2's, the peak


def test_a_dataset_prompt_that_is_not_the_template_is_one_line(tmp_path):
    """RL and evaluation build prompts from TEMPLATES; SFT took a dataset's `query` verbatim. A query
    that differs is one line naming it, or, with --rebuild_prompts, rebuilt from its numbers and
    target on purpose."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"query": D.make_prompt(n, t, "base"), "completion": " done"}) + "\n"
                            for n, t in [([1, 2, 3], 6), ([4, 5, 6], 15)]))
    with pytest.raises(C.CountdownError, match="query 1 differs from the --template compact prompt") as e:
        D.sft_data(str(data), "train", 0, "compact", 0)
    assert "\n" not in str(e.value)
    assert D.sft_data(str(data), "train", 0, "base", 0)[0] == [D.make_prompt([1, 2, 3], 6, "base"),
                                                                  D.make_prompt([4, 5, 6], 15, "base")]
    prompts, _ = D.sft_data(str(data), "train", 0, "compact", 0, rebuild=True)
    assert prompts == [D.make_prompt([1, 2, 3], 6, "compact"), D.make_prompt([4, 5, 6], 15, "compact")]
    data.write_text(json.dumps({"query": "Solve 1 2 3 to make 6", "completion": " done"}) + "\n")
    with pytest.raises(C.CountdownError, match="query 1 names no numbers and target"):
        D.sft_data(str(data), "train", 0, "compact", 0, rebuild=True)
    r = run("sft.py", "--init", "tiny", "--data", str(data), "--output_dir", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.count("error: ") == 1 and "Traceback" not in r.stderr


def test_problems_keeps_the_queries_every_file_trains_on(tmp_path):
    """--problems: students of different sources train on the same problems (004 §4), a file's
    held-out tail left out as sft_data leaves it out, each kept prompt with its own response."""
    tasks = D.load_tasks(GEN, "train", 30)
    q = [D.make_prompt(t["nums"], t["target"], "compact") for t in tasks]
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    D.write_jsonl(a, [{"query": x, "completion": "A"} for x in q[:20]])  # trains on q[:18]: 2 held out
    D.write_jsonl(b, [{"query": x, "completion": "B"} for x in q[5:30]])  # on q[5:28]
    common = D.common_queries([a, b], eval_problems=100)
    assert common == set(q[5:18])
    prompts, write = D.sft_data(GEN, "train", 30, "compact", 100, mistakes=None)
    kept, responses = D.only_problems(prompts, write, common)
    assert kept == q[5:18]
    assert all(V.score(r, t["nums"], t["target"]) == 1.0 for r, t in zip(responses(random.Random(0)), tasks[5:18]))
    kept, responses = D.only_problems(*D.sft_data(b, "train", None, "compact", 100), common)
    assert kept == q[5:18] and responses(None) == ["B"] * 13
    with pytest.raises(C.CountdownError, match="--problems"):
        D.only_problems(prompts, write, {"no such prompt"})
