"""Damaged checkpoints give a CheckpointError naming the file, and a way forward.

Single process (no process group): a two-layer model's engine saves real
checkpoints (weights, optimizer pieces, RNG states), which are then truncated,
byte-flipped or deleted. Covers load_checkpoint, find_checkpoint's fallback to
the newest intact checkpoint, the refusal to save inf/NaN and merak-export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import pytest
import torch
from safetensors import safe_open
from tiny_engine import Input, Net, loss_fn, single_process  # noqa: F401  (a fixture)

from merak.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from merak.checkpoint import load as checkpoint_load
from merak.checkpoint import save as checkpoint_save
from merak.checkpoint.export import main as export_main
from merak.checkpoint.load import CheckpointSource
from merak.checkpoint.save import nonfinite_tensors
from merak.checkpoint.settings import CheckpointSettings
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.pipeline.stage import StageModule

MODEL = "model/pp000-tp000.safetensors"
OPTIMIZER = "optimizer/pp000-tp000-dp000.safetensors"

# -- a tiny engine and its checkpoints --------------------------------------------


def make_engine(state, seed: int = 0) -> PipelineEngine:
    torch.manual_seed(seed)
    net = Net()
    return PipelineEngine(model=net, stages=[StageModule([Input(net), net.second])], loss_fn=loss_fn, state=state,
                          schedule="1f1b", num_microbatches=2, total_steps=4,
                          optimizer=OptimizerSettings(learning_rate=0.1))


def train_step(engine, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    engine.train_step([{"x": torch.randn(2, 6, generator=generator), "y": torch.randn(2, 3, generator=generator)}
                       for _ in range(2)])


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in engine.named_parameters()}


def save(engine, run_dir, step: int) -> str:
    return save_checkpoint(engine, str(run_dir), step=step, trainer_state={"consumed_samples": step},
                           run_info={})


@pytest.fixture
def run(single_process, tmp_path):
    """checkpoint-1 and checkpoint-2 of a two-step run; the weights after step 1."""
    engine = make_engine(single_process)
    train_step(engine, 1)
    after_one = weights(engine)
    first = save(engine, tmp_path, 1)
    train_step(engine, 2)
    second = save(engine, tmp_path, 2)
    return {"dir": tmp_path, "first": first, "second": second, "after_one": after_one, "state": single_process}


def fresh_engine(run):
    """Another engine of the same model (other initial weights), to load into."""
    return make_engine(run["state"], seed=7)


def truncate(path: str, keep: int) -> tuple[int, int]:
    before = os.path.getsize(path)
    os.truncate(path, keep)
    return keep, before


def flip_header_bytes(path: str) -> None:
    """Damage the JSON header of a safetensors file in place (the size stays)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
    assert length > 40
    with open(path, "r+b") as handle:
        handle.seek(8 + length // 2)  # inside the header's JSON
        handle.write(b"\x00\xff\x00\xff")


def drop_manifest_index(checkpoint: str) -> None:
    """Make ``checkpoint`` look saved before the manifest carried each file's merak metadata."""
    path = os.path.join(checkpoint, "manifest.json")
    with open(path, encoding="utf-8") as handle:
        manifest = json.load(handle)
    for record in manifest["files"].values():
        record.pop("merak", None)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)


def relist(checkpoint: str, relative: str) -> None:
    """Record ``relative``'s current bytes in the manifest, as if they had been saved so."""
    path = os.path.join(checkpoint, "manifest.json")
    with open(path, encoding="utf-8") as handle:
        manifest = json.load(handle)
    with open(os.path.join(checkpoint, relative), "rb") as handle:
        data = handle.read()
    manifest["files"][relative].update(bytes=len(data), crc32=zlib.crc32(data))
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)


# -- loading a damaged checkpoint ---------------------------------------------------


@pytest.mark.parametrize("indexed", [True, False], ids=["manifest-index", "old-checkpoint"])
def test_truncated_model_file(run, indexed):
    checkpoint = run["second"]
    if not indexed:
        drop_manifest_index(checkpoint)
    size, listed = truncate(os.path.join(checkpoint, MODEL), 200)
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint}: {MODEL} is truncated ({size} bytes, the "
                                                        f"manifest says {listed})")):
        load_checkpoint(fresh_engine(run), checkpoint)


@pytest.mark.parametrize("indexed", [True, False], ids=["manifest-index", "old-checkpoint"])
@pytest.mark.parametrize("relative", [MODEL, OPTIMIZER])
def test_header_damaged_file_of_the_same_size(run, indexed, relative):
    checkpoint = run["second"]
    if not indexed:
        drop_manifest_index(checkpoint)
    size = os.path.getsize(os.path.join(checkpoint, relative))
    flip_header_bytes(os.path.join(checkpoint, relative))
    assert os.path.getsize(os.path.join(checkpoint, relative)) == size
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint}: {relative} is damaged (CRC32 0x")):
        load_checkpoint(fresh_engine(run), checkpoint)


@pytest.mark.parametrize("relative", [MODEL, OPTIMIZER])
def test_missing_file(run, relative):
    checkpoint = run["second"]
    os.remove(os.path.join(checkpoint, relative))
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint}: {relative} is missing")):
        load_checkpoint(fresh_engine(run), checkpoint)


