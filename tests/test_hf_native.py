"""The checkpoints the repo writes and ships are Hugging Face checkpoints: transformers' own
`AutoTokenizer` loads their tokenizer as trained (transformers 5 gives a `qwen2` config a
`Qwen2Tokenizer`, which rebuilds Qwen2's pre-tokenizer whatever tokenizer.json says), and
`AutoModelForCausalLM` + greedy `generate` writes what the repo's sampler writes. A tokenizer that
only the repo's loader reads right loads elsewhere without an error and reads every number wrong."""
import json
import os
import random

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import common as C
import verifier as V
from plumbing import models as M
from plumbing import tasks as D
from plumbing import traces as TR
from plumbing.flags import CountdownError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = [os.path.join(ROOT, "pretrained", n)
           for n in ("tiny-base", "tiny-teacher", "tiny-base-3to4", "tiny-teacher-3to4")]


def task_corpus():
    """The task's text in every form a script writes or a model reads: each template's prompt over
    3 and 4 numbers, traces of both strategies with and without each mistake (their answers too),
    the base stage's arithmetic, RLT's teacher and student formats, and text no trace has."""
    rng, out = random.Random(7), []
    problems = (D.load_tasks("gen:nums=3,range=1-20,test=200,val=100", "test", 40)
                + D.load_tasks("gen:nums=3-4,range=1-99,target=10-999", "val", 40))
    for i, t in enumerate(problems):
        nums, target = t["nums"], t["target"]
        for template in V.TEMPLATES:
            out.append(V.make_prompt(nums, target, template))
        mix = {"random": 0.5, "backward": 0.5}
        kind = TR.MISTAKES[i % len(TR.MISTAKES)]
        for mistakes in (None, {kind: 1.0}):
            trace = TR.make_trace(nums, target, rng, 1, 0.5, mix, mistakes)
            if trace:
                out += [trace, V.make_prompt(nums, target, "compact") + trace + "<|endoftext|>",
                        f"<answer>{V.extract_answer(trace)}</answer>"]
        out.append(TR.arith_text([nums], rng))
        if (solution := V.solve(nums, target)):
            out += [D.teacher_prompt(t, solution, "compact"), D.student_prompt(t, "compact"),
                    D.student_completion(" a step.\n", solution)]
    out += ["<answer> 123 / (4-5) </answer>\n\t ünïcode ✓ \x00", "  two  spaces,\n\nand lines ",
            "9 * 2 = 18, left 13 18. 13 + 18 = 31. Target 31, found."]  # the old format reads too
    return out


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    M.build_tiny_tokenizer().save_pretrained(d)
    return d


