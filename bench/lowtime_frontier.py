"""Compute the Perseus (lowtime) time-energy frontier of a 1F1B pipeline.

Standalone baseline for benchmarking our pipeline frequency planner against
`lowtime==0.3.0` (the Perseus solver). It does not import `merak` or torch.

The script mirrors lowtime's own Perseus example (`examples/perseus.py` in
ml-energy/lowtime) step by step:

1. For every (stage, instruction) it builds `ExecutionOption(real_time, unit_time,
   cost=energy, knob=frequency)` from the profile, wraps them in
   `CandidateExecutionOptions` (Pareto filter on (real_time, energy), quantize time
   with `int(real_time // unit_time)`, keep one option per quantized time), then
   subtracts the P2P blocking power from each surviving option's cost
   (`cost -= p2p_power * quant_time * unit_time`), fits `ExponentialModel` (default
   grid-searched initial guess) and makes an `OperationSpec`.
2. Builds the AON DAG: node 0 = source, node 1 = sink, instructions numbered from 2
   in stage order, each stage's instructions from `Synchronous1F1B` chained in
   execution order, then F(s,m)->F(s+1,m) and B(s+1,m)->B(s,m) (the example's
   `forward_dep`/`backward_dep` rules; added directly instead of the O(N^2)
   `DependencyResolver` pair scan, same edges, same insertion order), then
   `add_source_node`/`add_sink_node`. Communication time is zero.
3. Runs `PhillipsDessouky(dag).run()` from the slowest plan to the fastest.

For each frontier point (the initial all-slowest plan plus every solver iteration)
it reads each op's `assigned_knob`, recomputes the iteration time as the DAG's
longest path with the chosen frequencies' real profiled times, and the energy as
    sum(chosen energies) + p2p_power * (S * T - sum(chosen times)).
Outputs: `--out` CSV (iteration_time, quantized_time, energy), a JSON summary next
to it, and optionally per-point frequencies (`--freqs-out`, JSON lines).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import networkx as nx
import pandas as pd
from lowtime.cost_model import ExponentialModel
from lowtime.graph_utils import add_sink_node, add_source_node
from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
from lowtime.perseus.instruction import Backward, Forward, Instruction
from lowtime.perseus.schedule import Synchronous1F1B
from lowtime.solver import PhillipsDessouky

logger = logging.getLogger("lowtime_frontier")
INSTRUCTIONS = {"forward": Forward, "backward": Backward}


def build_specs(df: pd.DataFrame, num_stages: int, p2p_power: float, unit_time: float):
    """Per-stage {Forward/Backward: OperationSpec}, exactly as the Perseus example."""
    specs: list[dict[type[Instruction], OperationSpec]] = [{} for _ in range(num_stages)]
    for name, inst_cls in INSTRUCTIONS.items():
        for stage in range(num_stages):
            rows = df[(df.stage == stage) & (df.instruction == name)]
            if rows.empty:
                raise ValueError(f"No profile rows for stage {stage} {name}")
            options = [
                ExecutionOption[int](real_time=float(r.time), unit_time=unit_time,
                                     cost=float(r.energy), knob=int(r.frequency))
                for r in rows.itertuples()
            ]
            cand = CandidateExecutionOptions[int](options=options)
            for option in cand.options:  # effective computation energy
                option.cost -= p2p_power * option.quant_time * option.unit_time
            model = ExponentialModel(cand)
            specs[stage][inst_cls] = OperationSpec[int](options=cand, cost_model=model)
            logger.info("Stage %d %s: %d candidate options (quant %d..%d)", stage, name,
                        len(cand.options), cand.options[-1].quant_time, cand.options[0].quant_time)
    return specs


def build_dag(specs, num_stages: int, num_mbs: int) -> nx.DiGraph:
    """1F1B AON DAG with the Perseus example's node numbering and edge order."""
    dag = nx.DiGraph()
    node_id = 2
    index: dict[tuple[type, int, int], int] = {}
    for stage in range(num_stages):
        stage_ids = []
        for inst in Synchronous1F1B(num_stages=num_stages, num_micro_batches=num_mbs,
                                    stage_id=stage, operation_spec_map=specs[stage]):
            dag.add_node(node_id, op=inst)
            index[(type(inst), stage, inst.micro_batch_id)] = node_id
            stage_ids.append(node_id)
            node_id += 1
        dag.add_edges_from(zip(stage_ids, stage_ids[1:]))
    for nid in sorted(index.values()):
        inst = dag.nodes[nid]["op"]
        s, m = inst.stage_id, inst.micro_batch_id
        dst = (Forward, s + 1, m) if isinstance(inst, Forward) else (Backward, s - 1, m)
        if dst in index:
            dag.add_edge(nid, index[dst])
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1
    return dag


def longest_path(dag: nx.DiGraph, order: list[int], weight: dict[int, float]) -> float:
    """Longest source-to-sink path with node weights (missing nodes weigh 0)."""
    finish: dict[int, float] = {}
    for n in order:
        start = max((finish[p] for p in dag.predecessors(n)), default=0.0)
        finish[n] = start + weight.get(n, 0.0)
    return finish[dag.graph["sink_node"]]


