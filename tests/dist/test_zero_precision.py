"""ZeRO 1/2/3 and mixed precision train to the single-process numbers, with pp and tp on too.

ZeRO: every rank's owned piece of every gradient equals the same piece of the
reference gradient (fp32 tolerance), so reduce-scatter, tied and
sequence-parallel sums, clipping over all axes and the all-gather of the update
are all right. fp16: an overflow forced on one rank skips the step on every rank.
bf16: the losses track fp32 within bf16 rounding.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from gpt_reference import PARITY_OPTIONS, relative_error, train_reference, vocab_padded

from merak.core.slices import parameter_slices
from merak.data.batching import BatchPlan, MicrobatchLoader
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import PrecisionSettings, ZeroSettings
from merak.pipeline.settings import ScheduleSettings
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel.options import TensorParallelSplit
from merak.tensor_parallel.settings import TensorParallelSettings
from recipes.gpt import data, model, parallel

pytestmark = pytest.mark.dist

SEED = 1234
STEPS = 3
GLOBAL_BATCH = 16
MICROBATCHES = 4
OPTIONS = PARITY_OPTIONS
LOSS_RTOL = 1e-6
GRAD_RTOL = 2e-6
# Small buckets: ZeRO-2's reduce-scatters during the backward, and ZeRO 0/1's overlapped reductions
# (merak.optim.overlap), are many per stage and start while the backward still runs.
SMALL_BUCKETS = {"zero_reduce_bucket_size": 20_000, "zero_allgather_bucket_size": 30_000, "grad_bucket_mb": 0.002}
# name -> (dp, tp, pp, schedule, ZeroSettings); tp layouts use a vocabulary divisible by 2.
LAYOUTS = {
    "dp2-zero1": (2, 1, 1, "1f1b", ZeroSettings(zero_optimization=True, zero_stage=1, **SMALL_BUCKETS)),
    "dp2-zero2-prescale": (2, 1, 1, "1f1b", ZeroSettings(zero_optimization=True, zero_stage=2, prescale_gradients=True,
                                                         **SMALL_BUCKETS)),
    "dp2-pp2-zero1-predivide": (2, 1, 2, "1f1b", ZeroSettings(zero_optimization=True, zero_stage=1,
                                                              gradient_predivide_factor=2.0, grad_bucket_mb=0.002)),
    "dp2-pp2-zero1-zb_h1": (2, 1, 2, "zb_h1", ZeroSettings(zero_optimization=True, zero_stage=1, **SMALL_BUCKETS)),
    "dp2-pp2-zero1-interleaved": (2, 1, 2, "interleaved_1f1b",
                                  ZeroSettings(zero_optimization=True, zero_stage=1, **SMALL_BUCKETS)),
    "dp2-pp2-zero2-zb_h1": (2, 1, 2, "zb_h1", ZeroSettings(zero_optimization=True, zero_stage=2, **SMALL_BUCKETS)),
    "dp2-tp2-pp2-zero2": (2, 2, 2, "1f1b", ZeroSettings(zero_optimization=True, zero_stage=2, **SMALL_BUCKETS)),
    "dp2-zero3-recompute": (2, 1, 1, "1f1b", ZeroSettings(zero_optimization=True, zero_stage=3, **SMALL_BUCKETS)),
    "dp2-pp2-zero3-zb_h1": (2, 1, 2, "zb_h1", ZeroSettings(zero_optimization=True, zero_stage=3, **SMALL_BUCKETS)),
    "dp2-tp2-pp2-zero3-interleaved": (2, 2, 2, "interleaved_1f1b",
                                      ZeroSettings(zero_optimization=True, zero_stage=3, **SMALL_BUCKETS)),
}
# Layouts run with full recomputation: ZeRO-3 gathers a part again inside the backward, where torch's
# recomputation may stop early by raising out of the part.
RECOMPUTED = {"dp2-zero3-recompute"}
RECOMPUTE = ScheduleSettings(activation_checkpointing=True)


def _engine(state, model_cfg, *, tp: int, pp: int, schedule: str, zero=ZeroSettings(),
            precision=PrecisionSettings(), recompute: ScheduleSettings | None = None):
    micro_batch = GLOBAL_BATCH // (state.grid.dp * MICROBATCHES)
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    built = assemble(
        build=functools.partial(model.build_model, model_cfg), seed=SEED, init_device="cpu",
        sharding=ShardingSettings(split_method="layer_split", custom_split_points=list(parallel.SPLIT_POINTS)),
        num_stages=pp * chunks, num_microbatches=MICROBATCHES,
        stage_id=tuple(state.coordinates.pp + c * pp for c in range(chunks)), device=state.device,
        example_inputs=parallel.example_inputs(model_cfg, micro_batch),
        tensor_parallel=TensorParallelSplit(plan=parallel.TP_PLAN, size=tp, rank=state.coordinates.tp, settings=TensorParallelSettings(sequence_parallel=tp > 1)),
        dtype=precision.dtype)
    slices = parameter_slices(built.model)
    engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=model.causal_lm_loss, state=state,
                            schedule=schedule, num_microbatches=MICROBATCHES, total_steps=STEPS, optimizer=OPTIONS,
                            zero=zero, precision=precision, num_chunks=chunks, recompute=recompute)
    return engine, slices, micro_batch


def _loader(state, model_cfg, tokens, micro_batch):
    if not (state.is_first_stage or state.is_last_stage):
        return None
    plan = BatchPlan(num_samples=len(data.load(tokens, model_cfg)), micro_batch_size=micro_batch,
                     num_microbatches=MICROBATCHES, dp_size=state.grid.dp, dp_rank=state.coordinates.dp, seed=SEED)
    return MicrobatchLoader(data.load(tokens, model_cfg), plan)


def _largest_unit_bytes(engine) -> int | None:
    """ZeRO-3: bytes of the largest unit of parameters gathered together (None without ZeRO-3)."""
    sharded = engine.sharded_parameters
    if sharded is None:
        return None
    return max(sum(sharded.params[i].numel() * sharded.params[i].element_size() for i in unit.params)
               for unit in sharded.units)


def _train_zero(out_dir: str, layout: str, model_cfg, tokens: str) -> None:
    dp, tp, pp, schedule, zero = LAYOUTS[layout]
    torch.set_num_threads(1)
    state = groups.init(dp=dp, tp=tp, pp=pp, timeout_s=120)
    try:
        engine, slices, micro_batch = _engine(state, model_cfg, tp=tp, pp=pp, schedule=schedule, zero=zero,
                                              recompute=RECOMPUTE if layout in RECOMPUTED else None)
        loader = _loader(state, model_cfg, tokens, micro_batch)
        records = []
        for step in range(STEPS):
            result = engine.train_step(loader.load_step(step) if loader else None)
            pieces = {name: (start, stop, grad.clone()) for name, (start, stop, grad) in
                      engine.gradient_pieces().items() if grad is not None}
            records.append({"loss": result.loss, "grad_norm": result.grad_norm, "pieces": pieces})
        torch.save({"records": records, "slices": slices, "memory": engine.memory_report(),
                    "position": (state.coordinates.pp, state.coordinates.tp),
                    "sizes": {name: p.numel() for name, p in engine.named_parameters()},
                    "owned": sum(stop - start for start, stop, _ in engine.gradient_pieces().values()),
                    "local": sum(p.numel() for _, p in engine.named_parameters()),
                    "largest": max(p.numel() for _, p in engine.named_parameters()),
                    "largest_unit": _largest_unit_bytes(engine)},
                   Path(out_dir) / f"rank{state.rank}.pt")
    finally:
        groups.shutdown()


@pytest.fixture(scope="module")
def references(toy_model_cfg, toy_tokens):
    run = functools.partial(train_reference, tokens=toy_tokens, options=OPTIONS, steps=STEPS,
                            global_batch=GLOBAL_BATCH, seed=SEED)
    return {"plain": run(toy_model_cfg), "padded": run(vocab_padded(toy_model_cfg))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_matches_single_process(layout, tmp_path, references, toy_model_cfg, toy_tokens):
    dp, tp, pp, schedule, zero = LAYOUTS[layout]
    model_cfg = vocab_padded(toy_model_cfg) if tp > 1 else toy_model_cfg
    reference = references["padded" if tp > 1 else "plain"]
    spawn_workers(_train_zero, world_size=dp * tp * pp, args=(str(tmp_path), layout, model_cfg, toy_tokens))
    owned: dict[tuple, list[tuple[int, int]]] = {}  # (pp, tp, name) -> the ranges dp ranks own
    sizes: dict[tuple, int] = {}
    for rank in range(dp * tp * pp):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for step, (got, want) in enumerate(zip(saved["records"], reference, strict=True)):
            at = f"{layout} rank {rank} step {step}"
            assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), at
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=LOSS_RTOL), at
            for name, (start, stop, grad) in got["pieces"].items():
                full = want["grads"][name]
                local = saved["slices"][name].take(full) if name in saved["slices"] else full
                expected = local.reshape(-1)[start:stop]
                if expected.numel():
                    error = relative_error(grad, expected)
                    assert error < GRAD_RTOL, f"{at}: gradient piece of {name} off by {error:.2e}"
                if step == 0:
                    owned.setdefault((*saved["position"], name), []).append((start, stop))
                    sizes[(*saved["position"], name)] = saved["sizes"][name]
        # Each rank keeps optimizer state (AdamW: two fp32 moments) for its own pieces only.
        memory = saved["memory"]
        assert memory["optimizer_state_bytes"] == 8 * saved["owned"], layout
        assert saved["owned"] <= saved["local"] / dp + 64 * len(saved["records"][0]["pieces"]), layout
        if zero.stage == 2:
            # Full-size gradients wait only until a bucket fills (at most one bucket and the
            # parameter that completed it); the rest is the owned fp32 pieces.
            bound = 4 * (saved["owned"] + dp * zero.reduce_bucket_elements + saved["largest"])
            assert memory["gradient_bytes"] <= bound, memory
        if zero.stage == 3:
            # The weights are held as the owned pieces (padding at most dp - 1 elements per tensor)...
            tensors = len(saved["sizes"])
            assert 4 * saved["owned"] <= memory["parameter_bytes"] <= 4 * (saved["owned"] + (dp - 1) * tensors), memory
            # ...and whole only a unit (a stage part) at a time, except in zb_h1's weight pass (its whole chunk).
            gathered = memory["peak_gathered_parameter_bytes"]
            assert 0 < gathered <= 4 * saved["local"], memory
            if schedule != "zb_h1":
                assert gathered == saved["largest_unit"], memory
    # At every (pp, tp) position the dp ranks' pieces tile each parameter exactly (no gap, no
    # overlap), and between them the positions hold every parameter of the model.
    for key, ranges in owned.items():
        ends = [0]
        for start, stop in sorted(ranges):
            assert start == ends[-1], (layout, key, sorted(ranges))
            ends.append(stop)
        assert ends[-1] == sizes[key] and len(ranges) == dp, (layout, key, sorted(ranges))
    assert {name for _, _, name in owned} == set(reference[0]["grads"]), layout


def _train_fp16_overflow(out_dir: str, model_cfg, tokens: str) -> None:
    """dp2 x pp2 in fp16; rank 0 alone sees an infinite gradient at step 1."""
    torch.set_num_threads(1)
    state = groups.init(dp=2, pp=2, timeout_s=120)
    try:
        precision = PrecisionSettings(fp16=True, initial_scale_power=16, hysteresis=1)
        engine, _, micro_batch = _engine(state, model_cfg, tp=1, pp=2, schedule="1f1b",
                                         zero=ZeroSettings(zero_optimization=True, zero_stage=1), precision=precision)
        loader = _loader(state, model_cfg, tokens, micro_batch)
        step_now = {"step": 0}
        if state.rank == 0:
            first = engine.trainable[0]
            first.register_hook(lambda g: g * float("inf") if step_now["step"] == 1 else g)
        rows = []
        for step in range(STEPS + 1):
            step_now["step"] = step
            before = [p.detach().clone() for p in engine.trainable]
            result = engine.train_step(loader.load_step(step) if loader else None)
            unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.trainable))
            rows.append({"skipped": result.skipped, "loss_scale": result.loss_scale, "unchanged": unchanged,
                         "loss": result.loss, "dtype": str(engine.trainable[0].dtype)})
        torch.save(rows, Path(out_dir) / f"fp16-rank{state.rank}.pt")
    finally:
        groups.shutdown()


@pytest.mark.timeout(300)
def test_fp16_overflow_skips_the_step_on_every_rank(tmp_path, references, toy_model_cfg, toy_tokens):
    spawn_workers(_train_fp16_overflow, world_size=4, args=(str(tmp_path), toy_model_cfg, toy_tokens))
    rows = [torch.load(tmp_path / f"fp16-rank{rank}.pt") for rank in range(4)]
    for rank, mine in enumerate(rows):
        assert [r["dtype"] for r in mine] == ["torch.float16"] * len(mine)
        assert [r["skipped"] for r in mine] == [False, True, False, False], rank
        assert mine[1]["unchanged"] and not mine[2]["unchanged"], rank
        # The scale halves after the overflow (hysteresis 1) on every rank alike.
        assert [r["loss_scale"] for r in mine] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15], rank
    # Before the overflow, fp16 tracks the fp32 reference within half-precision rounding.
    assert rows[0][0]["loss"] == pytest.approx(references["plain"][0]["loss"], rel=5e-3)


BF16 = PrecisionSettings(bf16=True)
FP16 = PrecisionSettings(fp16=True, initial_scale_power=16)
# name -> (ZeRO, precision, recomputation), each run at dp2 x pp2.
HALF_PRECISION = {
    "zero2": (ZeroSettings(zero_optimization=True, zero_stage=2), BF16, None),
    # Overlapped reductions summed in bfloat16 (half the traffic), into fp32 master pieces.
    "zero1-overlap-bf16-sums": (ZeroSettings(zero_optimization=True, zero_stage=1, grad_bucket_mb=0.002,
                                             grad_reduce_dtype="bfloat16"), BF16, None),
    "zero0-overlap-bf16-sums": (ZeroSettings(grad_bucket_mb=0.002, grad_reduce_dtype="bfloat16"), BF16, None),
    # ZeRO-3 gathers bf16 / fp16 pieces; recomputation gathers a part again inside the backward.
    "zero3-recompute": (ZeroSettings(zero_optimization=True, zero_stage=3, **SMALL_BUCKETS), BF16, RECOMPUTE),
    "zero3-fp16": (ZeroSettings(zero_optimization=True, zero_stage=3, **SMALL_BUCKETS), FP16, None),
}


def _train_half_precision(out_dir: str, model_cfg, tokens: str) -> None:
    """Every HALF_PRECISION setting in turn, in one world."""
    torch.set_num_threads(1)
    state = groups.init(dp=2, pp=2, timeout_s=120)
    try:
        for name, (zero, precision, recompute) in HALF_PRECISION.items():
            engine, _, micro_batch = _engine(state, model_cfg, tp=1, pp=2, schedule="1f1b", zero=zero,
                                             precision=precision, recompute=recompute)
            loader = _loader(state, model_cfg, tokens, micro_batch)
            results = [engine.train_step(loader.load_step(step) if loader else None) for step in range(STEPS)]
            master = engine.optimizer.master[0]
            torch.save({"losses": [r.loss for r in results], "skipped": [r.skipped for r in results],
                        "param_dtype": str(engine.trainable[0].dtype), "master_dtype": str(master.dtype)},
                       Path(out_dir) / f"half-{name}-rank{state.rank}.pt")
    finally:
        groups.shutdown()


@pytest.mark.timeout(300)
def test_half_precision_tracks_fp32(tmp_path, references, toy_model_cfg, toy_tokens):
    spawn_workers(_train_half_precision, world_size=4, args=(str(tmp_path), toy_model_cfg, toy_tokens))
    want = [r["loss"] for r in references["plain"]]
    assert abs(want[0] - want[-1]) > 0.05
    for name, (_, precision, _) in HALF_PRECISION.items():
        saved = torch.load(tmp_path / f"half-{name}-rank0.pt")
        assert saved["param_dtype"] == str(precision.dtype) and saved["master_dtype"] == "torch.float32", name
        assert not any(saved["skipped"]), name
        # bf16 keeps 8 bits of mantissa: losses agree to about 1 %, far closer than steps differ (fp16, 11 bits,
        # closer still).
        for got, expected in zip(saved["losses"], want, strict=True):
            assert got == pytest.approx(expected, rel=1e-2), name


def _zero3_checkpoints(out_dir: str, model_cfg, tokens: str, dp: int, source: str | None) -> None:
    """ZeRO-3 at ``dp``: with no ``source``, train 2 steps and save ``trained``, then load it into a fresh
    engine and save ``same-layout``; with a ``source``, load it and save ``dp{dp}``."""
    from merak.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    state = groups.init(dp=dp, timeout_s=120)
    zero = ZeroSettings(zero_optimization=True, zero_stage=3, **SMALL_BUCKETS)
    try:
        def fresh():
            return _engine(state, model_cfg, tp=1, pp=1, schedule="1f1b", zero=zero)[0]

        def save(engine, name: str) -> None:
            written = save_checkpoint(engine, out_dir, step=2, trainer_state={}, run_info={})
            groups.barrier()
            if state.rank == 0:
                Path(written).rename(Path(out_dir) / name)
            groups.barrier()

        if source is None:
            engine, _, micro_batch = _engine(state, model_cfg, tp=1, pp=1, schedule="1f1b", zero=zero)
            loader = _loader(state, model_cfg, tokens, micro_batch)
            for step in range(2):
                engine.train_step(loader.load_step(step))
            save(engine, "trained")
            source, name = str(Path(out_dir) / "trained"), "same-layout"
        else:
            name = f"dp{dp}"
        engine = fresh()
        load_checkpoint(engine, source)
        save(engine, name)
    finally:
        groups.shutdown()


def _consolidated(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state of a checkpoint, whole, whatever layout wrote it."""
    from merak.checkpoint.load import CheckpointSource

    source = CheckpointSource(str(checkpoint))
    tensors = {f"weight/{name}": source.weight(name) for name in source.weight_names()}
    for name in source.optimizer.index:
        states, scalars = source.state_keys(name)
        tensors.update({f"state/{name}/{key}": source.state(name, key) for key in [*states, *scalars]})
    return tensors


@pytest.mark.timeout(300)
def test_zero3_checkpoint_resumes_at_another_dp_bit_identically(tmp_path, toy_model_cfg, toy_tokens):
    """Saved at dp2 with ZeRO-3, loaded back at dp2 and at dp4 (other pieces on every rank) and saved again:
    every weight and every optimizer state is the same bytes all three times."""
    spawn_workers(_zero3_checkpoints, world_size=2, args=(str(tmp_path), toy_model_cfg, toy_tokens, 2, None))
    spawn_workers(_zero3_checkpoints, world_size=4,
                  args=(str(tmp_path), toy_model_cfg, toy_tokens, 4, str(tmp_path / "trained")))
    trained = _consolidated(tmp_path / "trained")
    assert any(key.endswith("/exp_avg") for key in trained) and any(key.startswith("weight/") for key in trained)
    for resumed in ("same-layout", "dp4"):
        got = _consolidated(tmp_path / resumed)
        assert got.keys() == trained.keys(), resumed
        for key, tensor in trained.items():
            assert torch.equal(got[key], tensor), f"{resumed}: {key}"
