"""The vLLM sampling backend, for GPU runs: same interface as common.HFSampler (generate -> Rollouts,
sync(model)), plus sleep/wake so training gets the GPU memory back between rollouts.

Pinned to vllm==0.10.2 (`pip install -e ".[vllm]"`). vLLM ships CUDA wheels only, so this file has
never been run on the CPU machines this repo is developed and tested on; it is kept apart so that
nothing on the CPU path imports it. Weight sync uses the in-process engine path (the one TRL's
colocate mode used with 0.10): a newer vLLM may move it, which the sampler/trainer log-prob canary
that every RL script logs would show at once.
"""
import os

from common import Rollouts


class VLLMSampler:
    """A vLLM engine colocated with the trainer on one GPU, using a share of its memory."""

    def __init__(self, model_dir, tokenizer, gpu_memory_utilization=0.3, max_model_len=2048, seed=0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: weights reachable
        from vllm import LLM
        self.tok = tokenizer
        self.llm = LLM(model=model_dir, gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True,
                       dtype="bfloat16", max_model_len=max_model_len, seed=seed)

    def sync(self, model):
        """Copy the trainer's current weights into the engine (the vLLM 0.10 in-process path TRL uses)."""
        engine_model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        engine_model.load_weights(model.state_dict().items())
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def sleep(self):
        self.llm.sleep(level=1)  # weights to CPU, KV cache freed: the optimizer step gets the memory

    def wake(self):
        self.llm.wake_up()

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1024, seed=0):
        from vllm import SamplingParams
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                                max_tokens=max_new_tokens, seed=seed, logprobs=0)  # raw logprobs by default
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        comps = [c for o in outs for c in o.outputs]
        return Rollouts([list(o.prompt_token_ids) for o in outs], [list(c.token_ids) for c in comps],
                        [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in comps],
                        [c.text for c in comps], [c.finish_reason == "stop" for c in comps])
