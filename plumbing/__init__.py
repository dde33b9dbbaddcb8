"""The plumbing: what every script needs and a student never has to open to follow an algorithm.
The lessons are the top level (sft ipo rloo grpo opd rlt, their helpers in common.py and
verifier.py, evaluate.py); this package imports nothing from it but verifier.py.
  flags.py         the command line: Args in two levels, --help, one-line errors, seeds, threads
  harness.py       the run around a loop: output dir, policy and frozen models, data order,
                   the non-finite stop, evaluation schedule, checkpoints and exact resume, the log
  checkpoints.py   HF checkpoints and resumable states, written atomically
  models.py        models and tokenizers (hub, dir or the embedded tiny one), training precision,
                   the CPU attention common.autocast swaps in
  machine.py       which training precision is the faster on this machine, measured (run_cpu.sh)
  tasks.py         Countdown tasks, prompt templates, SFT/IPO data, RLT's formats, the probe's record
  traces.py        the solver's search traces, their strategies and the mistakes LLM traces make
  explanations.py  RLT's explanations: which problems, the reward's balance, their export
  fast_decode.py   the HF sampler's fast twin (and its CUDA graph), equal to common.py's loop
  shared_prompts.py  the RL forward's fast path: each prompt once for its group, inside autograd
  vllm_engine.py   the vLLM engine behind common.VLLMSampler: its options, sleep, wake, weight reload
  async_sampler.py the HF sampler k steps ahead in a process of its own (--async_steps)
  rollout_log.py   a step's rollouts to rollouts.jsonl, and two steps side by side
  distributed.py   torchrun: DDP or FSDP2 around the forward, each rank's share, keyed draws
  report.py        tables and plots (evaluate.py --run / --plot / --compare)
  pipeline.py      run_cpu.sh's scheduler of stages side by side
"""
