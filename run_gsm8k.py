"""The main job: TBA on GSM8K (paper preset, 4xA100) or the offline tiny preset (CPU).

    python run_gsm8k.py                     # auto: paper preset with GPUs, else tiny
    python run_gsm8k.py --preset tiny       # offline, CPU, synthetic GSM8K-format problems
    python run_gsm8k.py --help              # every TBAConfig field is a flag
"""

from __future__ import annotations

import string


def build_char_tokenizer():
    """A character-level tokenizer built in code (no hub): specials <pad> <eos> <bos> <unk>,
    then digits, letters, punctuation, space and newline. Saves and loads with transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    chars = sorted(set(string.digits + string.ascii_letters + string.punctuation + " \n"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


PROMPT_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"  # official TBA/VinePPO format


def synthetic_problems(count: int, seed: int, digits: int = 2) -> list[dict]:
    """GSM8K-format sums made in code: a question and a worked answer ending in ``#### N``."""
    import random

    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    rows = []
    for _ in range(count):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


def build_tiny_model(tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0):
    """A tiny Llama-architecture causal LM from a transformers config (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    return LlamaForCausalLM(config)
