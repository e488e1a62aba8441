"""Loading models and tokenizers (a learner may skip): every process loads the policy or the
reference with ``load_causal_lm``; the trainer lays out the weight store from the policy's
shapes alone (``meta_causal_lm``) before it takes any memory."""

from __future__ import annotations

import torch


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    """The causal LM at ``path`` (a hub name or a local directory) in ``dtype`` on ``device``:
    the trainer's policy, a searcher's reference and its transformers engine."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load per process drowns the trainer's bar
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return model.to(device)


def meta_causal_lm(path: str, trust_remote_code: bool):
    """The model at ``path`` on the meta device: its parameter names and shapes, in the order
    ``load_causal_lm``'s model lists them (a tied head once), with no weights read and no
    memory taken."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, or its EOS id when it has none (pad positions are masked out)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def special_token_ids(model: str, trust_remote_code: bool) -> tuple[int, int]:
    """(pad id, EOS id) of the tokenizer of ``model``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    return pad_token_id(tokenizer), tokenizer.eos_token_id
