"""merak.autoplan.cost (and Layout, GraphProfile.scaled): the cost model on a hand-built profile.

The synthetic model is an embedding unit, 8 identical layers of 3 units each and a head unit. Embedding and
head cost nothing, so pipeline stages of whole layers are uniform; only the layer starts send as little as
the hidden state, so cuts fall between layers.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from merak.autoplan.cluster import Link, preset, this_machine
from merak.autoplan.cost import (
    ZERO_BUCKET_ELEMENTS,
    CostModel,
    LayoutError,
    StageCostModel,
    _in_flight_peak,
    all_reduce_seconds,
    gather_seconds,
    quick_step_seconds,
)
from merak.autoplan.layout import Layout
from merak.autoplan.profile import GraphProfile
from merak.pipeline.instructions import BackwardInput, BackwardWeight
from merak.pipeline.schedules import build_schedule

LAYERS = 8
UNITS_PER_LAYER = 3
HIDDEN = 1 << 20  # bytes of the hidden state between layers
SAVED_PER_UNIT = 2 * HIDDEN
PARAMS_PER_UNIT = 10**6
FLOPS_PER_UNIT = 10**11
FP32_STATE_BYTES = 4 + 4 + 8  # weight, gradient, Adam's two moments


def synthetic_profile(*, layers: int = LAYERS, dtype_bytes: int = 4, forward_all_reduce: int = 0,
                      backward_all_reduce: int = 0, tp: int = 1, selective_kept: int = 0,
                      selective_flops: int = 0) -> GraphProfile:
    """An embedding, ``layers`` layers of three units and a head; each layer's last unit all-reduces
    ``forward_all_reduce`` bytes in forward and its first unit ``backward_all_reduce`` in backward; selective
    recomputation keeps ``selective_kept`` bytes of each layer unit and spares it ``selective_flops``."""
    count = 1 + layers * UNITS_PER_LAYER + 1

    def per_unit(layer_values) -> tuple[int, ...]:
        """Zero for the embedding and the head, ``layer_values[i % 3]`` for the i-th unit of the layers."""
        return (0, *[layer_values[i % UNITS_PER_LAYER] for i in range(layers * UNITS_PER_LAYER)], 0)

    crossing = [0] + [HIDDEN if (k - 1) % UNITS_PER_LAYER == 0 else 3 * HIDDEN for k in range(1, count)]
    crossing[-1] = 2 * HIDDEN  # the head's input is more than a hidden state: no cut before it
    return GraphProfile(
        micro_batch_size=1, tp=tp, sequence_parallel=False, dtype_bytes=dtype_bytes,
        flops=per_unit([FLOPS_PER_UNIT] * 3), bytes_moved=per_unit([0] * 3), ops=per_unit([0] * 3),
        params=per_unit([PARAMS_PER_UNIT] * 3), saved_bytes=per_unit([SAVED_PER_UNIT] * 3),
        forward_all_reduce=per_unit([0, 0, forward_all_reduce]), forward_gather=per_unit([0] * 3),
        backward_all_reduce=per_unit([backward_all_reduce, 0, 0]), backward_gather=per_unit([0] * 3),
        crossing_bytes=tuple(crossing), layer_starts=tuple(range(1, count - 1, UNITS_PER_LAYER)), output_bytes=0,
        selective_kept_bytes=per_unit([selective_kept] * 3), selective_saved_flops=per_unit([selective_flops] * 3))


def gpu_model(profile: GraphProfile | None = None, nodes: int = 2, overlap_grad_reduce: bool = True,
              zero_bucket_elements: int = ZERO_BUCKET_ELEMENTS) -> CostModel:
    """A cost model of ``profile`` (default: the synthetic one) on ``nodes`` H100 servers."""
    profile = profile or synthetic_profile()
    return CostModel(lambda tp, sequence_parallel: profile, preset("h100-80").with_size(nodes=nodes),
                     overlap_grad_reduce=overlap_grad_reduce, zero_bucket_elements=zero_bucket_elements)


def layout(**fields) -> Layout:
    """A Layout with dp = tp = pp = 1, microbatch 1 and 8 microbatches unless ``fields`` say otherwise."""
    values = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_microbatches": 8, **fields}
    return Layout(**values)


def activation_bytes(model: CostModel, chosen: Layout) -> list[int]:
    """Each stage's predicted memory minus its fp32 model state (no ZeRO): the activations it holds."""
    prediction = model.predict(chosen, simulate_schedule=False)
    pieces = model.pieces(chosen)
    pp = chosen.pp
    params = [sum(pieces[c * pp + s].params for c in range(chosen.chunks)) for s in range(pp)]
    return [memory - p * FP32_STATE_BYTES for memory, p in zip(prediction.stage_memory, params)]


# --- Layout --------------------------------------------------------------------------------------------------


def test_layout_key_and_sizes():
    plain = Layout(dp=2, tp=1, pp=2, micro_batch_size=4, num_microbatches=2)
    assert plain.key() == "dp2 tp1 pp2 mb4 M2 1f1b rc0 z0 sp0"
    assert (plain.world_size, plain.global_batch_size, plain.grid) == (4, 16, (2, 1, 2))
    fancy = Layout(dp=2, tp=4, pp=2, micro_batch_size=1, num_microbatches=4, schedule="interleaved_1f1b", chunks=2,
                   recompute="full", zero_stage=2, sequence_parallel=True)
    assert fancy.key() == "dp2 tp4 pp2 mb1 M4 interleaved_1f1bx2 rc1 z2 sp1"
    assert fancy.world_size == 16 and fancy.global_batch_size == 8


