"""What a run shows and writes: progress bar, metrics.jsonl (and its loss.png), summary.json and the summary table."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import statistics
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from merak.report.curves import write_run_curves

logger = logging.getLogger(__name__)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


# A step's figures that exist only where the run measures them (its energy): left out of its line otherwise.
MEASURED_KEYS = ("energy_j", "joules_per_token", "joules_per_sample", "power_w")


@dataclass
class StepRecord:
    """One line of metrics.jsonl.

    The energy figures are those of a logged step of a run that measures energy (docs/energy.md):
    ``energy_j`` over all devices, ``joules_per_token`` (text) or ``joules_per_sample``, and
    ``power_w``, the mean power of one device; None (and left out of the line) otherwise.
    """

    step: int
    loss: float
    learning_rate: float
    grad_norm: float
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    skipped: bool = False
    loss_scale: float = 1.0
    energy_j: float | None = None
    joules_per_token: float | None = None
    joules_per_sample: float | None = None
    power_w: float | None = None

    def to_json(self) -> dict:
        """The metrics.jsonl line's fields: non-finite numbers as null, unmeasured figures left out."""
        values = {key: value for key, value in asdict(self).items()
                  if not (key in MEASURED_KEYS and value is None)}
        return _strict_json(values)

    def measured(self) -> dict:
        """The step's measured figures (its energy), where it has them."""
        return {key: getattr(self, key) for key in MEASURED_KEYS if getattr(self, key) is not None}

    def tracked(self) -> dict:
        """What the experiment trackers get for this step (``train/...``)."""
        metrics = {"train/loss": self.loss, "train/learning_rate": self.learning_rate,
                   "train/grad_norm": self.grad_norm, "train/samples_per_s": self.samples_per_s}
        metrics.update({f"train/{key}": value for key, value in self.measured().items()})
        return metrics


