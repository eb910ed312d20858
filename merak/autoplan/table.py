"""The planner's ranked table, as printed by ``merak-plan`` and ``parallel=auto``."""

from __future__ import annotations

from merak.autoplan.planner import PlanReport
from merak.autoplan.search import Candidate

COLUMNS = ("#", "dp", "tp", "pp", "mb", "M", "schedule", "recompute", "ZeRO", "SP", "step (ms)", "MFU",
           "memory/device (GiB)", "why not first")


def _row(rank: int, candidate: Candidate, report: PlanReport, note: str) -> list[str]:
    layout = candidate.layout
    schedule = layout.schedule if layout.chunks == 1 else f"{layout.schedule} x{layout.chunks}"
    mfu = report.mfu(candidate)
    return [str(rank), str(layout.dp), str(layout.tp), str(layout.pp), str(layout.micro_batch_size),
            str(layout.num_microbatches), schedule, "on" if layout.recompute else "off", str(layout.zero_stage),
            "on" if layout.sequence_parallel else "off", f"{candidate.predicted_step_s * 1e3:,.1f}",
            "-" if mfu is None else f"{mfu:.1%}", f"{candidate.prediction.max_memory / 2**30:.3g}", note]


def format_table(report: PlanReport, top: int = 10, extra: list[tuple[str, Candidate]] = (),
                 chosen: Candidate | None = None) -> str:
    """The first ``top`` candidates and ``extra`` named ones as a text table; ``chosen``, the layout trials
    chose when not the best predicted, is marked (and shown after the others when below ``top``)."""
    chosen = chosen if chosen is not None and chosen is not report.best else None

    def note(rank: int, candidate: Candidate) -> str:
        if candidate is chosen:
            return "(chosen: fastest in the trials)"
        if rank == 1:
            return "(slower in the trials)" if chosen is not None else "(chosen)"
        return candidate.why_not

    shown = report.candidates[:top]
    rows = [_row(i + 1, c, report, note(i + 1, c)) for i, c in enumerate(shown)]
    if chosen is not None and all(c is not chosen for c in shown):
        rows.append(_row(report.candidates.index(chosen) + 1, chosen, report, note(0, chosen)))
    for name, candidate in extra:
        rows.append([name, *_row(0, candidate, report, candidate.why_not or "-")[1:]])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(COLUMNS)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths)).rstrip()]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    cluster = report.cluster
    head = (f"{report.recipe}/{report.model} on {report.world_size} x {cluster.accelerator.name} ({cluster.name}, "
            f"{cluster.nodes} node(s) x {cluster.devices_per_node}), global batch {report.global_batch_size}: "
            f"{len(report.candidates)} layouts priced in {report.search_seconds:.1f} s "
            f"(+{report.profile_seconds:.1f} s profiling the model)")
    return "\n".join([head, *lines])
