"""The workers' rendezvous store listens on the loopback interface only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from merak.distributed import groups
from merak.distributed.launch import spawn_workers

pytestmark = pytest.mark.dist

LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp*


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == LISTEN and int(hex_port, 16) == port:
                    found.append(address)
    return found


def _worker(out_dir: str) -> None:
    state = groups.init(dp=2, timeout_s=60)
    port = int(os.environ["MASTER_PORT"])
    Path(out_dir, f"rank{state.rank}.json").write_text(json.dumps(_listening_addresses(port)))
    groups.shutdown()


@pytest.mark.timeout(120)
def test_store_listens_on_loopback_only(tmp_path):
    spawn_workers(_worker, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        addresses = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert addresses == ["0100007F"], addresses  # 127.0.0.1, not 0.0.0.0 or ::
