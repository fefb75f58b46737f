"""A tiny GPT-2 (tied embeddings) built from its config, and token data, for
the framework tests; no download."""
from __future__ import annotations

import torch

VOCAB, SEQ = 64, 16


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2 ties lm_head to wte"
    return model


def token_rows(count: int, seed: int = 1) -> list[dict]:
    """`count` rows of random tokens, as a Trainer dataset (labels = input_ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]