@pytest.mark.parametrize("indexed", [True, False], ids=["manifest-index", "old-checkpoint"])
def test_unreadable_file_that_matches_its_manifest(run, indexed):
    """Bytes that pass the size and CRC32 check but do not parse: still a CheckpointError naming the file."""
    checkpoint = run["second"]
    if not indexed:
        drop_manifest_index(checkpoint)
    flip_header_bytes(os.path.join(checkpoint, MODEL))
    relist(checkpoint, MODEL)
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint}: {MODEL} cannot be read (")):
        load_checkpoint(fresh_engine(run), checkpoint)


@pytest.mark.parametrize("indexed", [True, False], ids=["manifest-index", "old-checkpoint"])
def test_only_the_files_read_are_opened(run, indexed):
    """Loading weights only never opens (or checks) the optimizer files, so their damage does not
    matter there."""
    checkpoint = run["second"]
    if not indexed:
        drop_manifest_index(checkpoint)
    truncate(os.path.join(checkpoint, OPTIMIZER), 10)
    engine = fresh_engine(run)
    state = load_checkpoint(engine, checkpoint, options=CheckpointSettings(no_load_optim=True))
    assert state["step"] == 2
    with pytest.raises(CheckpointError, match=re.escape(f"{OPTIMIZER} is truncated (10 bytes")):
        load_checkpoint(engine, checkpoint)


def test_the_manifest_says_where_each_tensor_is(run, monkeypatch):
    """No header is read to find the tensors: each file is opened once, to read its tensors."""
    opened = []

    def counting_open(path, **kwargs):
        opened.append(os.path.relpath(path, run["second"]))
        return safe_open(path, **kwargs)

    monkeypatch.setattr(checkpoint_load, "safe_open", counting_open)
    load_checkpoint(fresh_engine(run), run["second"])
    assert sorted(opened) == [MODEL, OPTIMIZER]
    # The names alone need no file at all.
    truncate(os.path.join(run["second"], MODEL), 10)
    assert "second.bias" in CheckpointSource(run["second"]).weight_names()


def test_export_does_not_need_the_optimizer_files(run, tmp_path):
    os.remove(os.path.join(run["first"], OPTIMIZER))
    assert export_main([run["first"], str(tmp_path / "exported")]) == 0


def test_manifest_lists_each_files_tensors(run):
    manifest = read_manifest(run["second"])
    for relative in (MODEL, OPTIMIZER):
        with safe_open(os.path.join(run["second"], relative), framework="pt") as handle:
            assert manifest["files"][relative]["merak"] == json.loads(handle.metadata()["merak"])
    assert sorted(manifest["files"][MODEL]["merak"]) == ["first.bias", "first.weight", "second.bias",
                                                         "second.weight"]
    assert "merak" not in manifest["files"]["trainer_state.json"]


def test_old_checkpoint_without_the_index_loads(run):
    drop_manifest_index(run["first"])
    engine = fresh_engine(run)
    assert load_checkpoint(engine, run["first"])["step"] == 1
    for name, tensor in weights(engine).items():
        assert torch.equal(tensor, run["after_one"][name]), name


# -- choosing the checkpoint to resume ----------------------------------------------


@pytest.mark.parametrize("spec", [True, "latest"], ids=repr)
def test_latest_falls_back_to_the_older_intact_checkpoint(run, spec, caplog):
    truncate(os.path.join(run["second"], MODEL), 100)
    with caplog.at_level("WARNING", logger="merak.checkpoint"):
        chosen = find_checkpoint(spec, str(run["dir"]))
    assert chosen == run["first"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert f"{run['second']}: {MODEL} is truncated (100 bytes" in warnings[0]
    assert f"using the older {run['first']} instead" in warnings[0]
    engine = fresh_engine(run)
    assert load_checkpoint(engine, chosen)["step"] == 1
    for name, tensor in weights(engine).items():
        assert torch.equal(tensor, run["after_one"][name]), name


def test_latest_takes_the_newest_when_intact(run, caplog):
    with caplog.at_level("WARNING", logger="merak.checkpoint"):
        assert find_checkpoint("latest", str(run["dir"])) == run["second"]
    assert not caplog.records


def test_named_damaged_checkpoint_raises(run):
    os.remove(os.path.join(run["second"], OPTIMIZER))
    with pytest.raises(CheckpointError, match=re.escape(f"{run['second']}: {OPTIMIZER} is missing")):
        find_checkpoint(run["second"], str(run["dir"]))
    assert find_checkpoint(run["first"], str(run["dir"])) == run["first"]


def test_verify_checkpoint_checks_every_file(run):
    assert verify_checkpoint(run["second"]) is None
    rng = os.path.join(run["second"], "rng", "rank00000.json")
    with open(rng, "r+b") as handle:
        handle.seek(20)
        handle.write(b"#")
    with pytest.raises(CheckpointError, match=re.escape(f"{run['second']}: rng/rank00000.json is damaged (CRC32")):
        verify_checkpoint(run["second"])


# -- never saving inf or NaN ----------------------------------------------------------


def no_new_checkpoint(run, step: int) -> None:
    assert sorted(os.listdir(run["dir"])) == ["checkpoint-1", "checkpoint-2"], f"step {step}"
    verify_checkpoint(run["first"])
    verify_checkpoint(run["second"])


def test_nonfinite_weight_is_not_saved(run):
    engine = fresh_engine(run)
    with torch.no_grad():
        dict(engine.named_parameters())["second.weight"][1, 2] = float("nan")
    with pytest.raises(CheckpointError, match=r"step 3: checkpoint-3 was not saved: inf or NaN in rank 0: "
                                              r"second\.weight(,|\.)"):
        save(engine, run["dir"], 3)
    no_new_checkpoint(run, 3)


def test_nonfinite_optimizer_state_is_not_saved(run):
    engine = make_engine(run["state"])
    train_step(engine, 1)
    optimizer = engine.optimizer
    master = optimizer.master[engine.trainable_names.index("first.bias")]
    optimizer.optimizer.state[master]["exp_avg"][0] = float("-inf")
    with pytest.raises(CheckpointError, match=r"step 5: .*rank 0: first\.bias/exp_avg\. Nothing was committed"):
        save(engine, run["dir"], 5)
    no_new_checkpoint(run, 5)


def test_a_problem_on_another_rank_stops_every_rank(run, monkeypatch):
    """Every rank learns of every rank's problem in the one exchange of the save, and raises."""
    def gather(value):
        return [value, {"records": [], "problem": "transformer.h.1.mlp.weight"}]

    monkeypatch.setattr(checkpoint_save.groups, "gather_from_all", gather)
    engine = make_engine(run["state"])
    train_step(engine, 1)
    with pytest.raises(CheckpointError, match=re.escape("step 4: checkpoint-4 was not saved: inf or NaN in rank 1: "
                                                        "transformer.h.1.mlp.weight. Nothing was committed")):
        save(engine, run["dir"], 4)
    no_new_checkpoint(run, 4)


def test_nonfinite_tensors_names_only_bad_floating_tensors():
    named = [("fine", torch.randn(5)), ("nan", torch.tensor([1.0, float("nan")])),
             ("half_inf", torch.tensor([float("inf"), 0.0], dtype=torch.float16)),
             ("bf16", torch.tensor([float("-inf")], dtype=torch.bfloat16)), ("empty", torch.empty(0)),
             ("ints", torch.arange(3)), ("scalar", torch.tensor(float("nan"))),
             ("strided", torch.ones(4, 3).t())]
    assert nonfinite_tensors(iter(named)) == ["nan", "half_inf", "bf16", "scalar"]
    assert nonfinite_tensors(iter([])) == []


def test_many_bad_tensors_are_counted(run):
    engine = make_engine(run["state"])
    with torch.no_grad():
        for _, tensor in engine.named_parameters():
            tensor.fill_(float("inf"))
    with pytest.raises(CheckpointError, match=r"rank 0: \S+, \S+, \S+ \(and \d+ more\)"):
        save(engine, run["dir"], 6)
    no_new_checkpoint(run, 6)


# -- merak-export ----------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_export_of_a_damaged_checkpoint(run, tmp_path, caplog, damage):
    checkpoint = run["second"]
    if damage == "truncated":
        truncate(os.path.join(checkpoint, MODEL), 50)
    else:
        os.remove(os.path.join(checkpoint, MODEL))
    out = tmp_path / "exported"
    with caplog.at_level("ERROR", logger="merak.checkpoint.export"):
        assert export_main([checkpoint, str(out)]) == 2
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert lines == [lines[0]] and "\n" not in lines[0]
    assert lines[0].startswith(f"merak-export: {checkpoint}: {MODEL} is {damage}")
    assert not (out / "model.safetensors").exists()


def test_export_of_an_intact_checkpoint(run, tmp_path):
    out = tmp_path / "exported"
    assert export_main([run["first"], str(out)]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        for name, tensor in run["after_one"].items():
            assert torch.equal(handle.get_tensor(name), tensor), name


def test_copy_of_a_damaged_checkpoint_is_checked_again(run, tmp_path):
    """Verification is remembered per file on disk, not per name: a copy is a new file."""
    verify_checkpoint(run["second"])
    copy = str(tmp_path / "copy")
    shutil.copytree(run["second"], copy)
    flip_header_bytes(os.path.join(copy, MODEL))
    with pytest.raises(CheckpointError, match=re.escape(f"{copy}: {MODEL} is damaged")):
        verify_checkpoint(copy)
