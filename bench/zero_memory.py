"""Memory per rank of model states with ZeRO 0/1/2 at dp = 1, 2, 4, in fp32 and bf16: measured and by formula.

Each configuration trains the gpt recipe's GPT-2 for a few steps on random tokens
(one pipeline stage, ``dp`` processes, one thread each) and reports what rank 0
holds: parameters, gradients (the most held at once), fp32 master weights and
optimizer state (merak.engine.PipelineEngine.memory_report), and peak RSS. The
formula column is what the design says rank 0 should hold, with Ψ parameters
and d = dp:

    parameters   b Ψ                          (b = 4 fp32, 2 bf16)
    gradients    stage 0: b Ψ (bf16: 4 Ψ, the fp32 copies);  stage 1: b Ψ;
                 stage 2: 4 Ψ/d + at most one bucket and the parameter that filled it
    master       bf16: 4 Ψ/d' (d' = d when sharded, else 1); fp32: none (updated in place)
    optimizer    AdamW moments 8 Ψ/d'
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import common  # first: sets OMP_NUM_THREADS before torch starts
import torch

from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.optim.settings import OptimizerSettings, PrecisionSettings, ZeroSettings
from merak.report.metrics import peak_rss_bytes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(parser)
    parser.set_defaults(vocab_size=50257, hidden_size=768, num_heads=12, num_layers=12, seq_length=128,
                        micro_batch_size=1)
    parser.add_argument("--num-microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--bucket", type=int, default=5_000_000, help="zero_reduce_bucket_size (elements)")
    parser.add_argument("--json", default=None, help="write every measurement here")
    parser.add_argument("--formula-only", action="store_true",
                        help="print the formula for the recipe's GPT sizes and measure nothing")
    return parser.parse_args(argv)


def _worker(options: dict, dp: int, stage: int, precision: str, out_path: str) -> None:
    args = argparse.Namespace(**options)
    common.single_thread()
    common.setup_logging()
    state = groups.init(dp=dp, timeout_s=600)
    try:
        model_cfg = common.model_config(args)
        engine = common.single_stage_engine(
            args, state, num_microbatches=args.num_microbatches, total_steps=args.steps,
            dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
            optimizer=OptimizerSettings(learning_rate=1e-4),
            zero=ZeroSettings(zero_optimization=stage > 0, zero_stage=stage or 1, zero_reduce_bucket_size=args.bucket),
            precision=PrecisionSettings(bf16=precision == "bf16"))
        batches = common.random_batches(model_cfg, micro_batch_size=args.micro_batch_size,
                                        num_microbatches=args.num_microbatches, count=args.steps,
                                        seed=args.seed + state.rank)
        for step in range(args.steps):
            engine.train_step(batches[step])
        if state.rank == 0:
            report = engine.memory_report()
            report.pop("peak_activation_bytes")
            Path(out_path).write_text(json.dumps({
                **report, "peak_rss_bytes": peak_rss_bytes(),
                "num_parameters": sum(p.numel() for _, p in engine.named_parameters()),
                "largest": max(p.numel() for _, p in engine.named_parameters())}))
    finally:
        groups.shutdown()


def formula(psi: int, largest: int, *, dp: int, stage: int, precision: str, bucket: int) -> dict[str, float]:
    """What rank 0 should hold (bytes), from the design (see the module docstring)."""
    b = 2 if precision == "bf16" else 4
    shards = dp if stage >= 1 and dp > 1 else 1
    if stage >= 2 and dp > 1:
        gradients = 4 * psi / dp + b * min(psi, dp * bucket + largest)
    else:
        # bf16 without sharding: the gradients become fp32 copies (each bf16 one freed as it is copied)
        gradients = 4 * psi if precision == "bf16" and stage == 0 else b * psi
    return {"parameter_bytes": b * psi, "gradient_bytes": gradients,
            "master_weight_bytes": 4 * psi / shards if precision == "bf16" else 0,
            "optimizer_state_bytes": 8 * psi / shards}


# Sizes of the gpt recipe's model table (hidden size, layers); parameters counted on the meta device.
GPT_SIZES = {"gpt2": (768, 12), "gpt2-medium": (1024, 24), "gpt2-large": (1280, 36), "gpt2-xl": (1600, 48),
             "gpt3-2.7b": (2560, 32), "gpt3-6.7b": (4096, 32), "gpt3-13b": (5120, 40), "gpt3-175b": (12288, 96)}


def _configurations(dps) -> list[tuple[int, int]]:
    """(dp, ZeRO stage) pairs; at dp=1 there is nothing to shard, so only stage 0."""
    return [(dp, stage) for dp in dps for stage in ((0,) if dp == 1 else (0, 1, 2))]


def formula_table(bucket: int, dps) -> str:
    """Model-state GiB per rank by formula (bf16, pp = tp = 1) for the recipe's GPT sizes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    rows = []
    for name, (hidden, layers) in GPT_SIZES.items():
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=hidden // 64, vocab_size=50257,
                            n_positions=2048)
        with torch.device("meta"):
            psi = sum(p.numel() for p in GPT2LMHeadModel(config).parameters())
        cells = [name, f"{psi / 1e9:.2f} B"]
        for dp, stage in _configurations(dps):
            states = formula(psi, 50257 * hidden, dp=dp, stage=stage, precision="bf16", bucket=bucket)
            cells.append(f"{sum(states.values()) / 2**30:,.1f}")
        rows.append(cells)
    header = ["model", "parameters", *(f"dp{dp} Z{stage}" for dp, stage in _configurations(dps))]
    return common.format_table(header, rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.formula_only:
        print(f"bf16 model states per rank (GiB) by formula, pp = tp = 1, zero_reduce_bucket_size={args.bucket:,}")
        print(formula_table(args.bucket, args.dps))
        return 0
    common.setup_logging()
    facts = common.machine_facts()
    rows, results = [], []
    keys = ("parameter_bytes", "gradient_bytes", "master_weight_bytes", "optimizer_state_bytes")
    for precision in args.precisions:
        for dp, stage in _configurations(args.dps):
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "rank0.json")
                spawn_workers(_worker, world_size=dp, args=(vars(args), dp, stage, precision, out))
                measured = json.loads(Path(out).read_text())
            expected = formula(measured["num_parameters"], measured["largest"], dp=dp, stage=stage,
                               precision=precision, bucket=args.bucket)
            total = sum(measured[k] for k in keys)
            total_formula = sum(expected[k] for k in keys)
            results.append({"precision": precision, "dp": dp, "zero_stage": stage, "measured": measured,
                            "formula": expected})
            mib = 2 ** 20
            rows.append([precision, dp, stage, *(f"{measured[k] / mib:,.0f}" for k in keys),
                         f"{total / mib:,.0f}", f"{total_formula / mib:,.0f}",
                         f"{measured['peak_rss_bytes'] / mib:,.0f}"])
    psi = results[0]["measured"]["num_parameters"]
    print(f"GPT-2 {psi / 1e6:.1f} M parameters (hidden {args.hidden_size}, {args.num_layers} layers, vocab "
          f"{args.vocab_size}), rank 0 of dp ranks, MiB; zero_reduce_bucket_size={args.bucket:,}")
    print(common.format_facts(facts))
    print(common.format_table(["precision", "dp", "ZeRO", "params", "grads", "master", "optimizer",
                               "model states", "formula", "peak RSS"], rows))
    common.write_json(args.json, {"facts": facts, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
