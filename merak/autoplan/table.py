"""The planner's ranked table, as printed by ``merak-plan`` and ``parallel=auto``."""

from __future__ import annotations

from merak.autoplan.planner import PlanReport
from merak.autoplan.search import Candidate

COLUMNS = ("#", "dp", "tp", "pp", "mb", "M", "schedule", "recompute", "ZeRO", "SP", "step (ms)", "MFU",
           "memory/device (GiB)", "why not first")


ENERGY_COLUMNS = ("energy (J/step)", "clocks (MHz)")


def _row(rank: int, candidate: Candidate, report: PlanReport, note: str, energy: bool = False) -> list[str]:
    """One row; with ``energy``, the step is the one with the row's clock plan (its MFU too)."""
    layout = candidate.layout
    schedule = layout.schedule if layout.chunks == 1 else f"{layout.schedule} x{layout.chunks}"
    price = candidate.energy if energy else None
    step = price.step_s if price is not None else candidate.predicted_step_s
    mfu = report.mfu(candidate, step)
    cells = [str(rank), str(layout.dp), str(layout.tp), str(layout.pp), str(layout.micro_batch_size),
             str(layout.num_microbatches), schedule, layout.recompute, str(layout.zero_stage),
             "on" if layout.sequence_parallel else "off", f"{step * 1e3:,.1f}",
             "-" if mfu is None else f"{mfu:.1%}", f"{candidate.prediction.max_memory / 2**30:.3g}"]
    if energy:
        cells += [f"{price.energy_j:,.4g}", price.clocks()] if price is not None else ["-", "-"]
    return [*cells, note]


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

    energy = report.objective.wants_energy
    columns = (*COLUMNS[:-1], *ENERGY_COLUMNS, COLUMNS[-1]) if energy else COLUMNS
    shown = report.candidates[:top]
    rows = [_row(i + 1, c, report, note(i + 1, c), energy) for i, c in enumerate(shown)]
    if chosen is not None and all(c is not chosen for c in shown):
        rows.append(_row(report.candidates.index(chosen) + 1, chosen, report, note(0, chosen), energy))
    for name, candidate in extra:
        rows.append([name, *_row(0, candidate, report, candidate.why_not or "-", energy)[1:]])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    cluster = report.cluster
    head = (f"{report.recipe}/{report.model} on {report.world_size} x {cluster.accelerator.name} ({cluster.name}, "
            f"{cluster.nodes} node(s) x {cluster.devices_per_node}), global batch {report.global_batch_size}: "
            f"{len(report.candidates)} layouts priced in {report.search_seconds:.1f} s "
            f"(+{report.profile_seconds:.1f} s profiling the model)")
    if energy:
        head += (f"\nobjective {report.objective}: ranked by predicted energy per step over all "
                 f"{report.world_size} GPUs, each layout with its own clock plan ({_power_model(report)} clock and "
                 "power model)")
    return "\n".join([head, *lines])


def _power_model(report: PlanReport) -> str:
    priced = next((c.energy for c in report.candidates if c.energy is not None), None)
    return priced.power_model if priced is not None else "the devices'"
