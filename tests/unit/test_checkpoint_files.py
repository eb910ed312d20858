"""Pure unit tests of the checkpoint directory, tensor-parallel slice joining and RNG capture.

Covers merak.checkpoint.files (commit, discovery of intact checkpoints, rotation,
manifest and file verification), merak.checkpoint.tensors (join_slices, slice JSON) and
merak.checkpoint.rng. Only temporary directories and CPU tensors.
"""

from __future__ import annotations

import json
import os
import random
import re
import zlib

import numpy as np
import pytest
import torch

from merak.checkpoint import files as checkpoint_files
from merak.checkpoint.files import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    checkpoint_name,
    commit,
    crc32_of,
    file_record,
    find_checkpoint,
    list_checkpoints,
    newest_intact_checkpoint,
    read_json,
    read_manifest,
    rotate,
    staging_name,
    verify_checkpoint,
    verify_file,
)
from merak.checkpoint.rng import capture_rng, restore_rng
from merak.checkpoint.tensors import join_slices, slice_from_json, slice_to_json
from merak.core.slices import TensorSlice

# -- helpers ---------------------------------------------------------------------


def write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
    return str(path)


def manifest_for(root: str, paths, step: int = 1) -> dict:
    """A manifest as merak.checkpoint.save writes it, listing ``paths`` (under ``root``)."""
    listing = {}
    for path in paths:
        record = file_record(root, path)
        listing[record["path"]] = {"bytes": record["bytes"], "crc32": record["crc32"]}
    return {"format": FORMAT, "version": VERSION, "step": step, "files": listing}


def save(root, step: int, payload: bytes = b"weights") -> str:
    """Commit a small checkpoint ``root/checkpoint-<step>`` the way a save does."""
    staging = os.path.join(root, staging_name(step))
    data = write(os.path.join(staging, "model", "part.bin"), payload)
    state = write(os.path.join(staging, "trainer_state.json"), json.dumps({"step": step}).encode())
    final = os.path.join(root, checkpoint_name(step))
    commit(staging, final, manifest_for(staging, [data, state], step))
    return final


