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
