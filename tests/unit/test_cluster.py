"""merak.autoplan.cluster: presets, links, CPU shares, loading from names, files and Hydra nodes, this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from merak.autoplan import cluster as cluster_module
from merak.autoplan.cluster import (
    NOMINAL_GLOO_LINK,
    PRESETS,
    Accelerator,
    Cluster,
    Link,
    load_cluster,
    preset,
    this_machine,
)
from merak.shard.costs import NOMINAL_RATES

CONF = Path(__file__).resolve().parents[2] / "merak" / "conf" / "cluster"


def test_presets_sizes_and_json_round_trip():
    assert set(PRESETS) == {"a100-40", "a100-80", "h100-80", "h200"}
    for name, described in PRESETS.items():
        assert preset(name) is described
        assert (described.nodes, described.devices_per_node) == (1, 8)
        assert described.world_size == 8
        bigger = described.with_size(nodes=64)
        assert (bigger.nodes, bigger.devices_per_node, bigger.world_size) == (64, 8, 512)
        assert bigger.accelerator == described.accelerator
        assert described.with_size(devices_per_node=4).world_size == 4
        data = json.loads(json.dumps(bigger.to_json()))
        assert Cluster.from_json(data) == bigger
        assert load_cluster(data) == bigger
        assert hash(Cluster.from_json(data)) == hash(bigger)
    h100 = preset("h100-80").accelerator
    assert h100.peak_tflops == {"float32": 67.0, "tfloat32": 494.0, "bfloat16": 989.0, "float16": 989.0}
    assert h100.flops_per_s("bfloat16") == pytest.approx(989e12 * 0.7)
    assert preset("h200").accelerator.memory_gib == 141.0
    assert preset("a100-80").accelerator.memory_bandwidth_gbs == 2039.0
    assert preset("h100-80").accelerator.seconds_per_op == NOMINAL_RATES["cuda"].seconds_per_op


def test_flops_per_s_aliases_and_fallbacks():
    import torch

    h100 = preset("h100-80").accelerator
    assert h100.flops_per_s(torch.bfloat16) == h100.flops_per_s("bf16") == h100.flops_per_s("bfloat16")
    assert h100.flops_per_s("float32") == pytest.approx(67e12 * 0.7)
    assert h100.flops_per_s("tf32") == pytest.approx(494e12 * 0.7)
    cpu = Accelerator("cpu", {"float32": 0.05}, 8.0, 10.0, 2e-6, 1.0)
    # A CPU described by its float32 rate computes half precision no faster.
    assert cpu.flops_per_s("bfloat16") == cpu.flops_per_s("float16") == pytest.approx(5e10)
    only_half = Accelerator("x", {"float16": 100.0, "int8": 50.0}, 8.0, 10.0, 0.0, 0.5)
    assert only_half.flops_per_s("bfloat16") == pytest.approx(50e12)
    assert only_half.flops_per_s("float64") == pytest.approx(25e12)  # the slowest figure known


def test_link_seconds_and_link_for():
    described = preset("h100-80").with_size(nodes=2)
    assert described.link_for([0, 1, 7]) is described.intra_node
    assert described.link_for([8, 15]) is described.intra_node
    assert described.link_for([7, 8]) is described.inter_node
    assert described.link_for([0, 8, 9]) is described.inter_node
    assert described.link_for([3]) is described.intra_node
    with pytest.raises(ValueError, match="outside"):
        described.link_for([0, 16])
    link = Link(bandwidth_gbs=2.0, latency_us=10.0)
    assert link.seconds(0) == pytest.approx(1e-5)
    assert link.seconds(4e9) == pytest.approx(2.0 + 1e-5)


def test_load_cluster_names_mappings_and_files(tmp_path):
    assert load_cluster("h100-80") is PRESETS["h100-80"]
    big = load_cluster({"preset": "h100-80", "nodes": 64, "inter_node": {"bandwidth_gbs": 25},
                        "accelerator": {"matmul_efficiency": 0.5, "peak_tflops": {"bfloat16": 900}}})
    assert (big.nodes, big.devices_per_node, big.world_size) == (64, 8, 512)
    assert big.inter_node == Link(25.0, 10.0)
    assert big.intra_node == PRESETS["h100-80"].intra_node
    assert big.accelerator.matmul_efficiency == 0.5
    assert big.accelerator.peak_tflops["bfloat16"] == 900.0
    assert big.accelerator.peak_tflops["float32"] == 67.0
    assert load_cluster({"preset": "a100-80", "nodes": 2, "devices_per_node": None}).world_size == 16

    path = tmp_path / "mine.yaml"
    path.write_text("preset: a100-40\nnodes: 4\ndevices_per_node: 4\n")
    for spec in (str(path), path):
        loaded = load_cluster(spec)
        assert (loaded.name, loaded.world_size) == ("a100-40", 16)
    full = tmp_path / "full.json"
    full.write_text(json.dumps(PRESETS["h200"].with_size(nodes=3).to_json()))
    assert load_cluster(str(full)) == PRESETS["h200"].with_size(nodes=3)
    with pytest.raises(ValueError, match="does not exist"):
        load_cluster(str(tmp_path / "absent.yaml"))


def test_load_cluster_errors():
    with pytest.raises(ValueError, match="a100-40, a100-80, h100-80, h200, this"):
        load_cluster("b200")
    with pytest.raises(ValueError, match="a100-40, a100-80, h100-80, h200, this"):
        load_cluster({"preset": "b200"})
    with pytest.raises(ValueError, match="a100-40, a100-80, h100-80, h200, this"):
        preset("b200")
    with pytest.raises(ValueError, match="gpus_per_node"):
        load_cluster({"preset": "h100-80", "gpus_per_node": 8})
    with pytest.raises(ValueError, match="bandwith_gbs"):
        load_cluster({"preset": "h100-80", "inter_node": {"bandwith_gbs": 8}})
    with pytest.raises(ValueError, match="nodes must be positive"):
        load_cluster({"preset": "h100-80", "nodes": 0})
    with pytest.raises(ValueError, match="devices_per_node must be positive"):
        load_cluster({"preset": "h100-80", "devices_per_node": -2})
    with pytest.raises(ValueError, match="bandwidth_gbs must be > 0"):
        load_cluster({"preset": "h100-80", "intra_node": {"bandwidth_gbs": 0}})
    with pytest.raises(ValueError, match="matmul_efficiency"):
        load_cluster({"preset": "h100-80", "accelerator": {"matmul_efficiency": 1.5}})
    data = PRESETS["h100-80"].to_json()
    del data["inter_node"]
    with pytest.raises(ValueError, match="missing key.*inter_node"):
        load_cluster(data)
    with pytest.raises(ValueError, match="processes"):
        load_cluster("this")


def test_this_machine_nominal():
    described = this_machine(4)
    cpu = NOMINAL_RATES["cpu"]
    assert (described.name, described.nodes, described.devices_per_node, described.world_size) == ("this", 1, 4, 4)
    assert described.accelerator.name == "cpu"
    assert described.accelerator.peak_tflops == {"float32": pytest.approx(cpu.flops_per_s / 1e12)}
    assert described.accelerator.flops_per_s("bfloat16") == pytest.approx(cpu.flops_per_s)
    assert described.accelerator.memory_bandwidth_gbs == pytest.approx(cpu.bytes_per_s / 1e9)
    assert described.accelerator.seconds_per_op == cpu.seconds_per_op
    assert described.accelerator.matmul_efficiency == 1.0
    assert described.intra_node == described.inter_node == NOMINAL_GLOO_LINK == Link(1.0, 50.0)
    assert described.cores_per_node == cluster_module.usable_cores() >= 1
    assert 0 < described.accelerator.memory_gib * 4 == pytest.approx(this_machine(1).accelerator
                                                                         .memory_gib)
    via_load = load_cluster("this", processes=4)
    assert via_load == described
    assert load_cluster({"preset": "this", "devices_per_node": 3}, processes=8).world_size == 3


def test_hydra_presets_load():
    files = sorted(CONF.glob("*.yaml"))
    assert {f.stem for f in files} == {"a100-40", "a100-80", "h100-80", "h200", "this"}
    for file in files:
        node = yaml.safe_load(file.read_text())
        assert node["preset"] == file.stem
        described = load_cluster(node, processes=2)
        if file.stem == "this":
            assert node["devices_per_node"] is None
            assert (described.name, described.world_size) == ("this", 2)
        else:
            assert described == PRESETS[file.stem]
            scaled = load_cluster({**node, "nodes": 64})
            assert scaled.world_size == 512


def test_hydra_composed_node_loads():
    from omegaconf import OmegaConf

    node = OmegaConf.create({"preset": "h100-80", "nodes": 64, "devices_per_node": 8,
                             "inter_node": {"bandwidth_gbs": 25}})
    assert load_cluster(node).world_size == 512
    assert load_cluster(node).inter_node.bandwidth_gbs == 25.0
