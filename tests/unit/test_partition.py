"""uniform_boundaries, stages_from_blocks and tied-parameter detection."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from merak.pipeline.stage import StageModule, TiedParameter, find_tied_parameters, stages_from_blocks
from merak.shard.partition import uniform_boundaries


@pytest.mark.parametrize("num_items,num_parts,expected", [
    (4, 4, [0, 1, 2, 3, 4]),
    (5, 1, [0, 5]),
    (7, 3, [0, 2, 4, 7]),
    (10, 4, [0, 2, 4, 7, 10]),
    (12, 4, [0, 3, 6, 9, 12]),
    (5, 4, [0, 1, 2, 3, 5]),
    (11, 4, [0, 2, 5, 8, 11]),
])
def test_uniform_boundaries_exact(num_items, num_parts, expected):
    assert uniform_boundaries(num_items, num_parts) == expected


@pytest.mark.parametrize("num_parts", range(1, 9))
@pytest.mark.parametrize("num_items", range(1, 30))
def test_uniform_boundaries_properties(num_items, num_parts):
    if num_items < num_parts:
        with pytest.raises(ValueError, match="non-empty parts"):
            uniform_boundaries(num_items, num_parts)
        return
    bounds = uniform_boundaries(num_items, num_parts)
    assert len(bounds) == num_parts + 1
    assert bounds[0] == 0
    assert bounds[-1] == num_items
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert all(s >= 1 for s in sizes)  # strictly increasing boundaries
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes)  # the extra items go to the later parts
    assert sizes.count(num_items // num_parts + 1) == num_items % num_parts


def test_uniform_boundaries_errors():
    with pytest.raises(ValueError, match="cannot split 3 items into 4 non-empty parts"):
        uniform_boundaries(3, 4)
    with pytest.raises(ValueError, match="cannot split into 0 parts"):
        uniform_boundaries(5, 0)
    with pytest.raises(ValueError, match="cannot split into -1 parts"):
        uniform_boundaries(5, -1)
    with pytest.raises(ValueError, match="cannot split 0 items"):
        uniform_boundaries(0, 1)


class Embed(nn.Module):
    def __init__(self, shared: nn.Embedding) -> None:
        super().__init__()
        self.wte = shared

    def forward(self, batch):
        return self.wte(batch["input_ids"])


class Head(nn.Module):
    def __init__(self, shared: nn.Embedding, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, shared.num_embeddings, bias=False)
        self.proj.weight = shared.weight  # tied by identity

    def forward(self, hidden):
        return self.proj(self.norm(hidden))


class TinyLM(nn.Module):
    """embedding -> blocks -> head with the head weight tied to the embedding."""

    def __init__(self, vocab: int = 11, width: int = 6, depth: int = 5) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.embed = Embed(self.wte)
        self.head = Head(self.wte, width)
        # same shape as the embedding weight, but a distinct parameter: never "tied"
        self.lookalike = nn.Parameter(torch.randn(vocab, width))

    def forward(self, batch):
        hidden = self.embed(batch)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def test_stages_from_blocks_layout():
    model = TinyLM(depth=5)
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 3)
    assert len(stages) == 3
    assert all(isinstance(s, StageModule) for s in stages)
    # 5 blocks over 3 stages -> 1, 2, 2 ; embed first, head last
    assert [len(s.parts) for s in stages] == [2, 2, 3]
    assert stages[0].parts[0] is model.embed
    assert stages[0].parts[1] is model.blocks[0]
    assert list(stages[1].parts) == [model.blocks[1], model.blocks[2]]
    assert list(stages[2].parts)[:2] == [model.blocks[3], model.blocks[4]]
    assert stages[2].parts[-1] is model.head


def test_single_stage_holds_everything():
    model = TinyLM(depth=2)
    (stage,) = stages_from_blocks(model.embed, list(model.blocks), model.head, 1)
    assert list(stage.parts) == [model.embed, model.blocks[0], model.blocks[1], model.head]
    assert find_tied_parameters(model, [stage]) == []


def test_stages_compose_to_the_full_model():
    torch.manual_seed(0)
    model = TinyLM(depth=4)
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 2)
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])}
    payload = batch
    for stage in stages:
        payload = stage(payload)
    assert torch.equal(payload, model(batch))
    assert payload.shape == (2, 3, 11)


def test_too_many_stages_for_blocks():
    model = TinyLM(depth=2)
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        stages_from_blocks(model.embed, list(model.blocks), model.head, 3)


def test_find_tied_parameters_by_identity():
    model = TinyLM(depth=4)
    assert model.head.proj.weight is model.wte.weight
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 2)
    tied = find_tied_parameters(model, stages)
    # the model's first name for the shared weight is "wte.weight"
    assert tied == [TiedParameter(name="wte.weight", stages=(0, 1))]


def test_tied_parameter_across_three_stages_and_middle_untouched():
    model = TinyLM(depth=3)
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 3)
    tied = find_tied_parameters(model, stages)
    assert tied == [TiedParameter(name="wte.weight", stages=(0, 2))]


def test_same_shape_distinct_weight_is_not_tied():
    model = TinyLM(depth=2)
    # A head whose weight equals the embedding in shape and value but is another tensor.
    head = Head(nn.Embedding(11, 6), 6)
    with torch.no_grad():
        head.proj.weight.copy_(model.wte.weight)
    model.head = head
    stages = stages_from_blocks(model.embed, list(model.blocks), model.head, 2)
    assert head.proj.weight.shape == model.wte.weight.shape
    assert torch.equal(head.proj.weight, model.wte.weight)
    assert find_tied_parameters(model, stages) == []


def test_lookalike_parameter_in_two_stages_is_not_confused():
    model = TinyLM(depth=2)
    # put the same-shape lookalike into the last stage; only the real shared weight is tied
    carrier = nn.Module()
    carrier.weight = model.lookalike
    stages = stages_from_blocks(model.embed, list(model.blocks), nn.Sequential(model.head, carrier), 2)
    tied = find_tied_parameters(model, stages)
    assert [t.name for t in tied] == ["wte.weight"]
    assert tied[0].stages == (0, 1)