def damage(path, offset: int = 0) -> None:
    """Flip the bits of one byte in place (the size stays)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0xFF]))


def steps_in(root) -> list[int]:
    return [step for step, _ in list_checkpoints(str(root))]


# -- commit ----------------------------------------------------------------------


def test_commit_moves_staging_into_place(tmp_path):
    final = save(tmp_path, 3, b"abc")
    assert final == str(tmp_path / "checkpoint-3")
    assert not (tmp_path / ".checkpoint-3.partial").exists()
    manifest = json.loads((tmp_path / "checkpoint-3" / MANIFEST).read_text())
    assert manifest["step"] == 3
    assert manifest["files"]["model/part.bin"] == {"bytes": 3, "crc32": zlib.crc32(b"abc")}
    assert (tmp_path / "checkpoint-3" / "model" / "part.bin").read_bytes() == b"abc"
    assert read_manifest(final) == manifest


def test_commit_replaces_an_existing_checkpoint(tmp_path):
    save(tmp_path, 5, b"old")
    write(str(tmp_path / "checkpoint-5" / "stale.bin"), b"left over")
    save(tmp_path, 5, b"newer")
    final = tmp_path / "checkpoint-5"
    assert (final / "model" / "part.bin").read_bytes() == b"newer"
    assert not (final / "stale.bin").exists()
    assert read_manifest(str(final))["files"]["model/part.bin"]["bytes"] == 5
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-5"]  # no staging, no retired copy


# -- discovery -------------------------------------------------------------------


def test_list_checkpoints_only_committed_sorted_by_step(tmp_path):
    for step in (10, 2, 33):
        save(tmp_path, step)
    os.makedirs(tmp_path / ".checkpoint-7.partial")
    write(str(tmp_path / ".checkpoint-7.partial" / MANIFEST), b"{}")
    os.makedirs(tmp_path / "checkpoint-9")  # interrupted: no manifest
    os.makedirs(tmp_path / "checkpoint-x")
    write(str(tmp_path / "checkpoint-x" / MANIFEST), b"{}")
    write(str(tmp_path / "checkpoint-4"), b"a file, not a directory")
    write(str(tmp_path / "notes" / MANIFEST), b"{}")
    assert list_checkpoints(str(tmp_path)) == [(2, str(tmp_path / "checkpoint-2")),
                                               (10, str(tmp_path / "checkpoint-10")),
                                               (33, str(tmp_path / "checkpoint-33"))]


def test_list_checkpoints_of_missing_root(tmp_path):
    assert list_checkpoints(str(tmp_path / "absent")) == []
    assert list_checkpoints(str(tmp_path)) == []


@pytest.mark.parametrize("spec", [None, False, ""], ids=repr)
def test_find_checkpoint_not_requested(tmp_path, spec):
    save(tmp_path, 1)
    assert find_checkpoint(spec, str(tmp_path)) is None


@pytest.mark.parametrize("spec", [True, "latest", "LATEST", "true", "True"], ids=repr)
def test_find_checkpoint_latest(tmp_path, spec):
    assert find_checkpoint(spec, str(tmp_path)) is None  # nothing saved yet: start fresh
    save(tmp_path, 2)
    save(tmp_path, 11)
    os.makedirs(tmp_path / "checkpoint-12")  # incomplete, ignored
    assert find_checkpoint(spec, str(tmp_path)) == str(tmp_path / "checkpoint-11")


def test_find_checkpoint_named_directory(tmp_path):
    run = tmp_path / "run"
    first = save(run, 4)
    save(run, 8)
    other = tmp_path / "elsewhere"
    assert find_checkpoint(first, str(other)) == first
    assert find_checkpoint(str(run), str(other)) == str(run / "checkpoint-8")  # a run directory: its newest


def test_find_checkpoint_relative_path_is_made_absolute(tmp_path, monkeypatch):
    save(tmp_path, 6)
    monkeypatch.chdir(tmp_path)
    assert find_checkpoint("checkpoint-6", "unused") == str(tmp_path / "checkpoint-6")


def test_find_checkpoint_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=re.escape(f"resume_from_checkpoint={missing}: no such directory")):
        find_checkpoint(missing, str(tmp_path))


def test_find_checkpoint_incomplete_directory(tmp_path):
    os.makedirs(tmp_path / "checkpoint-9")
    write(str(tmp_path / "checkpoint-9" / "model" / "part.bin"), b"half")
    for path in (tmp_path / "checkpoint-9", tmp_path):
        with pytest.raises(CheckpointError, match=re.escape(f"{path} is not a complete merak checkpoint")):
            find_checkpoint(str(path), str(tmp_path))


# -- rotation --------------------------------------------------------------------


def test_rotate_keeps_the_newest(tmp_path):
    paths = {step: save(tmp_path, step) for step in (1, 2, 3, 4, 5)}
    os.makedirs(tmp_path / ".checkpoint-6.partial")
    rotate(str(tmp_path), 2, protect=paths[5])
    assert steps_in(tmp_path) == [4, 5]
    assert not os.path.exists(paths[1])
    assert (tmp_path / ".checkpoint-6.partial").is_dir()  # not a committed checkpoint: untouched


def test_rotate_never_deletes_the_protected_checkpoint(tmp_path):
    paths = {step: save(tmp_path, step) for step in (1, 2, 3, 4, 5)}
    rotate(str(tmp_path), 2, protect=paths[1])  # e.g. step 1 saved again by a resumed run
    assert steps_in(tmp_path) == [1, 4, 5]
    rotate(str(tmp_path), 1, protect=os.path.join(str(tmp_path), ".", "checkpoint-4"))
    assert steps_in(tmp_path) == [4, 5]


@pytest.mark.parametrize("keep", [None, -1])
def test_rotate_keep_all(tmp_path, keep):
    paths = [save(tmp_path, step) for step in (1, 2, 3)]
    rotate(str(tmp_path), keep, protect=paths[-1])
    assert steps_in(tmp_path) == [1, 2, 3]


def test_rotate_keep_more_than_present(tmp_path):
    paths = [save(tmp_path, step) for step in (1, 2)]
    rotate(str(tmp_path), 5, protect=paths[-1])
    assert steps_in(tmp_path) == [1, 2]


# -- manifest --------------------------------------------------------------------


def test_read_manifest_missing(tmp_path):
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path} is not a complete merak checkpoint "
                                                        f"(no manifest.json)")):
        read_manifest(str(tmp_path))


def test_read_manifest_invalid_json(tmp_path):
    write(str(tmp_path / MANIFEST), b'{"format": "merak-checkpoint", ')
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}/manifest.json is corrupt: ")):
        read_manifest(str(tmp_path))


@pytest.mark.parametrize("payload,details", [
    ({"format": "other", "version": 1}, "(format 'other', version 1)"),
    ({"format": "merak-checkpoint", "version": 2}, "(format 'merak-checkpoint', version 2)"),
    ({"files": {}}, "(format None, version None)"),
])
def test_read_manifest_wrong_format_or_version(tmp_path, payload, details):
    write(str(tmp_path / MANIFEST), json.dumps(payload).encode())
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path} is not a merak checkpoint of version 1 "
                                                        f"{details}")):
        read_manifest(str(tmp_path))


# -- verify_file -----------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint directory with two files and their manifest."""
    data = write(str(tmp_path / "model" / "rank-0.safetensors"), bytes(range(200)))
    state = write(str(tmp_path / "trainer_state.json"), b'{"step": 1}')
    manifest = manifest_for(str(tmp_path), [data, state])
    return str(tmp_path), manifest, data


