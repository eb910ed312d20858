"""The Hugging Face decoder adapters and their registration with the engine's decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from merak.generation import GenerationError, GenerationOptions, _local_blocks
from merak.hf.decoders import DECODERS, Gpt2Decoder, LlamaDecoder, decoder_for
from merak.pipeline.decode_adapter import decoder_adapter


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2))


def test_hugging_face_models_get_their_family_adapter():
    model = tiny_gpt2()
    adapter = decoder_adapter(model)
    assert isinstance(adapter, Gpt2Decoder) and adapter.model is model
    assert [name for name, _ in adapter.named_blocks()] == ["transformer.h.0", "transformer.h.1"]
    assert adapter.eos_token_ids == frozenset({model.config.eos_token_id})
    assert DECODERS["qwen3"] is LlamaDecoder
    ids = torch.tensor([[1, 2, 3]])
    positions = torch.arange(3)[None]
    model.eval()
    with torch.no_grad(), adapter.decoding():  # SDPA: causal attention without a mask
        hidden = adapter.embed(ids, positions)
        cache = adapter.new_cache()
        for _, block in adapter.named_blocks():
            hidden = adapter.run_block(block, hidden, cache, positions)
        logits = adapter.head(hidden)
        assert torch.allclose(logits, model(ids).logits, atol=1e-5)


def test_decoding_switches_attention_to_sdpa_and_back():
    model = tiny_gpt2()
    model.config._attn_implementation = "eager"
    adapter = decoder_for(model)
    with adapter.decoding():
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "eager"


def test_models_without_a_decoder_are_refused_with_what_is_supported():
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=16))
    with pytest.raises(GenerationError, match=r"supports causal LMs of types gpt2, llama.*BertForMaskedLM \(bert\)"):
        decoder_adapter(bert)
    assert decoder_for(nn.Linear(2, 2)) is None
    with pytest.raises(GenerationError, match=r"no decoder for Linear \(Hugging Face: causal LMs of types gpt2"):
        decoder_adapter(nn.Linear(2, 2))


def test_a_list_of_end_tokens_ends_sequences_at_any_of_them():
    model = tiny_gpt2()
    model.config.eos_token_id = [3, 7]
    assert decoder_for(model).eos_token_ids == frozenset({3, 7})
    model.config.eos_token_id = None
    assert decoder_for(model).eos_token_ids == frozenset()


def test_a_block_split_between_stages_is_an_error():
    adapter = decoder_for(tiny_gpt2())
    first = [f"transformer.h.0.{name}" for name, _ in adapter.named_blocks()[0][1].named_parameters()]
    assert len(_local_blocks(adapter, set(first))) == 1
    with pytest.raises(GenerationError, match="block transformer.h.0 is split between pipeline stages"):
        _local_blocks(adapter, set(first[:1]))
    assert GenerationOptions(max_length=4).temperature == 0.0
