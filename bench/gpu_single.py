"""merak on one GPU against a plain PyTorch loop: the same model, batch and optimizer, bf16.

For each recipe model, both loops of ``recipe_loops.py`` train on ``cuda``:

* plain: the recipe's ``build_model`` in fp32 under ``torch.autocast(bfloat16)``, fused AdamW,
  ``clip_grad_norm_(1.0)``, a ``DataLoader`` with pinned memory and the same workers;
* merak: ``train.py parallel=single trainer.bf16=true`` (bf16 weights, fp32 master weights and
  optimizer state), recomputation off as in the plain loop.

Each loop runs ``--warmup`` untimed and ``--steps`` timed iterations (whole iterations: data,
forward, backward, step; each ends with the loss read back, one synchronisation), then is freed
before the other starts (a 1.3 B model twice would not fit beside its activations). Reported per
model: median step time, samples and tokens per second, MFU (model FLOPs: 3 x the forward FLOPs
counted by ``torch.utils.flop_counter`` on one microbatch of the plain model, over the GPU's dense
bf16 peak), the allocator's peak memory, and merak / plain. Every recipe's model runs, so a crash
shows here too (the row says so and the others go on).

Runs on the GPU machine's stack (torch 2.11, transformers 5.17, Python 3.12) with hydra/omegaconf
carried as wheels (ENVIRONMENT.md):

    python bench/gpu_single.py [--model gpt2 --model vit-base ...] [--warmup 3 --steps 10] [--compile]
                               [--json out.json]

``--compile`` adds both loops compiled with inductor (plain: ``model.compile()`` on the whole model;
merak: ``trainer.torch_compile=true``, each stage's parts), their ratio and the speed-up of compiled
merak over the plain eager loop. Compilation happens in the warm-up iterations (untimed).

``--smoke`` runs the same code on the CPU with each recipe's toy model (a test of the script itself).
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads
import torch
from recipe_loops import MerakLoop, PlainLoop

logger = logging.getLogger("bench.gpu_single")

# model option -> (recipe, overrides). Batches: ENVIRONMENT.md's GPU table where it has one.
MODELS = {
    "gpt2": ("gpt", ["model=gpt2", "trainer.per_device_train_batch_size=8", "trainer.gradient_accumulation_steps=4"]),
    "gpt3-xl": ("gpt", ["model=gpt3-xl", "trainer.per_device_train_batch_size=8",
                        "trainer.gradient_accumulation_steps=2"]),
    "bert-base-uncased": ("bert", ["model=bert-base-uncased", "trainer.per_device_train_batch_size=8",
                                   "trainer.gradient_accumulation_steps=4"]),
    "t5-base": ("t5", ["model=t5-base", "trainer.per_device_train_batch_size=8",
                       "trainer.gradient_accumulation_steps=4"]),
    "vit-base": ("vit", ["model=vit-base", "trainer.per_device_train_batch_size=32",
                         "trainer.gradient_accumulation_steps=1", "data.num_samples=8192"]),
    "swin-tiny": ("swin", ["model=swin-tiny", "trainer.per_device_train_batch_size=32",
                           "trainer.gradient_accumulation_steps=1", "data.num_samples=8192"]),
    "wide-resnet50_2": ("wide_resnet", ["model=wide-resnet50_2", "trainer.per_device_train_batch_size=32",
                                        "trainer.gradient_accumulation_steps=1", "data.num_samples=8192"]),
}
DEFAULT_MODELS = ("gpt2", "gpt3-xl", "bert-base-uncased", "vit-base", "wide-resnet50_2")
COMMON = ["trainer.activation_checkpointing=false", "trainer.max_steps=100000"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS),
                        help=f"repeatable (default: {', '.join(DEFAULT_MODELS)}); 'all' of them with --all")
    parser.add_argument("--all", action="store_true", help="every model above (all six recipes)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4, help="data-loader workers of both loops")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    parser.add_argument("--compile", action="store_true",
                        help="also time both loops compiled: plain model.compile() and merak trainer.torch_compile")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy models, fp32: check the script runs")
    return parser.parse_args(argv)


def _device(args) -> str:
    return "cpu" if args.smoke else "cuda"


def _overrides(name: str, args) -> list[str]:
    recipe, overrides = MODELS[name]
    if args.smoke:  # the toy model of the recipe, two small microbatches, fp32
        overrides = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=2"]
    return [*overrides, *COMMON]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _forward_flops(plain: PlainLoop) -> float:
    """Forward FLOPs of one microbatch of the plain model (matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    batch = plain._to_device(plain.spec.collate([plain.dataset[i] for i in plain.plan.microbatch_indices(0)[0]]))
    inputs = {name: batch[name] for name in plain._input_names(batch)}
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), torch.autocast(plain.device.type, dtype=plain.dtype, enabled=plain.dtype != torch.float32), \
            counter:
        plain.model(**inputs)
    return float(counter.get_total_flops())