def evaluate(dag, order, op_nodes, prof, num_stages, p2p_power) -> dict:
    """Recompute real iteration time and energy from each op's assigned frequency."""
    knobs, times, quant, energy_sum = {}, {}, {}, 0.0
    for n in op_nodes:
        op = dag.nodes[n]["op"]
        t, e = prof[(op.stage_id, type(op).__name__.lower(), op.assigned_knob)]
        knobs[n], times[n], quant[n] = op.assigned_knob, t, op.duration
        energy_sum += e
    iter_time = longest_path(dag, order, times)
    energy = energy_sum + p2p_power * (num_stages * iter_time - sum(times.values()))
    return {"iteration_time": iter_time, "quantized_time": int(longest_path(dag, order, quant)),
            "energy": energy, "knobs": knobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--num-stages", type=int, required=True)
    parser.add_argument("--num-microbatches", type=int, required=True)
    parser.add_argument("--p2p-power", type=float, required=True, help="Watts")
    parser.add_argument("--unit-time", type=float, default=0.001, help="seconds per unit")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-seconds", type=float, default=None)
    parser.add_argument("--freqs-out", type=Path, default=None,
                        help="optional JSON-lines file with per-point frequencies")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lowtime").setLevel(logging.WARNING)  # solver logs every op change
    S, M = args.num_stages, args.num_microbatches

    df = pd.read_csv(args.profile)
    df = df[df.stage < S]
    prof = {(int(r.stage), r.instruction, int(r.frequency)): (float(r.time), float(r.energy))
            for r in df.itertuples()}

    t_start = time.perf_counter()
    specs = build_specs(df, S, args.p2p_power, args.unit_time)
    dag = build_dag(specs, S, M)
    order = list(nx.topological_sort(dag))
    op_nodes = [n for n in order if not dag.nodes[n]["op"].is_dummy]
    solver = PhillipsDessouky(dag)
    t_setup = time.perf_counter() - t_start

    points = [evaluate(dag, order, op_nodes, prof, S, args.p2p_power)]  # all-slowest start
    complete, solver_s = True, 0.0
    gen = solver.run()
    while True:
        t0 = time.perf_counter()
        result = next(gen, None)
        solver_s += time.perf_counter() - t0
        if result is None:
            break
        point = evaluate(dag, order, op_nodes, prof, S, args.p2p_power)
        if point["quantized_time"] != result.quant_time:
            logger.warning("Quantized time mismatch: ours %d, lowtime %d",
                           point["quantized_time"], result.quant_time)
        point["quantized_time"] = result.quant_time
        points.append(point)
        if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
            logger.warning("--max-seconds %.1f reached after %d points", args.max_seconds, len(points))
            complete = False
            break
    solve_s = time.perf_counter() - t_start

    # Reference: every op at its maximum profiled frequency.
    fmax = {n: max(f for (s, i, f) in prof
                   if s == dag.nodes[n]["op"].stage_id and i == type(dag.nodes[n]["op"]).__name__.lower())
            for n in op_nodes}
    fmax_times = {n: prof[(dag.nodes[n]["op"].stage_id, type(dag.nodes[n]["op"]).__name__.lower(), f)][0]
                  for n, f in fmax.items()}
    fmax_time = longest_path(dag, order, fmax_times)
    fmax_energy = sum(prof[(dag.nodes[n]["op"].stage_id, type(dag.nodes[n]["op"]).__name__.lower(), f)][1]
                      for n, f in fmax.items()) + args.p2p_power * (S * fmax_time - sum(fmax_times.values()))
    best = min(points, key=lambda p: (p["iteration_time"], p["energy"]))
    logger.info("Fastest point time %.6f s vs all-max-frequency 1F1B time %.6f s (diff %.3g s)",
                best["iteration_time"], fmax_time, best["iteration_time"] - fmax_time)
    if complete:
        assert abs(best["iteration_time"] - fmax_time) <= 1e-9 * max(1.0, fmax_time), \
            "fastest frontier point does not reach the all-max-frequency iteration time"

    args.out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{k: p[k] for k in ("iteration_time", "quantized_time", "energy")}
                  for p in points]).to_csv(args.out, index=False)
    if args.freqs_out is not None:
        with args.freqs_out.open("w") as f:
            for i, p in enumerate(points):
                freqs = [[p["knobs"][n] for n in sorted(op_nodes) if dag.nodes[n]["op"].stage_id == s]
                         for s in range(S)]
                f.write(json.dumps({"point": i, "iteration_time": p["iteration_time"],
                                    "energy": p["energy"], "freqs": freqs}) + "\n")
    summary = {
        "solve_seconds": solve_s, "setup_seconds": t_setup, "solver_seconds": solver_s,
        "num_stages": S, "num_microbatches": M, "unit_time": args.unit_time,
        "p2p_power": args.p2p_power, "num_points": len(points), "complete": complete,
        "min_time": best["iteration_time"], "min_time_energy": best["energy"],
        "min_time_quantized": best["quantized_time"],
        "max_time": points[0]["iteration_time"], "max_time_energy": points[0]["energy"],
        "all_max_freq_time": fmax_time, "all_max_freq_energy": fmax_energy,
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("Summary: %s", json.dumps(summary))


if __name__ == "__main__":
    main()
