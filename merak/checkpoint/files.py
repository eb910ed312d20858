"""The checkpoint directory: atomic commit, manifest with sizes and CRC32s, verification, discovery, rotation."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import zlib
from collections.abc import Callable, Collection

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "merak-checkpoint"
VERSION = 1
_NAME = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 16 * 1024 * 1024

# Files whose CRC32 matched, keyed by their identity on disk: each is read in full once per process
# (the launcher's check before forking workers included), and re-read if it changes.
_verified: set[tuple] = set()


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit this run."""


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def staging_name(step: int) -> str:
    """Where a save is written before it is committed (ignored by discovery)."""
    return f".checkpoint-{step}.partial"


def crc32_of(path: str) -> int:
    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def fsync_path(path: str) -> None:
    """Flush a file or directory to disk (a rename is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_record(root: str, path: str, *, merak: dict | None = None) -> dict:
    """Size and CRC32 of a written file, after flushing it; with ``merak``, the file's merak metadata
    (which tensors a safetensors file holds), so that loading need not open every file's header."""
    fsync_path(path)
    record = {"path": os.path.relpath(path, root), "bytes": os.path.getsize(path), "crc32": crc32_of(path)}
    if merak is not None:
        record["merak"] = merak
    return record


def write_json(path: str, payload) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1)


def commit(staging: str, final: str, manifest: dict) -> None:
    """Write the manifest last, then rename the staging directory into place.

    Until the rename the previous checkpoints are untouched and the new one is
    invisible, so a crash at any point leaves every committed checkpoint loadable.
    """
    write_json(os.path.join(staging, MANIFEST), manifest)
    fsync_path(os.path.join(staging, MANIFEST))
    fsync_path(staging)
    if os.path.exists(final):  # saving a step again (a resumed run): replace the old copy
        retired = f"{final}.retired"
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        os.replace(staging, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Committed checkpoints under ``root`` as (step, path), oldest first (not checked for damage)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _NAME.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_checkpoint(spec, output_dir: str) -> str | None:
    """The intact checkpoint ``resume_from_checkpoint`` names.

    - None, False or "": None.
    - True, "true" or "latest": the newest intact checkpoint under ``output_dir`` (None if there
      is no checkpoint at all). Damaged ones are skipped with a warning naming the damaged file.
    - A run directory (no manifest, checkpoints inside): the same, under that directory.
    - A checkpoint directory: that one, after checking every file (no fallback: it was named).

    Intact means :func:`verify_checkpoint` passes: every listed file is read once.

    Raises:
        CheckpointError: a named directory that does not exist or is not a complete, intact
            checkpoint; or checkpoints exist but every one is damaged.
    """
    if spec in (None, False, ""):
        return None
    if spec is True or str(spec).lower() in ("true", "latest"):
        return newest_intact_checkpoint(output_dir)
    path = os.path.abspath(str(spec))
    if not os.path.isdir(path):
        raise CheckpointError(f"resume_from_checkpoint={spec}: no such directory")
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        if list_checkpoints(path):  # a run directory was given: take its newest intact checkpoint
            return newest_intact_checkpoint(path)
        raise CheckpointError(f"{path} is not a complete merak checkpoint (no {MANIFEST}: the save was "
                              f"interrupted, or this is not a checkpoint directory)")
    verify_checkpoint(path)
    return path


def newest_intact_checkpoint(root: str) -> str | None:
    """The newest checkpoint under ``root`` that :func:`verify_checkpoint` accepts; None if there
    are no checkpoints. Each damaged one passed over is logged with what is wrong.

    Raises:
        CheckpointError: there are checkpoints, but every one is damaged.
    """
    found = list_checkpoints(root)
    damaged: list[CheckpointError] = []  # each message names its checkpoint and file
    for _, path in reversed(found):
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            damaged.append(error)
            continue
        for error in damaged:
            logger.warning("skipping a damaged checkpoint: %s; using the older %s instead", error, path)
        return path
    if damaged:
        raise CheckpointError(f"every checkpoint in {root} is damaged (the newest: {damaged[0]}); move them "
                              f"away to start from the beginning, or restore one from a copy")
    return None


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint ``path``, checked for format, version and a valid file listing."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete merak checkpoint (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}/{MANIFEST} is corrupt: {error}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}/{MANIFEST} is not a merak checkpoint manifest")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not a merak checkpoint of version {VERSION} "
                              f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})")
    _check_listing(path, manifest.get("files"))
    return manifest