class _EnergyCounter:
    """Joules from NVML's total-energy counter of the current CUDA device (None where unreadable).

    Reads only: no clock or power setting is touched."""

    def __init__(self) -> None:
        self.device = None
        if torch.cuda.is_available():
            try:
                from merak.energy.nvml import NVMLDevice

                self.device = NVMLDevice(torch.cuda.current_device())
            except RuntimeError as error:  # no NVML library or binding: report steps without joules
                logger.warning("no energy readings: %s", error)

    def read(self) -> float | None:
        return self.device.energy() if self.device is not None else None


def _lm_flops_per_token(plain: PlainLoop) -> float | None:
    """Training FLOPs per token of a GPT, 6N + 12LHS (PaLM's appendix B: N parameters, L layers, width H,
    sequence S; attention's score and value products counted); None for other recipes."""
    if plain.spec.name != "gpt":
        return None
    cfg = plain.model_cfg
    params = sum(p.numel() for p in plain.model.parameters())
    return 6.0 * params + 12.0 * cfg.num_layers * cfg.hidden_size * cfg.seq_length


def _timed(loop, args, energy: _EnergyCounter) -> tuple[float, float, float | None]:
    """Median seconds per iteration, the allocator's peak bytes (0 on the CPU) and the joules per
    iteration over the timed ones (None without an energy counter)."""
    cuda = not args.smoke
    loop.run(args.warmup)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    joules_before = energy.read()
    times = loop.run(args.steps)
    if cuda:
        torch.cuda.synchronize()
    joules_after = energy.read()
    joules = None if joules_before is None else (joules_after - joules_before) / args.steps
    return common.median(times), float(torch.cuda.max_memory_allocated()) if cuda else 0.0, joules


def _plain(name: str, args, *, compiled: bool) -> PlainLoop:
    recipe = MODELS[name][0]
    return PlainLoop(recipe, _overrides(name, args), device=_device(args),
                     dtype=torch.float32 if args.smoke else torch.bfloat16, num_workers=args.workers,
                     channels_last=recipe == "wide_resnet" and not args.smoke, compile=compiled)


def _merak(name: str, args, output_dir: str, *, compiled: bool) -> MerakLoop:
    precision = [] if args.smoke else ["trainer.bf16=true"]
    compile_flags = ["trainer.torch_compile=true"] if compiled else []
    return MerakLoop(MODELS[name][0], [*_overrides(name, args), *precision, *compile_flags,
                                       f"trainer.dataloader_num_workers={args.workers}"], output_dir)


def _run_variant(row: dict, who: str, make, args, energy: _EnergyCounter) -> None:
    """Time one loop into ``row`` under the prefix ``who``; a crash is a result, reported in the row."""
    try:
        loop = make()
        try:
            row[f"{who}_s"], row[f"{who}_peak_bytes"], row[f"{who}_joules"] = _timed(loop, args, energy)
            row[f"{who}_first_loss"] = loop.losses[0]
        finally:
            if hasattr(loop, "close"):
                loop.close()
            del loop
    except Exception as error:  # report it and go on with the next loop
        row[f"{who}_error"] = f"{type(error).__name__}: {error}"
        logger.error("%s %s failed:\n%s", who, row["model"], traceback.format_exc())
    finally:
        _free()


def variants(args) -> list[str]:
    """The loops measured: plain and merak eager, and with ``--compile`` both compiled too."""
    return ["plain", "merak", *(["plain_compiled", "merak_compiled"] if args.compile else [])]