def test_file_record_values(tmp_path):
    path = write(str(tmp_path / "sub" / "f.bin"), b"hello")
    assert file_record(str(tmp_path), path) == {"path": "sub/f.bin", "bytes": 5, "crc32": 0x3610A686}


def test_verify_intact_file(checkpoint):
    root, manifest, data = checkpoint
    assert sorted(manifest["files"]) == ["model/rank-0.safetensors", "trainer_state.json"]
    assert verify_file(root, manifest, "model/rank-0.safetensors") == data
    assert verify_file(root, manifest, "trainer_state.json") == os.path.join(root, "trainer_state.json")


def test_verify_unlisted_file(checkpoint):
    root, manifest, _ = checkpoint
    write(os.path.join(root, "model", "rank-1.safetensors"), b"x")
    with pytest.raises(CheckpointError, match=re.escape(f"{root}: model/rank-1.safetensors is not listed")):
        verify_file(root, manifest, "model/rank-1.safetensors")


def test_verify_missing_file(checkpoint):
    root, manifest, data = checkpoint
    os.remove(data)
    with pytest.raises(CheckpointError, match=re.escape(f"{root}: model/rank-0.safetensors is missing")):
        verify_file(root, manifest, "model/rank-0.safetensors")


def test_verify_truncated_file(checkpoint):
    root, manifest, data = checkpoint
    os.truncate(data, 120)
    with pytest.raises(CheckpointError, match=re.escape(f"{root}: model/rank-0.safetensors is truncated (120 bytes, "
                                                        f"the manifest says 200)")):
        verify_file(root, manifest, "model/rank-0.safetensors")


