"""Models and tokenizers: a hub name, a checkpoint dir, or `tiny`, the embedded Qwen2 (0.84M
parameters) and its byte-level BPE tokenizer trained on the task's own text; and the precision a
training forward computes in on this device."""
import contextlib
import functools
import inspect
import json
import os
import random
import re

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

import verifier
from plumbing import traces
from plumbing.flags import CountdownError
from plumbing.tasks import check_hub
from verifier import TEMPLATES, make_prompt


# ---- the precision a training forward computes in (common.autocast applies it) ----------------
def device_and_dtype():
    """bf16 on a GPU (what the papers trained in), fp32 on CPU (sampling and inference stay fp32
    there)."""
    return ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def cpu_bf16():
    """Whether training forwards on this CPU compute in bf16: COUNTDOWN_CPU_BF16=0 or 1, which
    run_cpu.sh sets for each stage to the precision it measured faster here for that stage's kind
    of step (plumbing/machine.py); unset (a script run by hand), yes where the CPU has native bf16
    dot products (AVX512-BF16 or AMX), elsewhere emulated and 10x slower. Native is not always
    faster: on a 2-core Xeon with AMX the SFT stage's step was slower in bf16 (0.72-0.78 s against
    fp32's 0.44-0.47), its RL updates faster (docs/studies/performance.md)."""
    if os.environ.get("COUNTDOWN_CPU_BF16") in ("0", "1"):
        return os.environ["COUNTDOWN_CPU_BF16"] == "1"
    return any(
        getattr(torch.cpu, f, lambda: False)()
        for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def trains_in_bf16(device):
    """Whether training forwards on `device` compute in bf16 (common.autocast): on a GPU always,
    on a CPU where cpu_bf16(). Every script records it in args.json as `train_compute`."""
    return device == "cuda" or cpu_bf16()


# ---- models and tokenizers -----------------------------------------------------------------------
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=384, max_position_embeddings=1024)


