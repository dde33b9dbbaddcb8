"""How a run never loses work: atomic HF checkpoints, resumable training states (`--resume`), the
rule that a finished run is never overwritten silently (`--overwrite`), and what a non-finite
step does (`--skip_nonfinite`). Every training script calls these the same way; nothing here
knows an algorithm."""
import math
import os
import random
import shutil
import tempfile

import torch

from plumbing.distributed import fsdp_units, load_full_state
from plumbing.flags import CountdownError


def plain_weights(model, device=None):
    """(name, tensor) of a model's weights under the plain model's names, one at a time. For a peft
    (LoRA) model each adapted weight is merged, W + BA, when it is reached (onto `device`), the
    others are the live tensors: neither a checkpoint nor a weight sync holds a second copy of
    the model (merge_and_unload on a deep copy did: twice a 7B model's memory)."""
    if not hasattr(model, "merge_and_unload"):
        yield from model.state_dict().items()
        return
    from peft.tuners.lora import LoraLayer
    base = model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for key, value in base.state_dict().items():
        name = key.replace(".base_layer.", ".")
        if "lora_" in key:
            continue
        m = adapted.get(name.rsplit(".", 1)[0])
        if m is not None and name.endswith(".weight"):  # W + BA in W's dtype, as peft's merge
            delta = sum(m.get_delta_weight(a) for a in m.active_adapters)
            value = (value + delta).to(device or value.device, value.dtype)
        yield name, value


def save_checkpoint(model, tokenizer, output_dir, weights=None):
    """Write an HF checkpoint into output_dir without ever leaving a half-written file: save to a
    temp dir inside it, then os.replace each file (config.json last: it is what marks a
    checkpoint). A LoRA model is saved merged (plain_weights), an ordinary HF checkpoint. The
    config and generation config name the tokenizer's EOS, the one every script appends to its
    targets: vLLM and transformers then stop where the trainer's sampler does (an -Instruct base
    lists <|im_end|> and <|endoftext|>). `weights`: the model's, gathered (FSDP's full_state)."""
    os.makedirs(output_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=output_dir)
    plain = model.get_base_model() if hasattr(model, "merge_and_unload") else model
    for cfg in (plain.config, getattr(plain, "generation_config", None)):
        if cfg is not None:
            cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    plain.save_pretrained(tmp, state_dict=weights or dict(plain_weights(model, "cpu")))
    tokenizer.save_pretrained(tmp)
    for name in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
        os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    os.rmdir(tmp)


STATE_KEEP = 2  # resumable states kept in OUTPUT_DIR/state/ (the newest)


def latest_state(output_dir):
    root = os.path.join(output_dir, "state")
    names = os.listdir(root) if os.path.isdir(root) else []
    steps = sorted(n for n in names if n.startswith("step_"))
    return os.path.join(root, steps[-1]) if steps else None


def frozen_names(model):
    """The state_dict names of the parameters that never train (a LoRA model's whole base)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_state(model):
    """What a resumable state keeps of the model: every tensor but the frozen parameters, which
    --init gives back (with LoRA: the adapters, not a copy of the base at every save)."""
    frozen = frozen_names(model)
    return {k: v for k, v in model.state_dict().items() if k not in frozen}


def save_state(output_dir, step, model, opt, sched=None, rng=None, ref=None, full=None, **extra):
    """Everything a run needs to go on at step+1 (weights, optimizer, schedule, the global RNGs, the
    script's data-order `rng`, a moving reference, and `extra`: its data order), written to a
    temp dir and renamed to state/step_N: a kill never leaves half a state. `full`: the model's and
    optimizer's states gathered from FSDP's shards (distributed.full_state)."""
    root = os.path.join(output_dir, "state")
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    weights, optim = full or (trained_state(model), opt.state_dict())
    state = {"step": step, "model": weights, "optimizer": optim, "fsdp": full is not None,
             "scheduler": sched.state_dict() if sched else None, "python_rng": random.getstate(),
             "torch_rng": torch.get_rng_state(), "rng": rng.getstate() if rng else None,
             "ref": None if ref is None else ref.state_dict(), "extra": extra}
    torch.save(state, os.path.join(tmp, "state.pt"))
    final = os.path.join(root, f"step_{step:07d}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(n for n in os.listdir(root) if n.startswith("step_"))[:-STATE_KEEP]:
        shutil.rmtree(os.path.join(root, old))


def load_state(output_dir, model, opt, sched=None, rng=None, ref=None):
    """Restore the newest state of a run in place (what save_state was given); returns (step,
    extra)."""
    path = latest_state(output_dir)
    s = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
    if bool(s.get("fsdp")) != bool(fsdp_units(model)):
        raise CountdownError(f"{path} was saved {'with' if s.get('fsdp') else 'without'} --fsdp: "
                             "resume it the same way")
    if s.get("fsdp"):  # every rank takes its shards of the whole state
        load_full_state(model, opt, s["model"], s["optimizer"])
        missing, unexpected = [], []
    else:
        missing, unexpected = model.load_state_dict(s["model"], strict=False)
    if unexpected or set(missing) - frozen_names(model):  # only what never trains may be absent
        raise CountdownError(f"{path} does not fit --init's model (missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]}): resume with the run's flags")
    if not s.get("fsdp"):
        opt.load_state_dict(s["optimizer"])
    if sched is not None:
        sched.load_state_dict(s["scheduler"])
    random.setstate(s["python_rng"])
    torch.set_rng_state(s["torch_rng"])
    if rng is not None and s["rng"] is not None:
        rng.setstate(s["rng"])
    if ref is not None:
        ref.load_state_dict(s["ref"])
    print(f"resuming {output_dir} after step {s['step']} ({path})")
    return s["step"], s["extra"]


def step_is_finite(step, loss, grad_norm, skip_nonfinite, output_dir):
    """True when the loss and the gradient norm are finite. Otherwise stop with one line naming the
    step and the last good state (left intact), or with skip_nonfinite return False: the caller
    drops the step."""
    if math.isfinite(loss) and math.isfinite(float(grad_norm)):
        return True
    if skip_nonfinite:
        return False
    last = latest_state(output_dir) or "none yet (lower --save_every)"
    what = "loss" if not math.isfinite(loss) else "gradient"
    raise CountdownError(
        f"non-finite {what} at step {step} (loss {loss}, grad norm {float(grad_norm)}): stopped. "
        f"Last good state: {last}. Continue with --resume {output_dir} and a lower --lr, "
        "or pass --skip_nonfinite to drop such steps")
