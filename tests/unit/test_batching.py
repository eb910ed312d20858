"""BatchPlan / MicrobatchLoader: which samples each dp rank loads at each step."""

from __future__ import annotations

import pytest
import torch

from merak.data.batching import BatchPlan, MicrobatchLoader, stack_samples

# (dp, micro_batch_size, num_microbatches), all with a global batch of 8.
LAYOUTS = [(1, 8, 1), (2, 2, 2), (4, 1, 2), (1, 1, 8), (2, 4, 1), (8, 1, 1)]
NUM_SAMPLES = 43  # 5 steps per epoch, 3 samples dropped


def plans(dp, mbs, m, **kwargs):
    return [BatchPlan(num_samples=NUM_SAMPLES, micro_batch_size=mbs, num_microbatches=m,
                      dp_size=dp, dp_rank=r, **kwargs) for r in range(dp)]


def concatenated(rank_plans, step):
    return [i for plan in rank_plans for mb in plan.microbatch_indices(step) for i in mb]


@pytest.mark.parametrize("dp,mbs,m", LAYOUTS)
def test_ranks_cover_global_batch_in_order(dp, mbs, m):
    rank_plans = plans(dp, mbs, m, seed=7)
    assert all(p.global_batch_size == 8 for p in rank_plans)
    for step in range(12):  # crosses two epoch boundaries
        gb = rank_plans[0].global_batch(step).tolist()
        assert len(gb) == 8
        assert len(set(gb)) == 8
        for plan in rank_plans:
            mbs_of_rank = plan.microbatch_indices(step)
            assert len(mbs_of_rank) == m
            assert all(len(mb) == mbs for mb in mbs_of_rank)
            assert plan.global_batch(step).tolist() == gb
        assert concatenated(rank_plans, step) == gb


def test_same_samples_per_step_across_layouts():
    for step in range(12):
        sets = {layout: set(concatenated(plans(*layout, seed=3), step)) for layout in LAYOUTS}
        reference = sets[LAYOUTS[0]]
        assert len(reference) == 8
        for layout, samples in sets.items():
            assert samples == reference, (layout, step)


def test_steps_of_one_epoch_are_disjoint():
    plan = BatchPlan(num_samples=NUM_SAMPLES, micro_batch_size=2, num_microbatches=2, dp_size=2, seed=1)
    seen = [i for step in range(plan.steps_per_epoch) for i in plan.global_batch(step).tolist()]
    assert len(seen) == 40
    assert len(set(seen)) == 40
    assert set(seen) <= set(range(NUM_SAMPLES))


def test_unshuffled_exact_indices():
    kw = {"num_samples": 20, "micro_batch_size": 2, "num_microbatches": 2, "dp_size": 2, "shuffle": False}
    r0, r1 = BatchPlan(dp_rank=0, **kw), BatchPlan(dp_rank=1, **kw)
    assert r0.steps_per_epoch == 2
    assert r0.microbatch_indices(0) == [[0, 1], [2, 3]]
    assert r1.microbatch_indices(0) == [[4, 5], [6, 7]]
    assert r0.microbatch_indices(1) == [[8, 9], [10, 11]]
    assert r1.microbatch_indices(1) == [[12, 13], [14, 15]]
    # samples 16..19 are dropped; step 2 starts epoch 1 from the beginning
    assert r0.microbatch_indices(2) == [[0, 1], [2, 3]]
    assert r1.global_batch(3).tolist() == list(range(8, 16))


def test_epochs_differ_and_are_seeded():
    plan = BatchPlan(num_samples=NUM_SAMPLES, micro_batch_size=8, num_microbatches=1, seed=5)
    e0, e1, e2 = plan.epoch_order(0), plan.epoch_order(1), plan.epoch_order(2)
    for order in (e0, e1, e2):
        assert sorted(order.tolist()) == list(range(NUM_SAMPLES))
    assert e0.tolist() != e1.tolist()
    assert e1.tolist() != e2.tolist()
    assert e0.tolist() != list(range(NUM_SAMPLES))
    # the first step of epoch 1 is cut from epoch 1's permutation
    assert plan.global_batch(plan.steps_per_epoch).tolist() == e1[:8].tolist()
    assert plan.global_batch(0).tolist() != plan.global_batch(plan.steps_per_epoch).tolist()
    # reproducible: a fresh plan with the same seed gives the same orders
    again = BatchPlan(num_samples=NUM_SAMPLES, micro_batch_size=8, num_microbatches=1, seed=5)
    assert [again.global_batch(s).tolist() for s in range(12)] == [plan.global_batch(s).tolist() for s in range(12)]
    # the permutation of epoch e is the one of seed + e
    expected = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(5 + 2))
    assert e2.tolist() == expected.tolist()
    # another seed, another order
    other = BatchPlan(num_samples=NUM_SAMPLES, micro_batch_size=8, num_microbatches=1, seed=6)
    assert other.epoch_order(0).tolist() != e0.tolist()


def test_an_epochs_permutation_is_drawn_once_not_at_every_step(monkeypatch):
    import merak.data.batching as batching

    batching._epoch_order.cache_clear()
    drawn = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *args, **kwargs: drawn.append(args) or randperm(*args, **kwargs))
    plan = BatchPlan(num_samples=NUM_SAMPLES + 3, micro_batch_size=2, num_microbatches=2, seed=11)
    steps = [plan.microbatch_indices(step) for step in range(2 * plan.steps_per_epoch)]
    assert len(drawn) == 2  # one per epoch
    again = BatchPlan(num_samples=NUM_SAMPLES + 3, micro_batch_size=2, num_microbatches=2, seed=11)
    assert [again.microbatch_indices(step) for step in range(2 * again.steps_per_epoch)] == steps