def test_verify_longer_file(checkpoint):
    root, manifest, data = checkpoint
    with open(data, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(CheckpointError, match=re.escape(f"{root}: model/rank-0.safetensors is damaged (201 bytes, "
                                                        f"the manifest says 200)")):
        verify_file(root, manifest, "model/rank-0.safetensors")


def test_verify_same_size_byte_flip(checkpoint):
    root, manifest, data = checkpoint
    before = crc32_of(data)
    damage(data, 100)
    after = crc32_of(data)
    assert os.path.getsize(data) == 200 and after != before
    with pytest.raises(CheckpointError, match=re.escape(f"{root}: model/rank-0.safetensors is damaged (CRC32 "
                                                        f"{after:#010x}, the manifest says {before:#010x})")):
        verify_file(root, manifest, "model/rank-0.safetensors")
    # The other file is still fine.
    assert verify_file(root, manifest, "trainer_state.json").endswith("trainer_state.json")


def test_verify_a_directory_in_place_of_a_file(checkpoint):
    root, manifest, data = checkpoint
    os.remove(data)
    os.makedirs(data)
    with pytest.raises(CheckpointError, match=re.escape(f"{root}: model/rank-0.safetensors is not a file")):
        verify_file(root, manifest, "model/rank-0.safetensors")


def test_verify_reads_an_unchanged_file_once(checkpoint, monkeypatch):
    root, manifest, data = checkpoint
    reads = []
    monkeypatch.setattr(checkpoint_files, "crc32_of", lambda path: reads.append(path) or crc32_of(path))
    for _ in range(3):
        verify_file(root, manifest, "model/rank-0.safetensors")
    assert reads == [data]
    # Replaced since (a new file, so a new inode, in its place): read and checked again.
    os.replace(write(data + ".new", bytes(range(200))[::-1]), data)
    with pytest.raises(CheckpointError, match="is damaged"):
        verify_file(root, manifest, "model/rank-0.safetensors")
    assert reads == [data, data]


def test_verify_checks_sizes_before_reading_any_file(checkpoint, monkeypatch):
    root, manifest, data = checkpoint
    write(os.path.join(root, MANIFEST), json.dumps({**manifest, "format": FORMAT, "version": VERSION}).encode())
    os.truncate(os.path.join(root, "trainer_state.json"), 3)  # the second file in name order
    reads = []
    monkeypatch.setattr(checkpoint_files, "crc32_of", lambda path: reads.append(path) or crc32_of(path))
    with pytest.raises(CheckpointError, match=re.escape(f"{root}: trainer_state.json is truncated (3 bytes, the "
                                                        f"manifest says 11)")):
        verify_checkpoint(root)
    assert reads == []


def test_read_json_verifies_then_parses(checkpoint):
    root, manifest, _ = checkpoint
    assert read_json(root, manifest, "trainer_state.json") == {"step": 1}
    state = write(os.path.join(root, "trainer_state.json"), b'{"step": ')
    manifest = manifest_for(root, [state])  # listed as it is: the bytes match, the JSON is broken
    with pytest.raises(CheckpointError, match=re.escape(f"{root}: trainer_state.json cannot be read (")):
        read_json(root, manifest, "trainer_state.json")


# -- verify_checkpoint and the newest intact checkpoint ----------------------------


def test_verify_checkpoint_intact_and_damaged(tmp_path):
    path = save(tmp_path, 3)
    assert verify_checkpoint(path) is None
    damage(os.path.join(path, "model", "part.bin"))
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: model/part.bin is damaged (CRC32 ")):
        verify_checkpoint(path)


def test_verify_checkpoint_missing_file(tmp_path):
    path = save(tmp_path, 3)
    os.remove(os.path.join(path, "trainer_state.json"))
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: trainer_state.json is missing")):
        verify_checkpoint(path)


def test_verify_checkpoint_without_trainer_state(tmp_path):
    staging = tmp_path / staging_name(1)
    data = write(str(staging / "model" / "part.bin"), b"x")
    commit(str(staging), str(tmp_path / "checkpoint-1"), manifest_for(str(staging), [data]))
    with pytest.raises(CheckpointError, match="does not list trainer_state.json"):
        verify_checkpoint(str(tmp_path / "checkpoint-1"))


def test_newest_intact_skips_damaged_with_a_warning(tmp_path, caplog):
    for step in (2, 4, 6):
        save(tmp_path, step)
    os.truncate(tmp_path / "checkpoint-6" / "model" / "part.bin", 2)
    damage(str(tmp_path / "checkpoint-4" / "trainer_state.json"))
    with caplog.at_level("WARNING", logger="merak.checkpoint.files"):
        assert newest_intact_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert f"{tmp_path / 'checkpoint-6'}: model/part.bin is truncated (2 bytes, the manifest says 7)" in messages[0]
    assert f"{tmp_path / 'checkpoint-4'}: trainer_state.json is damaged (CRC32" in messages[1]
    assert all(m.endswith(f"using the older {tmp_path / 'checkpoint-2'} instead") for m in messages)


def test_newest_intact_all_damaged(tmp_path):
    assert newest_intact_checkpoint(str(tmp_path)) is None
    for step in (1, 2):
        save(tmp_path, step)
        os.remove(tmp_path / f"checkpoint-{step}" / "model" / "part.bin")
    with pytest.raises(CheckpointError, match=re.escape(f"every checkpoint in {tmp_path} is damaged (the newest: "
                                                        f"{tmp_path / 'checkpoint-2'}: model/part.bin is missing)")):
        newest_intact_checkpoint(str(tmp_path))


@pytest.mark.parametrize("spec", [True, "latest"], ids=repr)
def test_find_checkpoint_latest_skips_damaged(tmp_path, spec, caplog):
    save(tmp_path, 1)
    save(tmp_path, 2)
    damage(str(tmp_path / "checkpoint-2" / "model" / "part.bin"), 3)
    with caplog.at_level("WARNING", logger="merak.checkpoint.files"):
        assert find_checkpoint(spec, str(tmp_path)) == str(tmp_path / "checkpoint-1")
    assert "checkpoint-2: model/part.bin is damaged" in caplog.text


def test_find_checkpoint_run_directory_skips_damaged(tmp_path):
    run = tmp_path / "run"
    save(run, 1)
    save(run, 2)
    os.truncate(run / "checkpoint-2" / "model" / "part.bin", 0)
    assert find_checkpoint(str(run), str(tmp_path / "elsewhere")) == str(run / "checkpoint-1")


def test_find_checkpoint_named_damaged_raises(tmp_path):
    save(tmp_path, 1)
    named = save(tmp_path, 2)
    damage(os.path.join(named, "model", "part.bin"))
    with pytest.raises(CheckpointError, match=re.escape(f"{named}: model/part.bin is damaged (CRC32")):
        find_checkpoint(named, str(tmp_path))


# -- tensor-parallel slices ------------------------------------------------------


def test_take_and_join_concrete_fused_blocks():
    full = torch.arange(12).reshape(12, 1)
    specs = [TensorSlice(0, rank, 2, 3, (12, 1)) for rank in range(2)]
    pieces = {spec.rank: spec.take(full) for spec in specs}
    assert pieces[0].flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert pieces[1].flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert torch.equal(join_slices(pieces, specs[0]), full)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("parts", [1, 3])
def test_join_slices_inverts_take(dim, size, parts):
    shape = (24, 5) if dim == 0 else (5, 24)
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(size * 10 + parts))
    specs = [TensorSlice(dim, rank, size, parts, shape) for rank in range(size)]
    pieces = {spec.rank: spec.take(full) for spec in specs}
    for spec, piece in zip(specs, pieces.values(), strict=True):
        assert tuple(piece.shape) == spec.local_shape(shape)
    if parts > 1:  # fused blocks: a rank's piece is not a plain contiguous chunk
        assert not torch.equal(pieces[0], full.chunk(size, dim=dim)[0])
    # Any rank's spec describes the layout; the join does not depend on which.
    for spec in (specs[0], specs[-1]):
        assert torch.equal(join_slices(pieces, spec), full)


def test_join_slices_missing_rank():
    shape = (8, 3)
    specs = [TensorSlice(0, rank, 4, 1, shape) for rank in range(4)]
    full = torch.randn(*shape)
    pieces = {rank: specs[rank].take(full) for rank in (0, 2)}
    with pytest.raises(KeyError, match=re.escape("tensor-parallel pieces [1, 3] of 4 are missing")):
        join_slices(pieces, specs[0])


def test_slice_json_round_trip():
    spec = TensorSlice(1, 2, 4, 3, (5, 24))
    assert slice_to_json(spec) == [1, 2, 4, 3]
    value = json.loads(json.dumps(slice_to_json(spec)))
    assert slice_from_json(value, [5, 24]) == spec
    assert slice_from_json(value, (5, 24)).full_shape == (5, 24)
    assert slice_to_json(None) is None
    assert slice_from_json(None, (5, 24)) is None


# -- RNG states ------------------------------------------------------------------


@pytest.fixture
def keep_global_rng():
    """Leave the process's generators as they were."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def draw() -> list:
    return [random.random(), random.gauss(0.0, 1.0), random.randint(0, 10**9),
            np.random.rand(3).tolist(), np.random.standard_normal(3).tolist(),
            torch.rand(4).tolist(), torch.randn(3).tolist()]


def test_restore_rng_repeats_draws(keep_global_rng):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0.0, 1.0)  # leaves a cached second normal in both generators
    np.random.standard_normal(1)
    saved = capture_rng()
    assert saved["python"][2] is not None
    assert saved["numpy"][3] == 1
    first = draw()
    assert draw() != first  # the generators moved on
    restore_rng(saved)
    assert draw() == first


def test_captured_rng_survives_json(keep_global_rng):
    random.seed(4)
    np.random.seed(5)
    torch.manual_seed(6)
    text = json.dumps(capture_rng())
    first = draw()
    after = json.dumps(capture_rng())
    assert after != text
    restore_rng(json.loads(text))
    assert draw() == first
    assert json.dumps(capture_rng()) == after  # the same state after the same draws
    assert set(json.loads(text)) >= {"python", "numpy", "torch"}


@pytest.mark.parametrize("listing,details", [
    (None, "it has no file listing"),
    ({"a.bin": {"bytes": 1}}, "the record of a.bin is not valid"),
    ({"a.bin": {"bytes": "1", "crc32": 0}}, "the record of a.bin is not valid"),
    ({"a.bin": {"bytes": 1, "crc32": 0, "merak": "{}"}}, "the record of a.bin is not valid"),
    ({"../outside.bin": {"bytes": 1, "crc32": 0}}, "it lists '../outside.bin', outside the checkpoint"),
    ({"/etc/hostname": {"bytes": 1, "crc32": 0}}, "it lists '/etc/hostname', outside the checkpoint"),
])
def test_read_manifest_invalid_listing(tmp_path, listing, details):
    write(str(tmp_path / MANIFEST), json.dumps({"format": FORMAT, "version": VERSION, "files": listing}).encode())
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}/manifest.json is corrupt: {details}")):
        read_manifest(str(tmp_path))


def test_manifest_that_is_not_an_object_is_rejected(tmp_path):
    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(CheckpointError, match="not a merak checkpoint manifest"):
        read_manifest(str(tmp_path))