class MetricsWriter:
    """Rank 0's progress bar, per-step metrics file and its loss curves (``loss.png``).

    Args:
        output_dir: run directory (metrics.jsonl goes there).
        total_steps: length of the run, for the progress bar.
        samples_per_step: global batch size.
        tokens_per_sample: tokens in one sample (1 for non-text models).
        enabled: False on ranks that do not report.
        start_step: steps already done (a resumed run keeps metrics.jsonl up to there and appends).
        progress_bar: show a progress bar on stderr.
        trackers: experiment trackers (``trainer.report_to``) that get the logged steps and evaluations.
    """

    def __init__(self, *, output_dir: str, total_steps: int, samples_per_step: int, tokens_per_sample: int,
                 enabled: bool, logging_steps: int = 1, start_step: int = 0, progress_bar: bool = True,
                 trackers=None) -> None:
        self.enabled = enabled
        self.trackers = trackers  # merak.report.trackers.Trackers (rank 0), or None
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample
        self.logging_steps = max(1, logging_steps)
        self.records: list[StepRecord] = []
        self._file = None
        self._bar = None
        self._closed = False
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            path = self._path = os.path.join(output_dir, "metrics.jsonl")
            kept = _lines_up_to(path, start_step) if start_step else []
            self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115  (held open for the run; closed in close())
            self._file.writelines(kept)
        if enabled and progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                             dynamic_ncols=True, mininterval=0.5)

    def logs(self, step: int) -> bool:
        """Whether step ``step`` gets a metrics.jsonl line (every ``logging_steps``-th step)."""
        return step % self.logging_steps == 0

    def log_step(self, *, step: int, loss: float, lr: float, grad_norm: float, step_time_s: float,
                 skipped: bool = False, loss_scale: float = 1.0, measured: dict | None = None) -> StepRecord:
        """Record one optimizer step (``step`` counts from 1) and return its record. ``measured``: the
        step's figures named in ``MEASURED_KEYS`` (its energy), where they were measured."""
        record = StepRecord(step=step, loss=loss, learning_rate=lr, grad_norm=grad_norm, step_time_s=step_time_s,
                            samples_per_s=self.samples_per_step / step_time_s,
                            tokens_per_s=self.samples_per_step * self.tokens_per_sample / step_time_s,
                            skipped=skipped, loss_scale=loss_scale, **(measured or {}))
        self.records.append(record)
        if not self.enabled:
            return record
        if self.logs(step):
            self._file.write(json.dumps(record.to_json()) + "\n")
            self._file.flush()
            if self.trackers is not None:
                self.trackers.log(record.tracked(), step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            self._bar.update(1)
        return record

    @contextlib.contextmanager
    def above_the_bar(self) -> Iterator[None]:
        """Within the block, what is written to the terminal (a log line) goes above the progress bar,
        not glued to the end of it; the bar is drawn again below."""
        if self._bar is None:
            yield
            return
        with self._bar.external_write_mode(file=sys.stderr):
            yield

    def log_event(self, entry: dict) -> None:
        """Append a line that is not a training step (evaluation results) to metrics.jsonl."""
        if self._file is not None and not self._file.closed:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()
        elif self.enabled:
            with open(self._path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")
            if self._closed:  # an evaluation after training (MerakTrainer.evaluate): loss.png gains its point
                write_run_curves(os.path.dirname(self._path))
        if self.trackers is not None and "step" in entry:
            self.trackers.log({f"eval/{key.removeprefix('eval_')}": value for key, value in entry.items()
                               if key.startswith("eval_")}, entry["step"])

    def close(self) -> None:
        """End the run's reporting: close the progress bar, metrics.jsonl and the trackers, and draw
        ``loss.png`` beside metrics.jsonl (:mod:`merak.report.curves`). Called when training stops,
        finished or not; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self.trackers is not None:
            self.trackers.close()
        if self.enabled:
            write_run_curves(os.path.dirname(self._path))

    def throughput(self) -> dict[str, float]:
        """Median step time (first step excluded as warm-up when there are more) and rates."""
        times = [r.step_time_s for r in self.records[1:]] or [r.step_time_s for r in self.records]
        median = statistics.median(times)
        return {"median_step_time_s": median,
                "samples_per_s": self.samples_per_step / median,
                "tokens_per_s": self.samples_per_step * self.tokens_per_sample / median}


# Dense peak TFLOP/s per device by (name fragment, dtype class), from the vendors' data sheets
# (SXM parts; tensor cores for 16-bit, TF32 for float32). Matched against torch.cuda.get_device_name().
_PEAK_TFLOPS = (("H200", {"16bit": 989.0, "float32": 494.5}), ("H100", {"16bit": 989.0, "float32": 494.5}),
                ("A100", {"16bit": 312.0, "float32": 156.0}))


def _strict_json(values: dict) -> dict:
    """Non-finite numbers as null: json.dumps would write NaN and Infinity, which are not JSON."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in values.items()}


def peak_tflops(dtype) -> float | None:
    """The dense peak TFLOP/s of this machine's CUDA device for ``dtype`` (None on CPU or unknown parts)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    kind = "float32" if dtype == torch.float32 else "16bit"
    for fragment, peaks in _PEAK_TFLOPS:
        if fragment in name:
            return peaks[kind]
    return None


def _lines_up_to(path: str, step: int) -> list[str]:
    """The lines of an earlier metrics.jsonl for steps up to ``step`` (a resumed run redoes the rest)."""
    if not os.path.isfile(path):
        return []
    kept = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a line cut short by a crash ends what can be kept
    return kept


def format_summary(summary: dict) -> str:
    """The closing table: throughput, time per step and memory per stage."""
    layout = summary["layout"]
    lines = [
        (f"run summary ({summary['recipe']} / {summary['model']}, dp={layout['dp']} tp={layout['tp']} "
         f"pp={layout['pp']}, schedule {summary['schedule']})"),
        (f"  steps              {summary['steps']}  (global batch {summary['global_batch_size']}, "
         f"{summary['num_microbatches']} microbatches)"),
    ]
    if summary.get("first_loss") is None:
        lines.append("  (no step left to train: the run resumed at its last step)")
    else:
        lines += [
            f"  loss               {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}",
            f"  time per step      {summary['median_step_time_s'] * 1000:,.1f} ms (median)",
            f"  throughput         {summary['samples_per_s']:,.1f} samples/s"
            # An image or a label is one "token" (tokens_per_sample 1): tokens/s would repeat samples/s.
            + (f", {summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] != summary["samples_per_s"]
               else ""),
        ]
    flops = summary.get("flops")
    if flops:
        mfu = f"MFU {flops['mfu']:.1%}" if flops.get("mfu") is not None else \
            "MFU n/a (set trainer.peak_tflops to the device's peak)"
        lines.append(f"  model FLOPs        {_human(flops['model_flops_per_step'])}/step, "
                     f"{_human(flops['tflops_per_s_per_device'] * 1e12)}FLOP/s per device, {mfu}")
        lines.append(f"                     ({flops['formula']})")
    energy_line = format_energy(summary.get("energy"))
    if energy_line:
        lines.append(f"  energy             {energy_line}")
    precision = summary.get("precision")
    if precision:
        lines.append(f"  precision          {precision['dtype']}, ZeRO stage {precision['zero_stage']}"
                     + (f", loss scale {precision['loss_scale']:g}, {precision['skipped_steps']} steps skipped"
                        if precision["dtype"] == "float16" else ""))
    compiled = summary.get("compile")
    if compiled and compiled.get("enabled"):
        eager = ", some parts eager (see summary.json)" if compiled.get("eager_ranges") else ""
        lines.append(f"  compiled stages    {compiled['backend']}"
                     + (f" mode {compiled['mode']}" if compiled.get("mode") else "")
                     + (", CUDA graphs" if compiled.get("cuda_graphs") else "")
                     + f", {compiled['compile_s']:,.1f} s compiling (slowest rank){eager}")
    lines += [
        f"  wall time          {summary['wall_time_s']:,.1f} s",
        "  memory per stage (MiB, max over the stage's ranks; activations: saved for backward, at peak, with "
        "trainer.measure_activation_memory=true; GPU: the allocator's peak):",
        "    stage  params(M)  parameters  gradients  master  optimizer  activations  peak RSS  GPU peak",
    ]
    for stage in summary["stages"]:
        lines.append(
            f"    {stage['stage']:>5}  {stage['num_parameters'] / 1e6:>9.2f}  {_mib(stage['parameter_bytes']):>10}"
            f"  {_mib(stage['gradient_bytes']):>9}  {_mib(stage.get('master_weight_bytes', 0)):>6}"
            f"  {_mib(stage['optimizer_state_bytes']):>9}"
            f"  {_mib_or_dash(stage.get('peak_activation_bytes')):>11}  {_mib(stage['peak_rss_bytes']):>8}"
            f"  {_mib_or_dash(stage.get('peak_allocated_bytes')):>8}")
    return "\n".join(lines)


def format_energy(energy: dict | None) -> str | None:
    """The summary table's energy line after its label: ``812.3 J/step on 4 simulated A100, 0.4 J/token,
    203 W per device, 1.05 GFLOP/J`` (and the plan or zeus job a run followed), or why nothing was
    measured; None without an energy section or a measured step."""
    if not energy:
        return None
    if energy.get("measured") is False:
        return f"not measured: {energy['why']}"
    joules = energy.get("joules_per_step", energy.get("iteration_energy_j"))
    if joules is None:
        return None
    devices = energy.get("devices") or len(energy.get("ranks") or ()) or 1
    parts = [f"{joules:,.1f} J/step on {devices} {energy['device']}"]
    if energy.get("joules_per_token") is not None:
        parts.append(f"{energy['joules_per_token']:.3g} J/token")
    elif energy.get("joules_per_sample") is not None:
        parts.append(f"{energy['joules_per_sample']:.3g} J/sample")
    if energy.get("power_w_per_device") is not None:
        parts.append(f"{energy['power_w_per_device']:,.0f} W per device")
    if energy.get("flop_per_joule"):
        parts.append(f"{_si(energy['flop_per_joule'])}FLOP/J")
    if energy.get("plan"):
        parts.append(f"plan {energy['plan']}")
    elif energy.get("zeus_job_id"):
        parts.append(f"zeus job {energy['zeus_job_id']}")
    return ", ".join(parts)


_SI_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _si(count: float) -> str:
    """``count`` with an SI prefix and a space before the unit that follows: ``1.05 G``."""
    for scale, prefix in _SI_PREFIXES:
        if abs(count) >= scale:
            return f"{count / scale:.3g} {prefix}"
    return f"{count:.3g} "


def _mib_or_dash(value: int | None) -> str:
    return "-" if value is None else _mib(value)


def _human(count: float, unit: str = "") -> str:
    for scale, suffix in _SI_PREFIXES:
        if abs(count) >= scale:
            return f"{count / scale:.2f}{suffix}{unit}"
    return f"{count:.0f}{unit}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def format_partition(report: dict) -> str:
    """The dry-run table: per stage its modules, parameters, FLOPs, forward + backward time per microbatch,
    the bytes it sends per microbatch, memory per device, and what it sends. Time and memory are the
    planner's for its cluster when the report carries them (``priced_on_cluster``: ``parallel=auto`` on a
    named cluster, with its schedule, ZeRO and recomputation), else this machine's estimate."""
    layout = report["layout"]
    priced = report.get("priced_on_cluster")
    lines = [f"pipeline plan ({report['recipe']} / {report['model']}, pp={layout['pp']}): captured with "
             f"{report['trace_method']}, {report['num_shards']} shards by {report['split_method']}, "
             f"stages by {report['partition_method']}, boundaries {report['boundaries']}"]
    lines += [f"  note: {note}" for note in report.get("notes", [])]
    lines.append(f"{'stage':>5} {'shards':>9} {'params':>9} {'fwd FLOPs':>10} {'fwd+bwd':>10} {'sends':>9} "
                 f"{'memory':>10}  modules / sends")
    # A transformer's stages usually send one tensor of one shape each: said once, not per stage.
    sending = [stage for stage in report["stages"] if stage["sends"]]
    kinds = {tuple(stage["sends"].values()) for stage in sending}
    one_kind = next(iter(kinds))[0] if len(kinds) == 1 and len(next(iter(kinds))) == 1 and len(sending) > 1 \
        and sending == report["stages"][:len(sending)] else None
    for index, stage in enumerate(report["stages"]):
        first, last = stage["shards"]
        modules = stage["modules"]
        shown = ", ".join(modules[:3]) + (f", ... ({len(modules)} modules)" if len(modules) > 3 else "")
        if priced is not None:
            seconds, memory = priced["stages"][index]["fwd_bwd_s"], priced["stages"][index]["memory_bytes"]
        else:
            seconds = (stage["predicted_forward_s"] + stage["predicted_backward_s"]
                       if "predicted_forward_s" in stage else None)
            memory = stage["estimated_memory_bytes"]
        lines.append(f"{stage['stage']:>5} {f'{first}-{last - 1}':>9} {_human(stage['num_parameters']):>9} "
                     f"{_human(stage['forward_flops']):>10} {_duration(seconds):>10} "
                     f"{_human(stage.get('send_bytes', 0), 'B'):>9} {_gib(memory):>10}  {shown}")
        if stage["sends"] and not one_kind:
            lines.append(f"{'':>70}sends {', '.join(f'{k}: {v}' for k, v in stage['sends'].items())}")
    if one_kind:
        lines.append(f"{'':>70}stages 0-{len(sending) - 1} each send {one_kind}")
    if priced is not None:
        lines.append(f"predicted {priced['schedule']} step on {priced['devices']} ({priced['cluster']}): "
                     f"{_duration(priced['step_s'])} ({priced['num_microbatches']} microbatches, ZeRO "
                     f"{priced['zero_stage']}, recomputation {priced['recompute']}); fwd+bwd "
                     f"and sends per microbatch, memory per device: the plan's first row")
    elif report.get("predicted_step_s") is not None:
        lines.append(f"predicted 1F1B step on this machine ({report.get('num_microbatches', '?')} microbatches, "
                     f"sends not counted): {_duration(report['predicted_step_s'])}; fwd+bwd and sends are per "
                     f"microbatch, memory counts no ZeRO")
    return "\n".join(lines)