def test_auto_tokenizer_loads_the_tiny_tokenizer_as_built(saved_tiny):
    """The tokenizer --init tiny builds, saved, then loaded as every outside tool loads it: the same
    class, vocabulary, special tokens and ids on the whole corpus (and decoding gives the text
    back), as tokenizers' own reading of the saved tokenizer.json."""
    built, auto = M.build_tiny_tokenizer(), AutoTokenizer.from_pretrained(saved_tiny)
    raw = Tokenizer.from_file(os.path.join(saved_tiny, "tokenizer.json"))
    assert type(auto).__name__ == "Qwen2Tokenizer" == type(built).__name__
    assert auto.get_vocab() == built.get_vocab() and len(auto) == len(built)
    assert (auto.eos_token, auto.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert auto.pad_token_id != auto.eos_token_id
    corpus = task_corpus()
    assert len(corpus) > 500
    for text in corpus:
        ids = built(text, add_special_tokens=False).input_ids
        assert auto(text, add_special_tokens=False).input_ids == ids, text
        assert raw.encode(text, add_special_tokens=False).ids == ids, text
        assert auto.decode(ids) == text
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(auto(tag, add_special_tokens=False).input_ids) == 1


def test_digits_split_as_in_qwen2_5():
    """The tokenizer the repo trains with cuts as Qwen2's pre-tokenizer does: a digit a token, a
    space before a digit a token of its own."""
    tok = M.build_tiny_tokenizer()
    pieces = tok.convert_ids_to_tokens(tok("11+7=18, left 7 18.", add_special_tokens=False).input_ids)
    assert pieces[:6] == ["1", "1", "+", "7", "=", "1"] and pieces[-4:] == ["Ġ", "1", "8", "."]


@pytest.mark.parametrize("ckpt", SHIPPED, ids=os.path.basename)
def test_shipped_checkpoints_read_as_trained(ckpt):
    """Each shipped model: AutoTokenizer gives the ids of the tokenizer.json it was trained with, on
    the whole corpus, and the repo's loader gives the same tokenizer."""
    auto = AutoTokenizer.from_pretrained(ckpt)
    raw = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    _, ours = M.load_model(ckpt)
    assert type(auto).__name__ == "Qwen2Tokenizer" and ours.get_vocab() == auto.get_vocab()
    for text in task_corpus()[::3]:
        assert auto(text, add_special_tokens=False).input_ids == raw.encode(
            text, add_special_tokens=False).ids, text


def test_generate_writes_what_the_repos_sampler_writes():
    """The shipped teacher as a transformers user runs it (AutoTokenizer, AutoModelForCausalLM,
    greedy `generate`) and through the repo (load_model, the plain HF sampler at top_k 1): the same
    tokens, and answers that score."""
    ckpt = os.path.join(ROOT, "pretrained", "tiny-teacher")
    tok, model = AutoTokenizer.from_pretrained(ckpt), AutoModelForCausalLM.from_pretrained(ckpt)
    ours, our_tok = M.load_model(ckpt)
    sampler = C.HFSampler(ours, our_tok, decode="plain")
    tasks = D.load_tasks("gen:nums=3,range=1-20,test=200,val=100", "test", 6)
    prompts = [V.make_prompt(t["nums"], t["target"], "compact") for t in tasks]
    ro = sampler.generate(prompts, n=1, temperature=1.0, top_k=1, max_new_tokens=96)
    scores = []
    for p, ids, text, t in zip(prompts, ro.completion_ids, ro.texts, tasks):
        enc = tok(p, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=96,
                                 pad_token_id=tok.pad_token_id)
        theirs = out[0, enc.input_ids.shape[1]:].tolist()
        assert theirs == list(ids), (p, tok.decode(theirs), text)
        scores.append(V.score(tok.decode(theirs, skip_special_tokens=True), t["nums"], t["target"]))
    assert sum(s == 1.0 for s in scores) >= 2, scores  # the teacher solves, read by their tools


def test_a_checkpoint_autotokenizer_reads_otherwise_stops_in_one_line(tmp_path, saved_tiny):
    """A checkpoint whose tokenizer.json AutoTokenizer would rebuild otherwise (the repo's tiny
    tokenizer before it was a Qwen2Tokenizer: ' 2' one token, so a prompt of 34 ids became 37) is
    refused with one line, not loaded to read every number wrong."""
    from tokenizers import Regex, pre_tokenizers
    d = str(tmp_path / "old")
    os.makedirs(d)
    raw = Tokenizer.from_file(os.path.join(saved_tiny, "tokenizer.json"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?[0-9]"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>",
                            pad_token="<|pad|>").save_pretrained(d)
    model = M.build_tiny_model(M.build_tiny_tokenizer())
    model.save_pretrained(d)
    assert json.load(open(os.path.join(d, "config.json")))["model_type"] == "qwen2"
    with pytest.raises(CountdownError, match="AutoTokenizer.*retrain"):
        M.load_model(d)
    # a script says it in one line, exit 2, no traceback
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "evaluate.py", "--model", d, "--num_problems", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")][0].endswith(
        "(./run_cpu.sh --force)")
    # the shipped format loads
    M.build_tiny_tokenizer().save_pretrained(d)
    M.load_model(d)


def test_traces_cost_at_most_1_05x_the_tokens_of_the_tokenizer_before():
    """The trace format is chosen for this tokenizer (plumbing/traces.py, _steps_text): 800 traces of
    the SFT stage's source (its strategy mix, dead ends and near misses, half with its mistakes) may
    cost at most 1.05x the tokens they cost under the tiny tokenizer before it was a Qwen2Tokenizer,
    in the format written for that one (both rebuilt by benchmarks/token_counts.py: 83.8 a trace,
    now 87.4). Written with spaces as before, Qwen2's pre-tokenizer makes 1.26x."""
    from benchmarks import token_counts as TC
    tok, old = M.build_tiny_tokenizer(), TC.old_tokenizer()
    tasks = D.load_tasks(TC.DATA, "test")
    mistakes = TR.parse_mix(TC.MISTAKES, TR.MISTAKES, rates=True)
    texts = []
    for seed in range(4):
        rng = random.Random(seed)
        texts += [TR.make_trace(t["nums"], t["target"], rng, 1, 0.5, TC.MIX, mistakes if seed % 2 else None)
                  for t in tasks]
    now = sum(len(tok(x, add_special_tokens=False).input_ids) for x in texts) / len(texts)
    before = sum(len(old.encode(TC.spaced(x), add_special_tokens=False).ids) for x in texts) / len(texts)
    assert abs(before - 83.8) < 0.05 and now <= 1.05 * before, (now, before)