@functools.lru_cache(maxsize=1)
def build_tiny_tokenizer(vocab_size=384):
    """Qwen2.5's tokenizer in miniature: a byte-level BPE (exact round trip for any text) trained on
    the task's own text under Qwen2's own normalizer and pre-tokenizer (a digit is a token, as in
    Qwen2.5), the four tags as tokens of their own. It is a `Qwen2Tokenizer` because transformers 5
    gives any `qwen2` config that class, whatever tokenizer_config.json names, and the class rebuilds
    its pre-tokenizer from Qwen2's regex: a tokenizer of any other pre-tokenizer would load through
    `AutoTokenizer` re-split, and a checkpoint would sample garbage in every tool but ours (TRL,
    vLLM with text prompts, lm-eval, `pipeline`). This one reloads as itself (tests/test_hf_native.py).
    Deterministic."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    rng, corpus = random.Random(0), []
    for task in verifier.generate_splits({"x": 100}, seed=12345, num_range=(1, 25),
                                         target_range=(1, 200), balanced=False)["x"]:
        for template in TEMPLATES:
            corpus.append(
                make_prompt(task["nums"], task["target"], template)
                + traces.make_trace(task["nums"], task["target"], rng, 2.0))
    tok = Tokenizer(models.BPE())
    qwen2 = Qwen2Tokenizer()._tokenizer  # the class's normalizer (NFC) and pre-tokenizer, as it builds them
    tok.normalizer, tok.pre_tokenizer, tok.decoder = qwen2.normalizer, qwen2.pre_tokenizer, qwen2.decoder
    specials = ["<|endoftext|>", "<|pad|>"]
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe = json.loads(tok.to_str())["model"]
    # pad != eos on purpose: a mask built from `ids != pad` would then never drop the real EOS.
    out = Qwen2Tokenizer(vocab=bpe["vocab"], merges=[tuple(m) for m in bpe["merges"]],
                         eos_token="<|endoftext|>", pad_token="<|pad|>", unk_token=None)
    out.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>", "<answer>", "</answer>")])
    return out


def build_tiny_model(tokenizer, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None, **{**TINY, **overrides})
    return Qwen2ForCausalLM(cfg)


STAGES = ("sft", "ipo", "rloo", "grpo", "opd", "rlt")  # a folder named so is a run's output_dir


def looks_local(name):
    """A name the user meant as a folder, not a hub id (`out/sft` has a hub id's shape)."""
    return (name.startswith(("out/", "./", "../", "/", "~")) or os.path.isdir(name.split("/")[0])
            or os.path.basename(name.rstrip("/")) in STAGES)


def load_model(name, device="cpu", dtype=torch.float32, **tiny_overrides):
    """(model, tokenizer) from `tiny` (new, from scratch), a checkpoint dir, or a hub name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging
    # one console line per step: no "Loading weights" bars in between
    logging.disable_progress_bar()
    if name == "tiny":
        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(tokenizer, **tiny_overrides).to(device, dtype), tokenizer
    if os.path.exists(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise CountdownError(f"{name} is not a checkpoint dir (no config.json): pass the "
                                 "--output_dir of a finished run")
    elif not re.fullmatch(r"[\w.-]+/[\w.-]+", name) or looks_local(name):
        stage = os.path.basename(name.rstrip("/"))
        maker = (f"`python {stage}.py ... --output_dir {name}` makes it (the {stage} stage; "
                 f"./run_cpu.sh makes out/cpu/{stage})" if stage in STAGES else
                 "pass the --output_dir of a finished run")
        raise CountdownError(f"no such checkpoint dir: {name}; {maker}")
    hint = "" if os.path.exists(name) else (" The embedded alternative needs no hub: the model "
                                            "`tiny`, e.g. sft.py --init tiny (see README)")
    if hint:
        check_hub(f"model '{name}'", hint)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        check_reads_as_saved(tokenizer, name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    except OSError as e:
        raise CountdownError(f"could not load {name}: {e}{hint}") from None
    if tokenizer.pad_token is None:
        # Qwen base: pad == eos, so masks come from lengths
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


PROBE = make_prompt([9, 2, 13], 31, "compact") + "9*2=18, left 13 18.\n13+18=31. Target 31, found.\n" \
    "</think>\n<answer>13 + 9 * 2</answer>"


def check_reads_as_saved(tokenizer, name):
    """One line, not garbage, where the tokenizer AutoTokenizer gives differs from the one saved in
    NAME/tokenizer.json: transformers 5 rebuilds a `qwen2` config's tokenizer with Qwen2's
    pre-tokenizer, so a checkpoint saved with another (this repo's before its tokenizer was a
    Qwen2Tokenizer) would load without an error and read every number wrong."""
    from tokenizers import Tokenizer
    path = os.path.join(name, "tokenizer.json")
    if not os.path.isfile(path):
        return
    saved = Tokenizer.from_file(path).encode(PROBE, add_special_tokens=False).ids
    if tokenizer(PROBE, add_special_tokens=False).input_ids != saved:
        raise CountdownError(
            f"{name}'s tokenizer.json splits text otherwise than transformers' AutoTokenizer "
            f"({type(tokenizer).__name__}) rebuilds it, so every tool would read this checkpoint "
            "wrong; it was written with an earlier tiny tokenizer: retrain it from this repo's "
            "pretrained/ models (./run_cpu.sh --force)")


def cache_name(model):
    """The KV cache's argument and output name: `cache` since transformers 5.x renamed
    `past_key_values` (gone in 5.40)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's: kwargs
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else \
        "past_key_values"


def causal_only(attention_mask):
    """None where every row is right-padded (ones, then zeros), as common.pack() builds them: a
    causal model's real tokens then attend only to earlier positions, all real, and the padding's
    outputs are never read, so the causal mask alone gives the same values, and the attention
    builds no (B, 1, T, T) padding mask (one SFT step 0.52 s instead of 0.61). Left padding (RLT's
    teacher contexts) keeps its mask."""
    right_padded = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    return None if right_padded else attention_mask


@contextlib.contextmanager
def cpu_attention_on(device, models):
    """common.autocast's attention: on a CPU the `models` (None left out) run cpu_attention below,
    in bf16 grouped eager scores (torch's fused kernel's bf16 backward took 4x as long), in fp32
    that kernel without transformers' copy of the keys per head; each model's own after. OPD's
    teacher, left out, keeps transformers' own; a reference is listed, to equal the policy."""
    models = [m for m in models if m is not None] if device == "cpu" else []
    before = [m.config._attn_implementation for m in models]
    try:
        for m in models:
            m.set_attn_implementation("cpu_attention")
        yield
    finally:
        for m, impl in zip(models, before):
            m.set_attn_implementation(impl)


def cpu_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The attention a CPU trains fastest with, registered under its name (common.autocast sets
    it). In fp32, torch's fused kernel, each KV head serving its query heads inside it (no copy of
    the keys per head, as transformers' sdpa makes): three GRPO-shaped updates side by side on two
    cores took 0.90-0.96x as long as with the eager scores below, the old hand-written shared
    forward's time (docs/studies/performance.md). In bf16, transformers' eager attention laid out
    as the CPU runs it fastest: each KV head's g query heads as g·T rows of one matmul, the mask
    added inside it, the softmax over the bf16 scores (torch's CPU kernel sums in fp32), not over
    an fp32 copy each way; the fused kernel's bf16 backward took 4x as long. query (b, H, T, d),
    key and value (b, Hkv, S, d), attention_mask (b, 1, T, S): bool in fp32 (None: causal
    alone), -inf or 0 in bf16."""
    if not torch.is_autocast_enabled("cpu"):
        out = F.scaled_dot_product_attention(query, key, value, attention_mask, scale=scaling,
                                             is_causal=attention_mask is None, enable_gqa=True)
        return out.transpose(1, 2), None                                            # (b, T, H, d)
    b, H, T, d = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    q = query.reshape(b * Hkv, H // Hkv * T, d)                              # (b·Hkv, g·T, d)
    mask = attention_mask[:, :, None].expand(b, Hkv, H // Hkv, T, S).reshape(b * Hkv, -1, S)
    scores = torch.baddbmm(mask, q, key.flatten(0, 1).transpose(1, 2), alpha=scaling)  # (b·Hkv, g·T, S)
    out = torch.bmm(scores.softmax(-1), value.flatten(0, 1)).view(b, H, T, d)
    return out.transpose(1, 2), None                                                # (b, T, H, d)


def cpu_mask(*args, **kwargs):
    """cpu_attention's mask, built once a forward for its layers. In fp32, transformers' sdpa one (None
    where causal alone is the mask). Under autocast bf16, transformers' eager one in bf16, whose min
    is then finite (fp32's rounds to -inf in bf16, and a row all padding, a left-padded prompt's,
    to NaN)."""
    if not torch.is_autocast_enabled("cpu"):
        return sdpa_mask(*args, **kwargs)
    return eager_mask(*args, **{**kwargs, "dtype": torch.bfloat16})


AttentionInterface.register("cpu_attention", cpu_attention)
AttentionMaskInterface.register("cpu_attention", cpu_mask)


def frozen_dtype(device):
    """What a model that never trains is held in: bf16 on a GPU, which halves its memory (000: a 7B
    teacher beside a 0.5B student; a LoRA base; GRPO's reference), fp32 on a CPU. Its forwards run
    under autocast there, so it computes as the bf16 trainer does."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def check_same_tokenizer(tok, other, name, other_name):
    """Token-level KL between two models needs one vocabulary (Qwen 0.5B and 7B share theirs; only
    the embedding padding differs, which token_stats cuts off), and one EOS and pad: a teacher that
    ends on another token (Qwen2.5-7B-Instruct's <|im_end|>, the 0.5B base's <|endoftext|>) would
    teach the student a stop token its sampler never stops on."""
    if tok.get_vocab() != other.get_vocab():
        raise CountdownError(f"{name} and {other_name} have different tokenizers ({len(tok)} vs "
                             f"{len(other)} tokens): a token-level KL needs one vocabulary; train "
                             "both from the same base (any `tiny` shares one)")
    for what in ("eos", "pad"):
        a, b = (getattr(t, f"{what}_token") for t in (tok, other))
        if a != b:
            raise CountdownError(
                f"{name} and {other_name} have different {what.upper()} tokens ({a!r} vs {b!r}): "
                "the student would learn to end where its sampler does not stop; start the "
                "teacher from the student's base family (Qwen/Qwen2.5-7B, not -Instruct)")


def decode_precision(dev):
    """What the decode runs under: bf16 autocast on a GPU (half the KV cache, the bf16 trainer's
    precision), fp32 on a CPU, where sampling is fastest (common.autocast)."""
    if dev.type == "cuda":
        return torch.autocast("cuda", torch.bfloat16)
    return contextlib.nullcontext()