def test_layout_overrides_set_every_field():
    fancy = Layout(dp=2, tp=4, pp=2, micro_batch_size=3, num_microbatches=4, schedule="interleaved_1f1b", chunks=2,
                   recompute="full", zero_stage=2, sequence_parallel=True)
    values = dict(item.split("=", 1) for item in fancy.overrides())
    assert values == {
        "parallel.dp": "2", "parallel.tp": "4", "parallel.pp": "2",
        "trainer.per_device_train_batch_size": "3", "trainer.gradient_accumulation_steps": "4",
        "trainer.global_batch_size": "24", "trainer.train_schedule": "interleaved_1f1b",
        "trainer.pipeline_chunks": "2", "trainer.activation_checkpointing": "true",
        "trainer.activation_checkpoint_ratio": "null", "trainer.zero_optimization": "true",
        "trainer.zero_stage": "2", "trainer.sequence_parallel": "true"}
    plain = dict(item.split("=", 1) for item in layout().overrides())
    assert plain["trainer.pipeline_chunks"] == "null"
    assert plain["trainer.activation_checkpointing"] == "false"
    assert plain["trainer.zero_optimization"] == "false"
    assert plain["trainer.sequence_parallel"] == "false"
    assert "trainer.selective_recompute" not in plain
    assert json.loads(json.dumps(fancy.to_json())) == dataclasses.asdict(fancy)
    assert Layout.from_json(json.loads(json.dumps(fancy.to_json()))) == fancy


def test_selective_recomputation_and_zero_3_run_as_the_runtime_names_them():
    chosen = layout(dp=2, recompute="selective", zero_stage=3)
    assert chosen.key() == "dp2 tp1 pp1 mb1 M8 1f1b rcsel z3 sp0"
    values = dict(item.split("=", 1) for item in chosen.overrides())
    assert values["trainer.activation_checkpointing"] == "selective"
    assert values["trainer.selective_recompute"] == "matmuls"
    assert (values["trainer.zero_optimization"], values["trainer.zero_stage"]) == ("true", "3")
    for zero in (1, 2):
        values = dict(item.split("=", 1) for item in layout(dp=2, zero_stage=zero).overrides())
        assert (values["trainer.zero_optimization"], values["trainer.zero_stage"]) == ("true", str(zero))
    assert layout(recompute="full").recomputes and chosen.recomputes and not layout().recomputes
    # Plans written when recomputation was a bool still read.
    old = {**layout().to_json(), "recompute": True}
    assert Layout.from_json(old).recompute == "full"


@pytest.mark.parametrize("fields", [{"recompute": True}, {"recompute": "some"}, {"zero_stage": 4}])
def test_a_layout_refuses_what_no_run_can_be(fields):
    with pytest.raises(ValueError, match="choose one of"):
        layout(**fields)


# --- collectives ---------------------------------------------------------------------------------------------


def test_ring_collectives_vanish_for_one_rank_or_no_bytes():
    link = Link(bandwidth_gbs=10.0, latency_us=5.0)
    assert all_reduce_seconds(1e9, 1, link) == 0.0
    assert gather_seconds(1e9, 1, link) == 0.0
    assert all_reduce_seconds(0, 8, link) == 0.0
    assert gather_seconds(0, 8, link) == 0.0


@pytest.mark.parametrize("size", [2, 4, 8])
def test_ring_all_reduce_and_gather_formulas(size):
    bandwidth_only = Link(bandwidth_gbs=10.0, latency_us=0.0)
    nbytes = 1e9
    one_pass = nbytes / 10e9
    assert all_reduce_seconds(nbytes, size, bandwidth_only) == pytest.approx(2 * (size - 1) / size * one_pass)
    assert gather_seconds(nbytes, size, bandwidth_only) == pytest.approx((size - 1) / size * one_pass)
    with_latency = Link(bandwidth_gbs=10.0, latency_us=7.0)
    assert all_reduce_seconds(nbytes, size, with_latency) == pytest.approx(
        2 * (size - 1) * 7e-6 + 2 * (size - 1) / size * one_pass)
    assert gather_seconds(nbytes, size, with_latency) == pytest.approx((size - 1) * 7e-6 + (size - 1) / size * one_pass)


def test_ring_all_reduce_grows_towards_twice_the_message():
    link = Link(bandwidth_gbs=1.0, latency_us=0.0)
    times = [all_reduce_seconds(1e9, size, link) for size in (2, 4, 8, 64)]
    assert times == sorted(times)
    assert times[0] == pytest.approx(1.0)
    assert times[-1] == pytest.approx(2 * 63 / 64)
    # A tiny message costs the latency of each ring step: 2 (t - 1) for an all-reduce, t - 1 for a gather.
    slow_start = Link(bandwidth_gbs=1.0, latency_us=10.0)
    assert all_reduce_seconds(1, 4, slow_start) == pytest.approx(6 * 10e-6, rel=1e-3)
    assert gather_seconds(1, 4, slow_start) == pytest.approx(3 * 10e-6, rel=1e-3)


# --- GraphProfile.scaled -------------------------------------------------------------------------------------


def test_scaled_profile_grows_activations_not_parameters():
    profile = synthetic_profile(forward_all_reduce=HIDDEN, backward_all_reduce=HIDDEN)
    profile = dataclasses.replace(profile, bytes_moved=tuple(range(0, 3 * len(profile), 3)),
                                  ops=tuple(range(len(profile))), output_bytes=5000)
    doubled = profile.scaled(2)
    assert doubled.micro_batch_size == 2
    assert doubled.flops == tuple(2 * v for v in profile.flops)
    assert doubled.bytes_moved == tuple(2 * v for v in profile.bytes_moved)
    assert doubled.saved_bytes == tuple(2 * v for v in profile.saved_bytes)
    assert doubled.crossing_bytes == tuple(2 * v for v in profile.crossing_bytes)
    assert doubled.forward_all_reduce == tuple(2 * v for v in profile.forward_all_reduce)
    assert doubled.backward_all_reduce == tuple(2 * v for v in profile.backward_all_reduce)
    assert doubled.output_bytes == 10000
    assert doubled.params == profile.params
    assert doubled.ops == profile.ops
    assert doubled.layer_starts == profile.layer_starts
    assert doubled.scaled(1) == profile
    assert GraphProfile.from_json(json.loads(json.dumps(doubled.to_json()))) == doubled


