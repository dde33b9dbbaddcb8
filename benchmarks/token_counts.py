"""What a completion costs in tokens, by tokenizer and trace format (docs/studies/tokenizer.md): the tiny
tokenizer (a Qwen2Tokenizer, plumbing/models.py) on the traces as written (plumbing/traces.py), against
the tiny tokenizer before it was a Qwen2Tokenizer (a BPE whose pre-tokenizer kept a digit's space with it:
" 2" one token, rebuilt below from the same corpus) on the format written for that one ('11 + 7 = 18,
left 7 18. 7 * 18 = 126.', a try a line), and the floor any tokenizer Qwen2Tokenizer rebuilds has on a
text (the pieces of Qwen2's pre-tokenizer: Qwen2.5 itself pays at least that).

    python benchmarks/token_counts.py [--samples DIR/samples.jsonl ...]

Without --samples: 800 traces of the SFT stage's source (run_cpu.sh's strategy mix, dead ends and near
misses; half with its mistakes) and the 200 test problems' prompt + clean trace. With --samples: the
completions of evaluate.py's samples.jsonl files, as written (a model of the current format).
"""
import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # noqa: E402

import verifier  # noqa: E402
from plumbing import tasks as D  # noqa: E402
from plumbing import traces as TR  # noqa: E402
from plumbing.models import build_tiny_tokenizer  # noqa: E402

DATA = "gen:nums=3,range=1-20,test=200,val=100"
MIX, MISTAKES = {"random": 0.7, "backward": 0.3}, D.LLM_MISTAKES  # run_cpu.sh's SFT source


def spaced(text):
    """A trace of today's format in the format written before: spaces around the operators and
    '=', ', ' between a subgoal's results, a try's steps on one line (joined by '. ')."""
    lines, out = text.split("\n"), []
    for line in lines:
        line = re.sub(r"(?<=[\d)])([-+*/=])(?=[\d(])", r" \1 ", line)
        line = re.sub(r",(?=\d)", ", ", line)
        if out and out[-1].endswith(".") and not re.search(r"(back|found)\.$", out[-1]) \
                and not out[-1].startswith("</"):
            out[-1] += " " + line
        else:
            out.append(line)
    return " " + "\n".join(out)


def old_tokenizer(vocab_size=384):
    """The tiny tokenizer before: a digit a token *with its leading space*, then GPT-2's byte-level
    split; trained on the same corpus in the format written for it."""
    rng, corpus = random.Random(0), []
    for task in verifier.generate_splits({"x": 100}, seed=12345, num_range=(1, 25),
                                         target_range=(1, 200), balanced=False)["x"]:
        for template in verifier.TEMPLATES:
            corpus.append(verifier.make_prompt(task["nums"], task["target"], template)
                          + spaced(TR.make_trace(task["nums"], task["target"], rng, 2.0)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r" ?[0-9]"), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(["<think>", "</think>", "<answer>", "</answer>"])
    return tok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", nargs="*", default=[])
    a = p.parse_args()
    new, old = build_tiny_tokenizer(), old_tokenizer()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), "isolated")
    ours = lambda x: len(new(x, add_special_tokens=False).input_ids)  # noqa: E731
    before = lambda x: len(old.encode(x, add_special_tokens=False).ids)  # noqa: E731
    pieces = lambda x: len(split.pre_tokenize_str(x))  # noqa: E731
    same = lambda x: x  # noqa: E731
    # (label, counter, the completion's format); a prompt is counted as it is
    rows = [("the tokenizer before, the format before", before, spaced),
            ("Qwen2's pieces, the format before", pieces, spaced),
            ("tiny Qwen2Tokenizer, this format", ours, same),
            ("Qwen2's pieces (Qwen2.5's floor), this format", pieces, same)]
    sets = {}
    if a.samples:
        for path in a.samples:
            sets[path] = [("", c) for line in open(path) for c in json.loads(line)["completions"]]
    else:
        tasks = D.load_tasks(DATA, "test")
        mistakes = TR.parse_mix(MISTAKES, TR.MISTAKES, rates=True)
        texts = []
        for seed in range(4):
            rng = random.Random(seed)
            texts += [("", TR.make_trace(t["nums"], t["target"], rng, 1, 0.5, MIX,
                                         mistakes if seed % 2 else None)) for t in tasks]
        sets["800 traces of the SFT source"] = texts
        rng = random.Random(0)
        sets["200 test prompts + clean trace"] = [
            (verifier.make_prompt(t["nums"], t["target"], "compact"),
             TR.make_trace(t["nums"], t["target"], rng, 1, 0.5, MIX)) for t in tasks]
    for name, texts in sets.items():
        print(f"\n{name}: {len(texts)} texts; tokens a text, and x the tokenizer before")
        ref = None
        for label, n_of, fmt in rows:
            n = sum(n_of(pr) + n_of(fmt(c)) for pr, c in texts) / len(texts)
            ref = ref or n
            print(f"  {label:48s} {n:7.1f}  {n / ref:.3f}x")


if __name__ == "__main__":
    main()
