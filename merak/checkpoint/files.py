"""The checkpoint directory: atomic commit, manifest with sizes and CRC32s, discovery and rotation."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "merak-checkpoint"
VERSION = 1
_NAME = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 16 * 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run."""


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


def file_record(root: str, path: str) -> dict:
    """Size and CRC32 of a written file, after flushing it."""
    fsync_path(path)
    return {"path": os.path.relpath(path, root), "bytes": os.path.getsize(path), "crc32": crc32_of(path)}


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
    """Committed checkpoints under ``root`` as (step, path), oldest first."""
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
    """The checkpoint ``resume_from_checkpoint`` names: a directory, or True/'latest' for the
    newest under ``output_dir`` (None if there is none yet).

    Raises:
        CheckpointError: a named directory that is not a complete checkpoint.
    """
    if spec in (None, False, ""):
        return None
    if spec is True or str(spec).lower() in ("true", "latest"):
        found = list_checkpoints(output_dir)
        return found[-1][1] if found else None
    path = os.path.abspath(str(spec))
    if not os.path.isdir(path):
        raise CheckpointError(f"resume_from_checkpoint={spec}: no such directory")
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        inside = list_checkpoints(path)
        if inside:  # a run directory was given: take its newest checkpoint
            return inside[-1][1]
        raise CheckpointError(f"{path} is not a complete merak checkpoint (no {MANIFEST}: the save was "
                              f"interrupted, or this is not a checkpoint directory)")
    return path


def read_manifest(path: str) -> dict:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete merak checkpoint (no {MANIFEST})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}/{MANIFEST} is corrupt: {error}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}/{MANIFEST} is not a merak checkpoint manifest")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not a merak checkpoint of version {VERSION} "
                              f"(format {manifest.get('format')!r}, version {manifest.get('version')!r})")
    return manifest


def verify_file(checkpoint: str, manifest: dict, relative: str) -> str:
    """The path of ``relative`` after checking its size and CRC32 against the manifest."""
    record = manifest["files"].get(relative)
    path = os.path.join(checkpoint, relative)
    if record is None:
        raise CheckpointError(f"{checkpoint}: {relative} is not listed in the manifest")
    if not os.path.isfile(path):
        raise CheckpointError(f"{checkpoint}: {relative} is missing")
    size = os.path.getsize(path)
    if size != record["bytes"] or crc32_of(path) != record["crc32"]:
        raise CheckpointError(f"{checkpoint}: {relative} is corrupt ({size} bytes, expected {record['bytes']}, "
                              f"or its CRC32 differs); resume from another checkpoint")
    return path


def rotate(root: str, keep: int | None, protect: str) -> None:
    """Delete the oldest committed checkpoints beyond ``keep`` (never ``protect``)."""
    if keep is None or keep < 1:
        return
    found = list_checkpoints(root)
    for _, path in found[:max(0, len(found) - keep)]:
        if os.path.abspath(path) != os.path.abspath(protect):
            logger.info("save_total_limit=%d: removing %s", keep, path)
            shutil.rmtree(path, ignore_errors=True)
