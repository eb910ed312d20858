"""PointToPoint between two gloo processes: pytrees, renegotiation, requires_grad, failures, and the
transports' send semantics (gloo's buffered sends; the rendezvous transport's NCCL-like ones)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from merak.distributed.launch import WorkerFailed, spawn_workers
from merak.distributed.p2p import PointToPoint

pytestmark = pytest.mark.dist


def make_payloads() -> list:
    """The sequence rank 0 sends; the same function builds the expected values in the test."""
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(3, 4, generator=g)
    mixed = (torch.arange(6, dtype=torch.float64).reshape(2, 3), 7, None, "text")

    def nested(rows: int, offset: int) -> dict:
        return {
            "hidden": [torch.randn(rows, 5, generator=g), 3, [1.5, "inner"]],
            "mask": torch.arange(rows * 2).reshape(rows, 2) % 3 == offset % 3,
            "ids": torch.arange(rows, dtype=torch.int64) + 2**40 + offset,
        }

    first = nested(2, 0)
    reshaped = nested(4, 1)   # same structure, new shapes: a new description
    same = nested(4, 2)       # same shapes again: no new description, but new values
    # non-contiguous float with requires_grad, and integer tensors (never requires_grad)
    grad = (torch.randn(4, 3, generator=g).t().requires_grad_(True), torch.tensor([5, -6], dtype=torch.int32),
            torch.ones(2))
    # odd tensors; then only a non-tensor value changes, which also needs a new description
    odd = [torch.empty(0, 3), torch.tensor(3.5), torch.full((2,), 1.5, dtype=torch.bfloat16), 1]
    odd_value_changed = [torch.empty(0, 3), torch.tensor(4.5), torch.full((2,), 2.5, dtype=torch.bfloat16), 2]
    return [plain, mixed, first, reshaped, same, grad, odd, odd_value_changed]


# works per post_send. Side channel (rendezvous, as on NCCL): header (+ description when it changed) + one per
# tensor. Packed (gloo on the CPU): one message; three when the description changed (the expected size
# filled with the header, the description, the new payload).
EXPECTED_WORKS = {"rendezvous": [3, 3, 5, 5, 4, 5, 5, 5], "posted": [3, 3, 3, 3, 1, 3, 3, 3]}
EXPECTED_NEW_DESCRIPTION = [True, True, True, True, False, True, True, True]


def exchange_worker(out_path: str, transport: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        rank = dist.get_rank()
        p2p = PointToPoint(torch.device("cpu"), transport=transport)
        payloads = make_payloads()
        if rank == 0:
            works = []
            for payload in payloads:
                pending = p2p.post_send(payload, 1)
                works.append(len(pending))
                for work in pending:
                    work.wait()
            torch.save({"works": works}, out_path + ".sender")
        else:
            received, new_layout, grads = [], [], []
            previous = None
            for _ in payloads:
                got = p2p.recv(0)
                layout = p2p._recv_channels[(0, 0)].layout  # (peer, tag)
                new_layout.append(layout is not previous)
                previous = layout
                received.append(got)
                grads.append([t.requires_grad for t in torch.utils._pytree.tree_leaves(got)
                              if isinstance(t, torch.Tensor)])
            torch.save({"received": received, "new_layout": new_layout, "requires_grad": grads}, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def assert_same_tree(got, expected, where="payload"):
    assert type(got) is type(expected), where
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype, where
        assert got.shape == expected.shape, where
        assert torch.equal(got.detach(), expected.detach()), where
    elif isinstance(expected, dict):
        assert list(got) == list(expected), where
        for key in expected:
            assert_same_tree(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_tree(a, b, f"{where}[{i}]")
    else:
        assert got == expected, where


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["posted", "rendezvous"])
def test_pytree_exchange(tmp_path, transport):
    out = str(tmp_path / "received.pt")
    spawn_workers(exchange_worker, world_size=2, args=(out, transport), start_method="fork")
    result = torch.load(out, weights_only=False)
    sender = torch.load(out + ".sender", weights_only=False)
    expected = make_payloads()

    assert len(result["received"]) == len(expected)
    for i, (got, want) in enumerate(zip(result["received"], expected)):
        assert_same_tree(got, want, f"payload {i}")

    # spot checks with literal values
    plain, mixed, first, reshaped, same, grad, odd, odd_value_changed = result["received"]
    assert plain.shape == (3, 4) and plain.dtype == torch.float32
    assert mixed[1:] == (7, None, "text")
    assert mixed[0].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert first["mask"].dtype == torch.bool
    assert first["mask"].tolist() == [[True, False], [False, True]]
    assert first["ids"].dtype == torch.int64
    assert first["ids"].tolist() == [2**40, 2**40 + 1]
    assert first["hidden"][1:] == [3, [1.5, "inner"]]
    assert reshaped["hidden"][0].shape == (4, 5)
    assert reshaped["ids"].tolist() == [2**40 + 1 + i for i in range(4)]
    assert same["ids"].tolist() == [2**40 + 2 + i for i in range(4)]  # fresh values, not stale ones
    assert not torch.equal(same["hidden"][0], reshaped["hidden"][0])
    assert grad[1].tolist() == [5, -6]
    assert odd[0].shape == (0, 3)
    assert odd[1].shape == () and odd[1].item() == 3.5
    assert odd[2].dtype == torch.bfloat16 and odd[2].tolist() == [1.5, 1.5]
    assert odd[3] == 1 and odd_value_changed[3] == 2
    assert odd_value_changed[1].item() == 4.5

    # renegotiation: a description travels only when structure/dtype/shape/value changed
    assert sender["works"] == EXPECTED_WORKS[transport]
    assert result["new_layout"] == EXPECTED_NEW_DESCRIPTION

    # requires_grad survives for the float leaf only
    assert result["requires_grad"][5] == [True, False, False]
    assert grad[0].requires_grad and grad[0].is_leaf
    assert not grad[1].requires_grad
    for i, flags in enumerate(result["requires_grad"]):
        if i != 5:
            assert not any(flags), i


def batched_group_worker(out_path: str, transport: str) -> None:
    """Both ranks send and receive in the same post calls (one batched group, as a 1F1B point), on two
    channels at once, with shapes changing between calls; then rank 0 sends once more alone, and rank 1
    receives it alone."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        rank, peer = dist.get_rank(), 1 - dist.get_rank()
        p2p = PointToPoint(torch.device("cpu"), transport=transport)
        payloads = make_payloads()
        mine = payloads if rank == 0 else list(reversed(payloads))
        received = []
        for index, payload in enumerate(mine):
            extra = {"index": index, "rank": rank}
            transfer = p2p.post([(payload, peer, 0), (extra, peer, 1)], [(peer, 0), (peer, 1)])
            transfer.wait()
            for work in transfer.send_works:
                work.wait()
            received.append(transfer.received)
        if rank == 0:
            for work in p2p.post_send(payloads[2], peer, 0):
                work.wait()
        else:
            received.append([p2p.recv(peer, 0)])
        torch.save(received, f"{out_path}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["posted", "rendezvous"])
def test_a_batched_group_both_ways_matches_lone_sends_and_receives(tmp_path, transport):
    out = str(tmp_path / "exchanged")
    spawn_workers(batched_group_worker, world_size=2, args=(out, transport), start_method="fork")
    expected = make_payloads()
    for rank in (0, 1):
        received = torch.load(f"{out}.{rank}", weights_only=False)
        theirs = list(reversed(expected)) if rank == 0 else expected
        for index, (got, want) in enumerate(zip(received, theirs)):
            assert_same_tree(got[0], want, f"rank {rank} call {index}")
            assert got[1] == {"index": index, "rank": 1 - rank}
        if rank == 1:
            assert len(received) == len(expected) + 1
            assert_same_tree(received[-1][0], expected[2], "a lone send received alone")


def send_semantics_worker(out_path: str, transport: str) -> None:
    """What a send waits for, and the pattern NCCL deadlocks on: each rank posting a lone send to the
    other before its receive."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    p2p = PointToPoint(torch.device("cpu"), transport=transport)
    result = {}
    # Rank 1 posts its receive only once rank 0's send has returned (it learns so from a message that
    # rank 0 sends after it): gloo's posted sends return at once (they complete once received); a
    # rendezvous send returns only when received, so rank 0 fails at the timeout.
    started = time.monotonic()
    try:
        if rank == 0:
            works = p2p.post_send(torch.arange(3.0), peer)
            dist.send(torch.ones(1), peer, tag=7)
            for work in works:
                work.wait()
        else:
            dist.recv(torch.ones(1), peer, tag=7)
            result["received"] = p2p.recv(peer).tolist()
        result["order"] = "completed"
    except RuntimeError as error:
        result["order"] = f"failed: {error}"[:200]
    result["order_s"] = time.monotonic() - started
    torch.save(result, f"{out_path}.{rank}")
    if result["order"] == "completed":
        dist.barrier()  # the peer may still be reading


def crossing_sends_worker(out_path: str, transport: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=6))
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    p2p = PointToPoint(torch.device("cpu"), transport=transport)
    result = {}
    # One batched group with both: fine under either semantics.
    transfer = p2p.post([(torch.full((4,), float(rank)), peer, 0)], [(peer, 0)])
    transfer.wait()
    result["group"] = transfer.received[0].tolist()
    # Lone sends first on both ranks, receives after: a deadlock with rendezvous sends.
    started = time.monotonic()
    try:
        works = p2p.post_send(torch.full((4,), 10.0 + rank), peer, 0)
        result["crossing"] = p2p.recv(peer, 0).tolist()
        for work in works:
            work.wait()
    except RuntimeError as error:
        result["crossing"] = f"failed: {error}"[:200]
    result["crossing_s"] = time.monotonic() - started
    torch.save(result, f"{out_path}.{rank}")
    if not result["crossing"][0:6] == "failed":
        dist.barrier()  # the peer may still be reading


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["posted", "rendezvous"])
def test_rendezvous_sends_wait_for_their_receive_and_deadlock_where_nccl_would(tmp_path, transport):
    out = str(tmp_path / "semantics")
    for worker in (send_semantics_worker, crossing_sends_worker):
        try:
            spawn_workers(worker, world_size=2, args=(out + worker.__name__, transport), start_method="fork")
        except WorkerFailed:
            pass  # a rank whose peer failed first may exit with the error; its results are on disk
    order = [torch.load(f"{out}send_semantics_worker.{r}", weights_only=False) for r in (0, 1)]
    crossing = [torch.load(f"{out}crossing_sends_worker.{r}", weights_only=False) for r in (0, 1)]
    assert [c["group"] for c in crossing] == [[1.0] * 4, [0.0] * 4]
    if transport == "posted":
        assert order[1]["received"] == [0.0, 1.0, 2.0] and order[0]["order"] == "completed"
        assert [c["crossing"] for c in crossing] == [[11.0] * 4, [10.0] * 4]
    else:
        assert order[0]["order"].startswith("failed") and order[0]["order_s"] >= 5.0
        assert all(c["crossing"].startswith("failed") and c["crossing_s"] >= 5.0 for c in crossing)


@pytest.mark.parametrize("payload,message", [
    (torch.ones(1, dtype=torch.complex128), "dtype torch.complex128"),
    ((torch.ones(1), object()), "cannot send a object"),
    ({"x": torch.nn.Linear(1, 1)}, "cannot send a Linear"),
])
def test_unsendable_payloads_raise_before_any_communication(payload, message):
    # no process group exists here: the payload is rejected before anything is sent
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match=message):
        PointToPoint(torch.device("cpu")).post_send(payload, 1)


def failing_worker() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if dist.get_rank() == 1:
        raise ValueError("boom")
    PointToPoint(torch.device("cpu")).recv(1)  # never satisfied


@pytest.mark.timeout(120)
def test_failing_worker_does_not_hang():
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        spawn_workers(failing_worker, world_size=2, start_method="fork")
    elapsed = time.monotonic() - start
    assert "boom" in str(info.value)
    assert "ValueError" in str(info.value)
    assert "worker 1 failed" in str(info.value)
    assert elapsed < 30, f"took {elapsed:.1f}s"


def exiting_worker() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if dist.get_rank() == 1:
        import os

        os._exit(3)
    time.sleep(60)  # no communication: only rank 1 fails, rank 0 must be stopped


@pytest.mark.timeout(120)
def test_dying_worker_reports_exit_code():
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="worker 1 died with exit code 3"):
        spawn_workers(exiting_worker, world_size=2, start_method="fork")
    assert time.monotonic() - start < 30


@pytest.mark.timeout(120)
def test_original_error_is_reported_even_when_parent_is_late(monkeypatch):
    import merak.distributed.launch as launch

    real = launch.mp.start_processes

    def late_parent(*args, **kwargs):
        context = real(*args, **kwargs)
        time.sleep(2)  # the parent is descheduled for a moment (busy machine)
        return context

    monkeypatch.setattr(launch.mp, "start_processes", late_parent)
    with pytest.raises(WorkerFailed) as info:
        spawn_workers(failing_worker, world_size=2, start_method="fork")
    assert "boom" in str(info.value)
