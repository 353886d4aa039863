"""A tiny Llama and its tokenizer, built at test time (no model hub is reachable from CI).

Random weights from a seed (two seeds give two models: the negative control), a
word-level tokenizer trained on the sentences below; the model's vocabulary is the
tokenizer's, so every sampled id decodes.
"""

from __future__ import annotations

from pathlib import Path

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a page of keys and values moves from prefill to decode",
    "redis keeps the state of every room while ucx moves the bytes",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white orange purple",
    "servers routers tokens kills and restarts",
]
WORDS = sorted({w for s in SENTENCES for w in s.split()})


def build(path: Path, seed: int) -> Path:
    """Write a 2-layer Llama (hidden 64) with weights from ``seed`` and its tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits: greedy picks are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompt(words: int, offset: int = 0) -> str:
    """A prompt of exactly ``words`` tokens (plus SGLang's BOS, if it adds one)."""
    return " ".join(WORDS[(offset + 7 * i) % len(WORDS)] for i in range(words))
