"""Plumbing beneath the core (a learner may skip): what tba.py, searcher.py, engines.py and
trainer.py need to run for real, kept out of the files that teach the algorithm.

Each module is named for what it does and imports nothing above it (no core file, no
extension): the config's plumbing knobs and validation (``config``), how log-probs are computed
fast (``logprobs``: padding, one prefill per prompt, de-duplication), loading models
(``models``), the searcher processes' supervision (``processes``), checkpoints and resume
(``checkpoint``), the run around the trainer's loop (``run``), a step's metrics (``metrics``)
and vLLM's reload internals (``vllm_reload``).
"""
