"""Decoding through the pipeline (merak.pipeline.decode) on gloo, against Hugging Face's generate on one
process: GPT-2 over 4 stages, a Llama over 2 stages x 2 tensor-parallel ranks with the vocabulary split;
an end-of-sequence token stops every stage, and the next prompt still pairs its transfers."""

from __future__ import annotations

import json
import os

import pytest
import torch

import merak
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.hf.decoders import decoder_for
from merak.pipeline.decode import PipelineDecoder
from merak.pipeline.decode_sampling import GenerationOptions

pytestmark = pytest.mark.dist

VOCAB, SEED = 96, 3
PROMPTS = [[5, 17, 3], [8, 1, 40, 2], [11]]
MAX_LENGTH = 9


def build_model(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4,
                            initializer_range=0.3)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False, initializer_range=0.3)
        model = LlamaForCausalLM(config)
    config._attn_implementation = "sdpa"
    return model.eval()


def reference(kind: str, stop_token: int | None) -> list[list[int]]:
    """One process, Hugging Face's greedy generate; the second prompt ends at ``stop_token``."""
    model = build_model(kind)
    out = []
    with torch.no_grad():
        for index, prompt in enumerate(PROMPTS[:2]):
            ids = torch.tensor([prompt])
            if index == 1 and stop_token is not None:
                out.append(model.generate(ids, do_sample=False, max_length=MAX_LENGTH, eos_token_id=stop_token,
                                          pad_token_id=stop_token).tolist()[0])
            else:
                out.append(model.generate(ids, do_sample=False, max_length=MAX_LENGTH, min_length=MAX_LENGTH,
                                          eos_token_id=None, pad_token_id=0).tolist()[0])
    return out


class SplitVocabulary:
    """An adapter whose head gives this tensor-parallel rank its part of the vocabulary (as a
    vocabulary-parallel head does), so the decoder must join the parts."""

    def __init__(self, adapter, rank: int, size: int) -> None:
        self.adapter, self.rank, self.size = adapter, rank, size

    def __getattr__(self, name):
        return getattr(self.adapter, name)

    def head(self, hidden):
        logits = self.adapter.head(hidden)
        part = logits.shape[-1] // self.size
        return logits[..., self.rank * part:(self.rank + 1) * part]


def decode(kind: str, stop_token: int | None) -> list[list[int] | None]:
    """This rank's part of three continuations: greedy, greedy stopped by ``stop_token``, sampled."""
    state = groups.get_state()
    model = build_model(kind)
    adapter = decoder_for(model)
    if state.grid.tp > 1:
        adapter = SplitVocabulary(adapter, state.coordinates.tp, state.grid.tp)
    blocks = [block for _, block in adapter.named_blocks()]
    per_stage = len(blocks) // state.grid.pp
    mine = blocks[state.coordinates.pp * per_stage:(state.coordinates.pp + 1) * per_stage]
    decoder = PipelineDecoder(adapter, mine, state, dtype=torch.float32, vocab_parallel=state.grid.tp > 1)
    greedy = GenerationOptions(max_length=MAX_LENGTH)
    sampled = GenerationOptions(max_length=MAX_LENGTH, temperature=0.8, top_k=20, top_p=0.9)
    stops = frozenset() if stop_token is None else frozenset({stop_token})
    with torch.no_grad(), adapter.decoding():
        return [decoder.continue_prompt(PROMPTS[0], greedy, frozenset(), torch.Generator().manual_seed(0)),
                decoder.continue_prompt(PROMPTS[1], greedy, stops, torch.Generator().manual_seed(1)),
                decoder.continue_prompt(PROMPTS[2], sampled, frozenset(), torch.Generator().manual_seed(2))]


def _worker(kind: str, pp: int, tp: int, stop_token: int | None, out_dir: str) -> None:
    merak.init(dp=1, tp=tp, pp=pp, timeout_s=120)
    results = decode(kind, stop_token)
    rank = groups.get_state().rank
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle)


def one_process(kind: str, stop_token: int | None) -> list[list[int]]:
    merak.init(dp=1, tp=1, pp=1)
    try:
        return decode(kind, stop_token)
    finally:
        groups.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, pp, tp", [("gpt2", 4, 1), ("llama", 2, 2)])
def test_pipeline_decoding_matches_hugging_face(tmp_path, kind, pp, tp):
    unstopped = reference(kind, None)
    new = unstopped[1][len(PROMPTS[1]):]
    # The second prompt ends at its last new token that differs from the ones before (mid-sequence).
    end = max(i for i, token in enumerate(new[:-1]) if token not in new[:i])
    expected = reference(kind, new[end])
    assert expected[0] == unstopped[0] and expected[1] == unstopped[1][:len(PROMPTS[1]) + end + 1]
    stop_token = new[end]
    alone = one_process(kind, stop_token)
    assert alone[:2] == expected
    spawn_workers(_worker, world_size=pp * tp, args=(kind, pp, tp, stop_token, str(tmp_path)))
    for rank in range(pp * tp):
        with open(tmp_path / f"rank{rank}.json", encoding="utf-8") as handle:
            results = json.load(handle)
        if rank // tp == pp - 1:  # the last stage's ranks hold the sequences, every tp rank alike
            assert results[:2] == expected
            assert results[2] == alone[2] and len(results[2]) == MAX_LENGTH  # the same samples as one process
        else:
            assert results == [None, None, None]