# --- cuts ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
def test_pipeline_cuts_fall_between_layers(pp):
    pieces = gpu_model().pieces(layout(pp=pp))
    assert len(pieces) == pp
    assert [p.params for p in pieces] == [LAYERS // pp * UNITS_PER_LAYER * PARAMS_PER_UNIT] * pp
    assert [p.send_bytes for p in pieces] == [HIDDEN] * (pp - 1) + [0]


@pytest.mark.parametrize(("pp", "chunks"), [(10, 1), (5, 2), (8, 2)])
def test_more_pieces_than_cuts_is_a_layout_error(pp, chunks):
    # 8 layer starts (the first one after the free embedding included): at most 9 pieces.
    schedule = "interleaved_1f1b" if chunks > 1 else "1f1b"
    too_many = layout(pp=pp, chunks=chunks, schedule=schedule, num_microbatches=2 * pp)
    with pytest.raises(LayoutError, match=f"{pp * chunks} needed"):
        gpu_model().predict(too_many)


def test_nine_pieces_still_fit_the_cuts():
    assert len(gpu_model().pieces(layout(pp=9, num_microbatches=9))) == 9


# --- step time -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("microbatches", [4, 8, 16])
def test_simulated_and_closed_form_1f1b_steps_agree(pp, microbatches):
    model = gpu_model()
    chosen = layout(pp=pp, num_microbatches=microbatches)
    simulated = model.predict(chosen, simulate_schedule=True)
    quick = model.predict(chosen, simulate_schedule=False)
    assert simulated.simulated and not quick.simulated
    assert quick.step_s == pytest.approx(simulated.step_s, rel=0.1)
    assert simulated.stage_memory == quick.stage_memory


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("microbatches", [4, 8, 16])
def test_1f1b_step_follows_the_bubble_formula(pp, microbatches):
    model = gpu_model()
    chosen = layout(pp=pp, num_microbatches=microbatches)
    per_microbatch = max(p.forward + p.backward for p in model.pieces(chosen))
    full_model = LAYERS * UNITS_PER_LAYER * FLOPS_PER_UNIT * 3 / preset("h100-80").accelerator.flops_per_s("float32")
    assert per_microbatch == pytest.approx(full_model / pp, rel=0.01)
    prediction = model.predict(chosen)
    assert prediction.step_s == pytest.approx((microbatches + pp - 1) * per_microbatch, rel=0.02)
    assert prediction.breakdown["compute_s"] == pytest.approx(microbatches * per_microbatch, rel=0.01)
    assert prediction.breakdown["bubble_s"] == pytest.approx((pp - 1) * per_microbatch, rel=0.05, abs=1e-3)


def test_deeper_pipelines_step_faster_but_waste_more():
    model = gpu_model()
    steps = [model.predict(layout(pp=pp, num_microbatches=8)).step_s for pp in (1, 2, 4, 8)]
    assert steps == sorted(steps, reverse=True)
    # (M + pp - 1) / (M pp) of the unpipelined step: the efficiency falls with pp.
    for pp, step in zip((2, 4, 8), steps[1:]):
        assert step / steps[0] == pytest.approx((8 + pp - 1) / (8 * pp), rel=0.02)


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    model = gpu_model()
    steps = {}
    for schedule, chunks in (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
        chosen = layout(pp=4, schedule=schedule, chunks=chunks)
        simulated = model.predict(chosen).step_s
        assert model.predict(chosen, simulate_schedule=False).step_s == pytest.approx(simulated, rel=0.1)
        steps[schedule] = simulated
    assert steps["interleaved_1f1b"] < steps["1f1b"]
    assert steps["zb_h1"] < steps["1f1b"]


def test_quick_step_seconds_is_the_closed_form():
    model = gpu_model()
    chosen = layout(pp=4, num_microbatches=8)
    pieces = model.pieces(chosen)
    link = Link(bandwidth_gbs=1.0, latency_us=0.0)
    work = pieces[0].forward + pieces[0].backward
    transfers = 2 * 3 * HIDDEN / 1e9
    expected = 8 * work + 3 * work + transfers + 0.5 + 0.25
    assert quick_step_seconds(pieces, chosen, [0.5, 0.1, 0.1, 0.1], [0.25] * 4, link) == pytest.approx(expected,
                                                                                                       rel=1e-3)


def test_recompute_costs_a_forward_per_microbatch():
    model = gpu_model()
    plain = model.predict(layout(pp=2))
    recomputed = model.predict(layout(pp=2, recompute="full"))
    piece = model.pieces(layout(pp=2))[0]
    assert plain.breakdown["recompute_s"] == 0.0
    assert recomputed.breakdown["recompute_s"] == pytest.approx(8 * piece.recompute)
    assert piece.recompute == pytest.approx(piece.forward)
    assert recomputed.step_s == pytest.approx(plain.step_s + (8 + 1) * piece.recompute, rel=0.02)


def test_data_parallel_reduction_uses_the_link_its_group_crosses():
    model = gpu_model(nodes=2, overlap_grad_reduce=False)
    gradient_bytes = LAYERS * UNITS_PER_LAYER * PARAMS_PER_UNIT * 4
    cluster = preset("h100-80")
    one_node = model.predict(layout(dp=8)).breakdown["dp_comm_s"]
    two_nodes = model.predict(layout(dp=16)).breakdown["dp_comm_s"]
    assert model.predict(layout(dp=1)).breakdown["dp_comm_s"] == 0.0
    assert one_node == pytest.approx(all_reduce_seconds(gradient_bytes, 8, cluster.intra_node))
    assert two_nodes == pytest.approx(all_reduce_seconds(gradient_bytes, 16, cluster.inter_node))
    assert two_nodes > one_node


@pytest.mark.parametrize("dp", [8, 16])
def test_an_overlapped_reduction_hides_behind_the_last_backward(dp):
    """Buckets start during the stage's last backward: what it cannot hide stays, and at least the last bucket."""
    cluster, gradient_bytes = preset("h100-80"), LAYERS * UNITS_PER_LAYER * PARAMS_PER_UNIT * 4
    plain = gpu_model(overlap_grad_reduce=False).predict(layout(dp=dp))
    overlapped = gpu_model().predict(layout(dp=dp))
    whole = all_reduce_seconds(gradient_bytes, dp, cluster.intra_node if dp == 8 else cluster.inter_node)
    assert plain.breakdown["dp_comm_s"] == pytest.approx(whole)
    backward = gpu_model().pieces(layout(dp=dp))[0].backward
    buckets = gradient_bytes / (25 * 2**20)
    assert overlapped.breakdown["dp_comm_s"] == pytest.approx(max(whole - backward, whole / buckets))
    assert overlapped.step_s == pytest.approx(plain.step_s - whole + overlapped.breakdown["dp_comm_s"])


def test_every_step_reduces_its_loss_and_gradient_norm_over_all_processes():
    model = gpu_model()
    cluster = preset("h100-80")
    assert model.predict(layout(dp=1)).breakdown["sync_s"] == 0.0
    one_node = model.predict(layout(dp=2, pp=4))
    assert one_node.breakdown["sync_s"] == pytest.approx(2 * all_reduce_seconds(8, 8, cluster.intra_node))
    assert model.predict(layout(dp=16)).breakdown["sync_s"] == pytest.approx(
        2 * all_reduce_seconds(8, 16, cluster.inter_node))
    quick = model.predict(layout(dp=2, pp=4), simulate_schedule=False)
    assert quick.step_s >= quick.breakdown["compute_s"] + quick.breakdown["sync_s"]


def test_cpu_workers_beyond_the_cores_share_them():
    profile = synthetic_profile()
    two_cores = dataclasses.replace(this_machine(4), cores_per_node=2)
    four_cores = dataclasses.replace(two_cores, cores_per_node=4)
    shared = CostModel(lambda tp, sequence_parallel: profile, two_cores)
    alone = CostModel(lambda tp, sequence_parallel: profile, four_cores)
    single = shared.pieces(layout(dp=1))[0].forward
    assert shared.pieces(layout(dp=2))[0].forward == pytest.approx(single)
    assert shared.pieces(layout(dp=4))[0].forward == pytest.approx(2 * single)
    assert alone.pieces(layout(dp=4))[0].forward == pytest.approx(single)
    gpu_single = gpu_model().pieces(layout(dp=1))[0].forward
    assert gpu_model().pieces(layout(dp=8))[0].forward == pytest.approx(gpu_single)
    # The optimizer step streams Adam's state through memory, slowed as the compute is (four to two cores).
    params = LAYERS * UNITS_PER_LAYER * PARAMS_PER_UNIT
    bandwidth = two_cores.accelerator.memory_bandwidth_gbs * 1e9
    assert shared.predict(layout(dp=4)).breakdown["optimizer_s"] == pytest.approx(params * 28 / bandwidth * 2)
    assert alone.predict(layout(dp=4)).breakdown["optimizer_s"] == pytest.approx(params * 28 / bandwidth)


# --- memory --------------------------------------------------------------------------------------------------


def test_in_flight_peak_of_1f1b_and_gpipe_lists():
    weights = {0: 1}
    for microbatches in (2, 4, 8):
        for stage in range(4):
            one_f_one_b = build_schedule(name="1f1b", stage_id=stage, num_stages=4, num_microbatches=microbatches)
            gpipe = build_schedule(name="gpipe", stage_id=stage, num_stages=4, num_microbatches=microbatches)
            assert _in_flight_peak(one_f_one_b, weights) == min(4 - stage, microbatches)
            assert _in_flight_peak(gpipe, weights) == microbatches
    # Interleaved: (pp - s - 1) * 2 + (chunks - 1) * pp warm-up forwards over both chunks, plus one.
    for stage, expected in ((0, 5), (1, 3)):
        interleaved = build_schedule(name="interleaved_1f1b", stage_id=stage, num_stages=2, num_microbatches=4,
                                     num_chunks=2)
        assert _in_flight_peak(interleaved, {0: 1, 1: 1}) == expected
        per_chunk = [_in_flight_peak(interleaved, {0: 1, 1: 0}), _in_flight_peak(interleaved, {0: 0, 1: 1})]
        assert max(per_chunk) <= expected <= sum(per_chunk)
    # Zero bubble: a microbatch stays until its weight gradient, at most pp of them on any stage.
    peaks = [_in_flight_peak(build_schedule(name="zb_h1", stage_id=s, num_stages=4, num_microbatches=8), weights)
             for s in range(4)]
    assert peaks[0] == 4 and max(peaks) <= 4


@pytest.mark.parametrize(("pp", "microbatches"), [(4, 8), (4, 4), (4, 2), (2, 8)])
def test_1f1b_first_stage_holds_pp_microbatches_last_holds_one(pp, microbatches):
    model = gpu_model()
    per_microbatch = LAYERS // pp * UNITS_PER_LAYER * SAVED_PER_UNIT
    held = activation_bytes(model, layout(pp=pp, num_microbatches=microbatches))
    assert held[0] == min(pp, microbatches) * per_microbatch
    assert held[-1] == per_microbatch
    assert held == [min(pp - s, microbatches) * per_microbatch for s in range(pp)]


def test_gpipe_holds_every_microbatch():
    model = gpu_model()
    per_microbatch = LAYERS // 4 * UNITS_PER_LAYER * SAVED_PER_UNIT
    assert activation_bytes(model, layout(pp=4, schedule="gpipe")) == [8 * per_microbatch] * 4


def test_a_stage_keeps_what_it_receives_besides_its_saves():
    profile = synthetic_profile()
    # Of what crosses each cut, the profile files half under a later unit's saves; the other half no unit saves,
    # yet a stage starting there keeps it (its received input) until the microbatch's backward.
    with_inputs = dataclasses.replace(profile, received_saved_bytes=tuple(c // 2 for c in profile.crossing_bytes))
    chosen = layout(pp=4)
    plain = activation_bytes(gpu_model(profile), chosen)
    received = activation_bytes(gpu_model(with_inputs), chosen)
    in_flight = [4, 3, 2, 1]  # 1F1B: stage s holds pp - s microbatches
    assert received[0] == plain[0]  # the first stage is fed the model's inputs
    assert [r - p for r, p in zip(received[1:], plain[1:])] == [n * HIDDEN // 2 for n in in_flight[1:]]


def test_recompute_keeps_layer_inputs_and_one_layer():
    model = gpu_model()
    plain = activation_bytes(model, layout(pp=4))
    recomputed = activation_bytes(model, layout(pp=4, recompute="full"))
    layers_per_stage = LAYERS // 4
    one_layer = UNITS_PER_LAYER * SAVED_PER_UNIT
    assert recomputed == [(4 - s) * layers_per_stage * HIDDEN + one_layer for s in range(4)]
    assert all(r < p for r, p in zip(recomputed, plain))


LAYER_PARAMS = UNITS_PER_LAYER * PARAMS_PER_UNIT
BUCKET = PARAMS_PER_UNIT  # elements of full gradients a ZeRO 2 or 3 rank holds before a reduce-scatter


@pytest.mark.parametrize("dp", [2, 4])
def test_zero_stages_shard_the_model_state(dp):
    model = gpu_model(zero_bucket_elements=BUCKET)
    stage_params = LAYERS // 2 * LAYER_PARAMS
    memory = {z: model.predict(layout(dp=dp, pp=2, zero_stage=z), simulate_schedule=False).stage_memory
              for z in (0, 1, 2, 3)}
    sharded = 1 - 1 / dp
    for stage in range(2):
        assert memory[0][stage] - memory[1][stage] == pytest.approx(stage_params * 8 * sharded, abs=1)
        # ZeRO 2: the gradients sharded too (float32 pieces), one bucket of full gradients waiting.
        assert memory[1][stage] - memory[2][stage] == pytest.approx(stage_params * 4 * sharded - BUCKET * 4, abs=1)
        # ZeRO 3: all the model state is 1/dp of ZeRO 0's (16 bytes a parameter in float32), plus the bucket and
        # two gathered parts (layers) in the model's dtype.
        zero_0_state = stage_params * FP32_STATE_BYTES
        assert memory[3][stage] - (memory[0][stage] - zero_0_state) == pytest.approx(
            zero_0_state / dp + BUCKET * 4 + 2 * LAYER_PARAMS * 4, abs=1)


def test_zero_3_holds_a_zero_bubble_weight_pass_whole_piece():
    model = gpu_model(zero_bucket_elements=BUCKET)
    stage_params = LAYERS // 2 * LAYER_PARAMS
    zero_bubble = model.predict(layout(dp=4, pp=2, zero_stage=3, schedule="zb_h1")).stage_memory
    plain = model.predict(layout(dp=4, pp=2, schedule="zb_h1")).stage_memory
    for stage in range(2):
        activations = plain[stage] - stage_params * FP32_STATE_BYTES
        assert zero_bubble[stage] - activations == pytest.approx(
            stage_params * FP32_STATE_BYTES / 4 + BUCKET * 4 + stage_params * 4, abs=1)


def test_zero_with_half_precision_shards_master_weights_too():
    model = gpu_model(synthetic_profile(dtype_bytes=2), zero_bucket_elements=BUCKET)
    stage_params = LAYERS * UNITS_PER_LAYER * PARAMS_PER_UNIT
    z0, z1, z2, z3 = (model.predict(layout(dp=4, zero_stage=z), simulate_schedule=False).max_memory
                      for z in (0, 1, 2, 3))
    # bf16 weight 2 + gradient 2, fp32 master 4 + moments 8: stage 1 shards 12 bytes; stage 2 the gradients too,
    # each rank summing its piece in float32 (4 / dp for 2), with a bucket of bf16 gradients; stage 3 the weights.
    assert z0 - z1 == pytest.approx(stage_params * 12 * 3 / 4, abs=1)
    assert z1 - z2 == pytest.approx(stage_params * (2 - 4 / 4) - BUCKET * 2, abs=1)
    assert z2 - z3 == pytest.approx(stage_params * 2 * 3 / 4 - 2 * LAYER_PARAMS * 2, abs=1)


def test_zero_shards_the_optimizer_step():
    model = gpu_model()
    plain = model.predict(layout(dp=4)).breakdown["optimizer_s"]
    assert model.predict(layout(dp=4, zero_stage=1)).breakdown["optimizer_s"] == pytest.approx(plain / 4)


# --- selective recomputation ---------------------------------------------------------------------------------

SELECTIVE_KEPT = HIDDEN  # of the 2 x HIDDEN each layer unit saves, what the "matmuls" policy keeps
SELECTIVE_FLOPS = 3 * FLOPS_PER_UNIT // 4  # of each layer unit's FLOPs, those of the operators it saves


def selective_model() -> CostModel:
    return gpu_model(synthetic_profile(selective_kept=SELECTIVE_KEPT, selective_flops=SELECTIVE_FLOPS))


def test_selective_recompute_keeps_what_its_policy_saves_and_one_layer_beyond():
    model = selective_model()
    plain = activation_bytes(model, layout(pp=4))
    full = activation_bytes(model, layout(pp=4, recompute="full"))
    selective = activation_bytes(model, layout(pp=4, recompute="selective"))
    layers_per_stage = LAYERS // 4
    kept = layers_per_stage * (HIDDEN + UNITS_PER_LAYER * SELECTIVE_KEPT)  # per microbatch in flight
    recomputed_layer = UNITS_PER_LAYER * (SAVED_PER_UNIT - SELECTIVE_KEPT)
    assert selective == [(4 - s) * kept + recomputed_layer for s in range(4)]
    assert all(f < s < p for f, s, p in zip(full, selective, plain))


def test_selective_recompute_reruns_the_forward_less_the_products_it_saved():
    model = selective_model()
    full = model.pieces(layout(pp=2, recompute="full"))[0]
    selective = model.pieces(layout(pp=2, recompute="selective"))[0]
    assert full.recompute == pytest.approx(full.forward)
    # The synthetic units move no bytes and launch nothing: their forward is all FLOPs, three quarters saved.
    assert selective.recompute == pytest.approx(full.forward / 4)
    steps = [model.predict(layout(pp=2, recompute=mode)) for mode in ("off", "selective", "full")]
    assert steps[0].step_s < steps[1].step_s < steps[2].step_s
    assert steps[1].breakdown["recompute_s"] == pytest.approx(8 * selective.recompute)


def test_selective_recompute_runs_no_tensor_parallel_collective_again():
    # The collectives live inside merak's parallel linears, whose outputs the policy saves; full recomputation
    # runs them again with the rest of the forward.
    def pieces(forward_all_reduce: int):
        profile = synthetic_profile(tp=2, forward_all_reduce=forward_all_reduce, selective_kept=SELECTIVE_KEPT,
                                    selective_flops=SELECTIVE_FLOPS)
        model = gpu_model(profile)
        return [model.pieces(layout(tp=2, pp=2, recompute=mode))[0] for mode in ("full", "selective")]

    (full_quiet, selective_quiet), (full_busy, selective_busy) = pieces(0), pieces(2**24)
    assert full_busy.recompute > full_quiet.recompute
    assert selective_busy.recompute == pytest.approx(selective_quiet.recompute)


def test_a_profile_without_the_policys_numbers_prices_selective_as_full():
    old = dataclasses.replace(synthetic_profile(), selective_kept_bytes=(), selective_saved_flops=())
    model = gpu_model(old)
    assert activation_bytes(model, layout(pp=2, recompute="selective")) == activation_bytes(
        model, layout(pp=2, recompute="full"))
    assert model.pieces(layout(pp=2, recompute="selective"))[0].recompute == pytest.approx(
        model.pieces(layout(pp=2, recompute="full"))[0].recompute)


@pytest.fixture(scope="module")
def toy_gpt_profile(cache_dir) -> GraphProfile:
    """The gpt recipe's toy model (4 layers, width 32, 32 tokens, no dropout) profiled at tensor degree 1."""
    from merak.autoplan.planner import compose_recipe, single_process_settings
    from merak.autoplan.profile import profile_recipe

    spec, cfg = compose_recipe("gpt", ["model=toy", "trainer.global_batch_size=16"])
    return profile_recipe(spec, single_process_settings(spec, cfg), tp=1, sequence_parallel=False)


def test_selective_keeps_less_than_no_recomputation_and_more_than_full_for_a_gpt(toy_gpt_profile):
    model = gpu_model(toy_gpt_profile)
    chosen = {mode: layout(pp=2, recompute=mode) for mode in ("off", "full", "selective")}
    memory = {mode: model.predict(c, simulate_schedule=False).stage_memory for mode, c in chosen.items()}
    assert all(f < s < p for f, s, p in zip(memory["full"], memory["selective"], memory["off"]))
    recomputed = {mode: sum(p.recompute for p in model.pieces(c)) for mode, c in chosen.items()}
    assert 0 < recomputed["selective"] < recomputed["full"]


def test_the_profile_keeps_what_the_runtimes_policy_keeps(toy_gpt_profile):
    """A GPT-2 block of the toy's sizes run as a checkpointed stage part, as merak's activation meter counts what
    it keeps: everything autograd saves, only its input (full recomputation), or its input and what the
    "matmuls" policy saves. The profile's numbers for one of the toy's layers are the same."""
    import torch
    from tiny_models import GPT2BlockPart
    from transformers import GPT2Config

    from merak.pipeline import memory, recompute
    from merak.pipeline.recompute import StageRecomputation
    from merak.pipeline.stage import StageModule

    config = GPT2Config(n_embd=32, n_head=4, n_positions=32, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "sdpa"

    def kept(options: StageRecomputation) -> int:
        stage = StageModule([GPT2BlockPart(config)]).train()
        stage.configure_checkpointing(options)
        meter = memory.ActivationMeter(stage.parameters())
        with memory.active_meter(meter), recompute.microbatch_seed(1), meter.saving("microbatch"):
            stage(torch.randn(1, 32, 32, requires_grad=True))
        return meter.live_bytes()

    profile = toy_gpt_profile
    first, last = profile.layer_starts[1:3]
    layer_input = profile.crossing_bytes[first]
    assert kept(StageRecomputation()) == sum(profile.saved_bytes[first:last])
    assert kept(StageRecomputation(parts=1)) == layer_input
    assert kept(StageRecomputation(parts=1, saves="matmuls")) == layer_input + sum(
        profile.selective_kept_bytes[first:last])


# --- tensor parallelism --------------------------------------------------------------------------------------


def tp_model(message_bytes: int) -> CostModel:
    """A cost model whose profile at tp > 1 all-reduces ``message_bytes`` per layer in forward and backward."""
    plain = synthetic_profile()
    split = synthetic_profile(forward_all_reduce=message_bytes, backward_all_reduce=message_bytes, tp=2)
    return CostModel(lambda tp, sequence_parallel: split if tp > 1 else plain, preset("h100-80"))


def test_tensor_parallel_collectives_cost_time():
    chosen = layout(tp=2, num_microbatches=4)
    silent = tp_model(0).predict(chosen)
    small = tp_model(HIDDEN).predict(chosen)
    large = tp_model(16 * HIDDEN).predict(chosen)
    assert silent.breakdown["tp_comm_s"] == 0.0
    link = preset("h100-80").intra_node
    assert small.breakdown["tp_comm_s"] == pytest.approx(4 * LAYERS * 2 * all_reduce_seconds(HIDDEN, 2, link))
    assert 0 < small.breakdown["tp_comm_s"] < large.breakdown["tp_comm_s"]
    assert silent.step_s < small.step_s < large.step_s


def test_every_collective_of_a_unit_pays_the_rings_latency():
    # A layer's first unit all-reducing its gradient in three collectives (as separate query, key and value
    # projections do) rather than one: the same bytes, two more rings' latency per layer and microbatch.
    chosen = layout(tp=2, num_microbatches=4)
    one = tp_model(HIDDEN).predict(chosen).breakdown["tp_comm_s"]
    split = synthetic_profile(forward_all_reduce=HIDDEN, backward_all_reduce=HIDDEN, tp=2)
    calls = tuple(3 * int(bool(b)) for b in split.backward_all_reduce)
    three = dataclasses.replace(split, backward_all_reduce_calls=calls)
    model = CostModel(lambda tp, sequence_parallel: three if tp > 1 else synthetic_profile(), preset("h100-80"))
    latency = preset("h100-80").intra_node.latency_us * 1e-6
    ring = 2 * (2 - 1)  # ring steps of an all-reduce among two
    assert model.predict(chosen).breakdown["tp_comm_s"] - one == pytest.approx(4 * LAYERS * 2 * ring * latency)


def test_one_tensor_rank_has_no_collectives():
    profile = synthetic_profile(forward_all_reduce=16 * HIDDEN, backward_all_reduce=16 * HIDDEN)
    assert sum(profile.forward_all_reduce) == LAYERS * 16 * HIDDEN
    model = CostModel(lambda tp, sequence_parallel: profile, preset("h100-80"))
    assert model.predict(layout(tp=1)).breakdown["tp_comm_s"] == 0.0
    assert model.predict(layout(tp=2)).breakdown["tp_comm_s"] > 0.0


def test_tied_weights_on_two_stages_sum_their_gradients_after_the_backward():
    count = 1 + LAYERS * UNITS_PER_LAYER + 1
    tied = dataclasses.replace(synthetic_profile(), shared_params=((PARAMS_PER_UNIT, (1, count - 2)),))
    model = gpu_model(tied)
    link = preset("h100-80").intra_node
    piped = model.predict(layout(pp=2))
    assert piped.breakdown["tied_comm_s"] == pytest.approx(all_reduce_seconds(PARAMS_PER_UNIT * 4, 2, link))
    untied = gpu_model().predict(layout(pp=2))
    assert untied.breakdown["tied_comm_s"] == 0.0
    assert piped.step_s == pytest.approx(untied.step_s + piped.breakdown["tied_comm_s"])
    assert model.predict(layout()).breakdown["tied_comm_s"] == 0.0  # one stage holds both readers


# --- CPU processes sharing the cores -----------------------------------------------------------------------


def eight_on_two_cores(profile: GraphProfile | None = None, overlap_grad_reduce: bool = True) -> CostModel:
    """A cost model of ``profile`` (default: the synthetic one) on 8 CPU processes sharing 2 cores."""
    cluster = dataclasses.replace(this_machine(8), cores_per_node=2)
    profile = profile or synthetic_profile()
    return CostModel(lambda tp, sequence_parallel: profile, cluster, overlap_grad_reduce=overlap_grad_reduce)


def test_cpu_step_scalars_are_two_small_all_reduces_over_the_link():
    model = eight_on_two_cores()
    for dp in (4, 8):
        assert model.predict(layout(dp=dp)).breakdown["sync_s"] == pytest.approx(
            2 * all_reduce_seconds(8, dp, model.cluster.intra_node))


def test_zero_reduce_scatters_gradients_and_gathers_the_updated_weights():
    params = LAYERS * UNITS_PER_LAYER * PARAMS_PER_UNIT
    # The traffic itself: nothing hidden behind the backward (test_an_overlapped_reduction_hides_behind_...).
    gpu, link = gpu_model(overlap_grad_reduce=False), preset("h100-80").intra_node
    plain = gpu.predict(layout(dp=8)).breakdown["dp_comm_s"]
    assert plain == pytest.approx(all_reduce_seconds(params * 4, 8, link))
    # NCCL: a reduce-scatter and an all-gather move what one all-reduce does.
    assert gpu.predict(layout(dp=8, zero_stage=1)).breakdown["dp_comm_s"] == pytest.approx(
        2 * gather_seconds(params * 4, 8, link))
    # Mixed precision reduces the float32 copies' gradients, and gathers the half-precision weights.
    half = gpu_model(synthetic_profile(dtype_bytes=2), overlap_grad_reduce=False)
    assert half.predict(layout(dp=8)).breakdown["dp_comm_s"] == pytest.approx(plain)
    assert half.predict(layout(dp=8, zero_stage=1)).breakdown["dp_comm_s"] == pytest.approx(
        gather_seconds(params * 4, 8, link) + gather_seconds(params * 2, 8, link))
    # Gloo reduce-scatters by a whole all-reduce: ZeRO adds an all-gather, half an all-reduce.
    cpu = eight_on_two_cores(overlap_grad_reduce=False)
    whole = cpu.predict(layout(dp=8)).breakdown["dp_comm_s"]
    assert cpu.predict(layout(dp=8, zero_stage=1)).breakdown["dp_comm_s"] == pytest.approx(1.5 * whole)
    # ZeRO 2 reduce-scatters after every backward (each microbatch's), and gathers the updated weights at the end.
    zero_2 = cpu.predict(layout(dp=8, zero_stage=2)).breakdown
    assert zero_2["dp_comm_s"] == pytest.approx(0.5 * whole)
    assert zero_2["zero_comm_s"] == pytest.approx(8 * whole)


def test_zero_3_gathers_every_part_before_its_forward_and_its_backward():
    """Per microbatch: the piece's parameters all-gathered twice, the gradients reduce-scattered once; what the
    pass's compute hides (the next part prefetched) leaves at least the first part's gather."""
    params = LAYERS * LAYER_PARAMS
    fast = gpu_model()
    link = preset("h100-80").intra_node
    part = gather_seconds(LAYER_PARAMS * 4, 8, link)
    scatter = gather_seconds(params * 4, 8, link)
    hidden = fast.predict(layout(dp=8, zero_stage=3)).breakdown
    assert hidden["zero_comm_s"] == pytest.approx(8 * (2 * part + scatter))
    assert hidden["dp_comm_s"] == 0.0  # no weights to gather after the step: they are gathered as they are used
    # On a slow link the gathers outlast the compute: all the traffic of 2 x M x the stage's parameters shows.
    slow_link = Link(bandwidth_gbs=0.1, latency_us=0.0)
    slow = CostModel(lambda tp, sequence_parallel: synthetic_profile(),
                     dataclasses.replace(preset("h100-80"), intra_node=slow_link))
    piece = slow.pieces(layout(dp=8, zero_stage=3))[0]
    gathers = LAYERS * gather_seconds(LAYER_PARAMS * 4, 8, slow_link)
    assert gathers == pytest.approx(params * 4 * 7 / 8 / 0.1e9)
    compute_forward = piece.forward - piece.gather_forward
    compute_backward = piece.backward - piece.gather_backward - piece.scatter
    assert piece.gather_forward == pytest.approx(gathers - compute_forward)
    assert piece.gather_backward == pytest.approx(gathers - compute_backward)
    assert piece.scatter == pytest.approx(gather_seconds(params * 4, 8, slow_link))
    assert slow.predict(layout(dp=8, zero_stage=3)).step_s > slow.predict(layout(dp=8, zero_stage=1)).step_s
    # A split backward's weight-gradient pass gathers the whole piece again before it runs, nothing hidden.
    assert piece.gather_weight_pass == pytest.approx(gathers)
    weight_pass = StageCostModel([piece], 1, slow_link, recompute=False)
    input_s, weight_s = (weight_pass.of(0, kind(microbatch=0)) for kind in (BackwardInput, BackwardWeight))
    assert weight_s - input_s == pytest.approx(gathers + piece.scatter - piece.gather_backward)


def test_tensor_parallel_collectives_pay_the_links_latency_on_cpu_processes():
    message = 8  # bytes: the collectives cost their latency alone
    plain = synthetic_profile()
    split = synthetic_profile(forward_all_reduce=message, backward_all_reduce=message, tp=2)
    cluster = dataclasses.replace(this_machine(8), cores_per_node=2)
    model = CostModel(lambda tp, sequence_parallel: split if tp > 1 else plain, cluster)
    collectives = 2 * LAYERS  # per microbatch: one in each layer's forward and one in its backward
    latency = model.cluster.intra_node.latency_us * 1e-6
    # Ring steps of two ranks, whatever else runs: the link's latency each.
    for chosen in (layout(tp=2, pp=4, num_microbatches=1), layout(dp=4, tp=2, num_microbatches=1)):
        stages = chosen.pp
        assert model.predict(chosen).breakdown["tp_comm_s"] == pytest.approx(
            collectives / stages * 2 * latency, rel=1e-3)


def test_one_microbatch_keeps_one_pipeline_stage_busy_at_a_time():
    two_cores = dataclasses.replace(this_machine(4), cores_per_node=2)
    model = CostModel(lambda tp, sequence_parallel: synthetic_profile(), two_cores)
    single = model.pieces(layout())[0].forward  # the whole model's forward, alone
    one = model.pieces(layout(pp=4, num_microbatches=1))
    assert sum(piece.forward for piece in one) == pytest.approx(single)
    # Many microbatches keep all four stages busy on average over the step (fill and drain less): they share
    # the two cores.
    many = model.pieces(layout(pp=4, num_microbatches=64))
    average = 4 * 64 / (4 + 63)
    assert sum(piece.forward for piece in many) == pytest.approx(single * average / 2)
    assert CostModel._busy(layout(pp=4, num_microbatches=1), [1.0] * 4, 4) == pytest.approx(1.0)
    # Replicas count whole; a node holds its share of them.
    assert CostModel._busy(layout(dp=8, tp=2, num_microbatches=1), [1.0], 8) == pytest.approx(8.0)


# --- the cost model's simulation against autopipe's 1F1B score --------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_autopipes_1f1b_score_bounds_the_simulated_instruction_lists(seed):
    """merak.shard.autopipe scores partitions with a 1F1B model of data dependencies alone (Python and C++ alike);
    the cost model runs the real instruction lists through merak.pipeline.simulate, whose exchanges also wait for
    their partners. With free transfers the two agree on two stages, and autopipe's is a lower bound beyond."""
    import random

    from merak.autoplan.cost import VirtualStage, _lists, _stage_ends
    from merak.shard import autopipe

    rng = random.Random(seed)
    for stages in range(1, 7):
        microbatches = rng.randint(1, 12)
        forward = [rng.uniform(0.1, 3.0) for _ in range(stages)]
        backward = [rng.uniform(0.1, 6.0) for _ in range(stages)]
        pieces = [VirtualStage(forward=f, backward=b, recompute=0.0, send_bytes=0, params=0, saved=0, kept=0,
                               largest_layer=0, tp_seconds=0.0) for f, b in zip(forward, backward)]
        model = StageCostModel(pieces, stages, Link(bandwidth_gbs=1.0, latency_us=0.0), recompute=False)
        simulated = max(_stage_ends(_lists("1f1b", stages, 1, microbatches), model))
        scored = autopipe.simulate_1f1b(forward, backward, microbatches)
        if autopipe.native_available():
            assert autopipe._native.simulate_1f1b(forward, backward, microbatches) == scored
        if stages <= 2:
            assert simulated == pytest.approx(scored, rel=1e-12)
        else:
            assert simulated >= scored * (1 - 1e-12)