@pytest.mark.parametrize("num_samples,mbs,m,dp,expected", [
    (8, 2, 2, 2, 1), (15, 2, 2, 2, 1), (16, 2, 2, 2, 2), (43, 1, 8, 1, 5), (100, 3, 2, 1, 16),
])
def test_steps_per_epoch(num_samples, mbs, m, dp, expected):
    plan = BatchPlan(num_samples=num_samples, micro_batch_size=mbs, num_microbatches=m, dp_size=dp)
    assert plan.global_batch_size == mbs * m * dp
    assert plan.steps_per_epoch == expected


def test_dataset_smaller_than_one_global_batch():
    with pytest.raises(ValueError) as info:
        BatchPlan(num_samples=7, micro_batch_size=2, num_microbatches=2, dp_size=2)
    message = str(info.value)
    assert "7 samples" in message
    assert "global batch of 8" in message
    assert "micro batch 2 x 2 microbatches x dp 2" in message


def test_stack_samples():
    samples = [{"a": torch.tensor([i, i + 1]), "b": i * 10} for i in range(3)]
    batch = stack_samples(samples)
    assert set(batch) == {"a", "b"}
    assert batch["a"].tolist() == [[0, 1], [1, 2], [2, 3]]
    assert batch["b"].tolist() == [0, 10, 20]
    assert batch["a"].shape == (3, 2)
    assert batch["b"].shape == (3,)


class ToyDataset:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.full((5,), i, dtype=torch.int64), "label": torch.tensor(float(i))}


def test_microbatch_loader_load_step():
    plan = BatchPlan(num_samples=30, micro_batch_size=3, num_microbatches=2, dp_size=2, dp_rank=1, seed=11)
    loader = MicrobatchLoader(ToyDataset(30), plan)
    for step in (0, 1, 5):
        batches = loader.load_step(step)
        expected = plan.microbatch_indices(step)
        assert len(batches) == 2
        for batch, indices in zip(batches, expected):
            assert set(batch) == {"input_ids", "label"}
            assert batch["input_ids"].shape == (3, 5)
            assert batch["input_ids"].dtype == torch.int64
            assert batch["label"].shape == (3,)
            assert batch["input_ids"].device == torch.device("cpu")
            assert batch["input_ids"][:, 0].tolist() == indices
            assert batch["label"].tolist() == [float(i) for i in indices]


def test_microbatch_loader_custom_collate():
    plan = BatchPlan(num_samples=8, micro_batch_size=2, num_microbatches=2, shuffle=False)
    loader = MicrobatchLoader(ToyDataset(8), plan,
                              collate=lambda s: {"sum": torch.stack([x["input_ids"] for x in s]).sum(0)})
    batches = loader.load_step(0)
    assert [b["sum"].tolist() for b in batches] == [[1] * 5, [5] * 5]


def test_zero_micro_batch_size_is_a_value_error():
    with pytest.raises(ValueError):
        BatchPlan(num_samples=10, micro_batch_size=0, num_microbatches=1)


def test_dp_rank_out_of_range_is_rejected():
    with pytest.raises(ValueError):
        BatchPlan(num_samples=10, micro_batch_size=1, num_microbatches=1, dp_size=2, dp_rank=2)


def test_prefetching_workers_load_the_same_microbatches_in_order_and_follow_a_jump():
    """Worker processes prepare steps ahead; what load_step returns is what the plan says, also after the
    caller jumps (a resume) or goes back, and across an epoch boundary."""
    plan = BatchPlan(num_samples=30, micro_batch_size=3, num_microbatches=2, dp_size=2, dp_rank=1, seed=11)
    in_process = MicrobatchLoader(ToyDataset(30), plan)
    prefetching = MicrobatchLoader(ToyDataset(30), plan, num_workers=2, prefetch_steps=2)
    try:
        for step in (0, 1, 2, 3, 7, 8, 2, 3):
            want, got = in_process.load_step(step), prefetching.load_step(step)
            assert [b["input_ids"][:, 0].tolist() for b in got] == [b["input_ids"][:, 0].tolist() for b in want]
            assert all(torch.equal(g["label"], w["label"]) for g, w in zip(got, want))
    finally:
        prefetching.close()


def test_channels_last_applies_to_images_only():
    class Images:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.randn(3, 4, 4), "labels": torch.tensor(i)}

    plan = BatchPlan(num_samples=4, micro_batch_size=2, num_microbatches=1, shuffle=False)
    batch = MicrobatchLoader(Images(), plan, channels_last=True).load_step(0)[0]
    assert batch["x"].is_contiguous(memory_format=torch.channels_last) and not batch["x"].is_contiguous()
    assert batch["labels"].tolist() == [0, 1]


def test_negative_workers_are_rejected():
    plan = BatchPlan(num_samples=4, micro_batch_size=2, num_microbatches=1)
    with pytest.raises(ValueError, match="num_workers"):
        MicrobatchLoader(ToyDataset(4), plan, num_workers=-1)