def _check_listing(path: str, listing) -> None:
    """Reject a listing that later code could not use (or that points outside the checkpoint)."""
    if not isinstance(listing, dict):
        raise CheckpointError(f"{path}/{MANIFEST} is corrupt: it has no file listing")
    for relative, record in listing.items():
        parts = relative.replace("\\", "/").split("/")
        if os.path.isabs(relative) or ".." in parts:
            raise CheckpointError(f"{path}/{MANIFEST} is corrupt: it lists {relative!r}, outside the checkpoint")
        valid = isinstance(record, dict) and all(
            isinstance(record.get(key), int) and not isinstance(record.get(key), bool) for key in ("bytes", "crc32"))
        if not valid or not isinstance(record.get("merak", {}), dict):
            raise CheckpointError(f"{path}/{MANIFEST} is corrupt: the record of {relative} is not valid")


def _record(checkpoint: str, manifest: dict, relative: str) -> dict:
    record = manifest["files"].get(relative)
    if record is None:
        raise CheckpointError(f"{checkpoint}: {relative} is not listed in the manifest")
    return record


def _identity(path: str, status: os.stat_result, crc: int) -> tuple:
    return (os.path.realpath(path), status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns,
            status.st_ctime_ns, crc)


def _checked_size(checkpoint: str, manifest: dict, relative: str) -> os.stat_result:
    """The file's status after checking that it exists with the size the manifest lists."""
    expected = _record(checkpoint, manifest, relative)["bytes"]
    try:
        status = os.stat(os.path.join(checkpoint, relative))
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint}: {relative} is missing") from None
    if not stat.S_ISREG(status.st_mode):
        raise CheckpointError(f"{checkpoint}: {relative} is not a file")
    if status.st_size < expected:
        raise CheckpointError(f"{checkpoint}: {relative} is truncated ({status.st_size} bytes, the manifest "
                              f"says {expected})")
    if status.st_size > expected:
        raise CheckpointError(f"{checkpoint}: {relative} is damaged ({status.st_size} bytes, the manifest "
                              f"says {expected})")
    return status


def verify_file(checkpoint: str, manifest: dict, relative: str) -> str:
    """The path of ``relative`` after checking its size, then its CRC32, against the manifest.

    The CRC32 is computed once per process for an unchanged file.

    Raises:
        CheckpointError: naming the checkpoint, the file and what is wrong (not listed, missing,
            truncated, another size or CRC32).
    """
    path = os.path.join(checkpoint, relative)
    status = _checked_size(checkpoint, manifest, relative)
    expected = manifest["files"][relative]["crc32"]
    key = _identity(path, status, expected)
    if key in _verified:
        return path
    actual = crc32_of(path)
    if actual != expected:
        raise CheckpointError(f"{checkpoint}: {relative} is damaged (CRC32 {actual:#010x}, the manifest says "
                              f"{expected:#010x})")
    _verified.add(key)
    return path


def verify_checkpoint(path: str) -> None:
    """Check checkpoint ``path`` in full: its manifest, then the size of every listed file, then
    every file's CRC32 (sizes first, so a truncated or missing file is found without reading the rest).

    Raises:
        CheckpointError: naming the checkpoint, the file and what is wrong.
    """
    manifest = read_manifest(path)
    if "trainer_state.json" not in manifest["files"]:
        raise CheckpointError(f"{path}/{MANIFEST} is corrupt: it does not list trainer_state.json")
    for relative in sorted(manifest["files"]):
        _checked_size(path, manifest, relative)
    for relative in sorted(manifest["files"]):
        verify_file(path, manifest, relative)


def read_json(checkpoint: str, manifest: dict, relative: str):
    """The content of JSON file ``relative`` of a checkpoint, verified first.

    Raises:
        CheckpointError: the file is missing or damaged, or is not valid JSON.
    """
    path = verify_file(checkpoint, manifest, relative)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{checkpoint}: {relative} cannot be read ({error})") from None


def rotate(root: str, keep: int | None, protect: str | Collection[str],
           same_model: Callable[[dict], bool] = lambda manifest: True) -> None:
    """Delete the oldest committed checkpoints beyond the newest ``keep``, except those in ``protect``
    (the one just written, the best model's). Only checkpoints whose manifest ``same_model`` accepts
    are counted or removed: another model's checkpoints, and those whose manifest cannot be read,
    are never deleted."""
    if keep is None or keep < 1:
        return
    kept = {os.path.abspath(p) for p in ([protect] if isinstance(protect, str) else protect)}

    def ours(path: str) -> bool:
        try:
            return same_model(read_manifest(path))
        except CheckpointError:
            return False

    found = [(step, path) for step, path in list_checkpoints(root) if ours(path)]
    for _, path in found[:max(0, len(found) - keep)]:
        if os.path.abspath(path) not in kept:
            logger.info("save_total_limit=%d: removing %s", keep, path)
            shutil.rmtree(path, ignore_errors=True)
