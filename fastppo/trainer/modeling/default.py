"""The policy a run starts from without ``--model``: the tiny Llama shipped in ``default_model/`` (a
character tokenizer, 2 layers, hidden 64; made by ``scripts/make_default_model.py``, which taught
it some of the built-in arithmetic task). ``tiny_policy`` builds the same architecture untrained.
"""

from pathlib import Path

import torch


def char_tokenizer():
    """A character-level fast tokenizer: lowercase letters, digits, space and a few symbols."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz0123456789 +-=?."]
    words = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    words.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_policy(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"