def measure(name: str, args: argparse.Namespace, peak_tflops: float | None,
            energy: _EnergyCounter | None = None, on_variant=None) -> dict:
    """Time every loop of ``variants(args)`` on model ``name``; a crash is reported in the row.
    ``on_variant(row)`` is called after each loop with the row so far."""
    energy = energy or _EnergyCounter()
    recipe = MODELS[name][0]
    row = {"model": name, "recipe": recipe, "overrides": _overrides(name, args)}
    try:
        plain = _plain(name, args, compiled=False)
        samples = plain.plan.micro_batch_size * plain.plan.num_microbatches
        tokens = samples * plain.spec.tokens_per_sample(plain.model_cfg)
        flops = 3 * _forward_flops(plain) * plain.plan.num_microbatches
        per_token = _lm_flops_per_token(plain)
        del plain
    except Exception as error:  # a model that cannot even be built: nothing else to measure
        row["plain_error"] = f"{type(error).__name__}: {error}"
        logger.error("plain %s failed:\n%s", name, traceback.format_exc())
        return row
    finally:
        _free()
    row.update(samples_per_step=samples, tokens_per_step=tokens, model_flops_per_step=flops,
               lm_flops_per_step=per_token * tokens if per_token else None)
    with tempfile.TemporaryDirectory() as output_dir:
        for who in variants(args):
            compiled = who.endswith("_compiled")
            make = (lambda compiled=compiled: _plain(name, args, compiled=compiled)) if who.startswith("plain") else \
                (lambda who=who, compiled=compiled: _merak(name, args, f"{output_dir}/{who}", compiled=compiled))
            _run_variant(row, who, make, args, energy)
            if on_variant is not None:
                on_variant(row)
    for who in variants(args):
        if f"{who}_s" in row:
            row[f"{who}_samples_per_s"] = samples / row[f"{who}_s"]
            row[f"{who}_tokens_per_s"] = tokens / row[f"{who}_s"]
            row[f"{who}_mfu"] = flops / row[f"{who}_s"] / (peak_tflops * 1e12) if peak_tflops else None
            if row["lm_flops_per_step"] and peak_tflops:  # the 6N + 12LHS convention
                row[f"{who}_mfu_6n"] = row["lm_flops_per_step"] / row[f"{who}_s"] / (peak_tflops * 1e12)
    if "merak_s" in row and "plain_s" in row:
        row["ratio"] = row["merak_s"] / row["plain_s"]
    if "merak_compiled_s" in row and "plain_compiled_s" in row:
        row["compiled_ratio"] = row["merak_compiled_s"] / row["plain_compiled_s"]
    if "merak_compiled_s" in row and "plain_s" in row:
        row["speedup_over_plain_eager"] = row["plain_s"] / row["merak_compiled_s"]
    return row


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


def _table(rows: list[dict], args) -> tuple[list[str], list[tuple]]:
    """Header and rows: seconds per step and MFU of each loop, the ratios, and the first error."""
    who = variants(args)
    header = ["model", *[f"{w} s/step" for w in who], "merak / plain"]
    if args.compile:
        header += ["merak_c / plain_c", "plain / merak_c"]
    header += [*[f"{w} MFU" for w in who], "peak GiB " + " / ".join(who), "J/step " + " / ".join(who), "error"]
    table = []
    for r in rows:
        error = next((r[f"{w}_error"] for w in who if f"{w}_error" in r), "")
        cells = [r["model"], *[_cell(r, f"{w}_s", ".4f") for w in who], _cell(r, "ratio", ".3f")]
        if args.compile:
            cells += [_cell(r, "compiled_ratio", ".3f"), _cell(r, "speedup_over_plain_eager", ".2f")]
        cells += [*[_cell(r, f"{w}_mfu", ".1%") for w in who],
                  " / ".join(f"{r.get(f'{w}_peak_bytes', 0) / 2**30:.1f}" for w in who),
                  " / ".join(_cell(r, f"{w}_joules", ".0f") for w in who), error[:80]]
        table.append(tuple(cells))
    return header, table


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    common.setup_logging()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_single.py needs a CUDA device (--smoke runs it on the CPU)")
    from merak.report.metrics import peak_tflops

    peak = None if args.smoke else peak_tflops(torch.bfloat16)
    gpu = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name()
    facts = {**common.machine_facts(), "gpu": gpu, "peak_bf16_tflops": peak}
    names = sorted(MODELS) if args.all else (args.model or list(DEFAULT_MODELS))
    energy = _EnergyCounter()
    rows = []

    def save(partial=None) -> None:
        # After every loop, so a run stopped at its time limit keeps what it measured.
        common.write_json(args.json, {"machine": facts, "args": vars(args),
                                      "results": rows + ([partial] if partial is not None else [])})

    for name in names:
        rows.append(measure(name, args, peak, energy, on_variant=save))
        save()
    print(common.format_facts(facts), f"| {facts['gpu']}, bf16 peak {peak} TFLOP/s")
    print(common.format_table(*_table(rows, args)))
    return rows


if __name__ == "__main__":
    main()
