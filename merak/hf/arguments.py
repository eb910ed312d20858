"""MerakArguments: Hugging Face ``TrainingArguments`` plus Merak's parallelism fields.

Every field of the original Merak API document exists here with its documented
name, default and meaning; the ones merak implements under another name map
onto the run settings (:func:`trainer_settings`), and values that cannot work
are rejected by :meth:`MerakArguments.problems` with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from functools import cached_property

import torch
from transformers import TrainingArguments

from merak.config import TRAINER_FIELDS, LauncherSettings

# The schedules of the API document (early_recompute_1f1b is Merak-Zeus' name for pre_recompute_1f1b).
SCHEDULE_ALIASES = {"early_recompute_1f1b": "pre_recompute_1f1b"}
# Hugging Face optimizer names and the merak optimizer that implements them.
OPTIMIZER_ALIASES = {
    "adamw_torch": "adamw_torch",
    "adamw_torch_fused": "adamw_torch",
    "adamw_hf": "adamw_torch",
    "sgd": "sgd",
    "adafactor": "adafactor",
}


def _doc(text: str, **kwargs):
    return field(metadata={"help": text}, **kwargs)


# The run settings' defaults: a MerakArguments field that means what a trainer or launcher setting
# means takes its default from there (the sections in merak/*/settings.py), not a copy of it.
_RUN_DEFAULTS = {**TRAINER_FIELDS, **{field.name: field for field in dataclasses.fields(LauncherSettings)}}


# Trainer settings MerakTrainer decides itself: no argument sets them.
_NOT_ARGUMENTS = frozenset({"global_batch_size", "eval_holdout", "warmup_ratio"})


def _every_trainer_setting(cls):
    """``cls`` with a field for each trainer setting it does not declare itself, with the setting's type,
    default and help (merak.config.TRAINER_FIELDS): a new setting is a MerakArguments field at once.
    Applied before ``@dataclass``, which then makes the fields."""
    from merak.config import SECTION_OF, TRAINER_SECTIONS

    declared = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    for name, setting in TRAINER_FIELDS.items():
        if name in declared or name in _NOT_ARGUMENTS:
            continue
        cls.__annotations__[name] = typing.get_type_hints(TRAINER_SECTIONS[SECTION_OF[name]])[name]
        setattr(cls, name, _merak(name, setting.metadata.get("help", "")))
    return cls


def _merak(name: str, text: str):
    """A field with the default of the run setting ``name``."""
    setting = _RUN_DEFAULTS[name]
    if setting.default is dataclasses.MISSING:
        return field(default_factory=setting.default_factory, metadata={"help": text})
    return field(default=setting.default, metadata={"help": text})


@dataclass
@_every_trainer_setting
class MerakArguments(TrainingArguments):
    """Training arguments: every ``transformers.TrainingArguments`` field, plus Merak's.

    The Merak fields keep the names, defaults and meanings of the original API; see
    docs/trainer_api.md for the table of what each one does here.
    """

    train_schedule: str = _merak(
        "train_schedule",
        "Pipeline schedule: 1f1b, pre_recompute_1f1b, ds_default, last_no_recompute_1f1b, "
        "shifted_critical_path (also gpipe, interleaved_1f1b, zb_h1).",
    )
    partition_method: str = _merak(
        "partition_method",
        "Stage partition: autopipe (balanced estimated costs), uniform, uniform_floor, parameters, custom.",
    )
    split_method: str = _merak(
        "split_method",
        "Graph sharding: min_bytes (cut where the fewest bytes cross), farthest_min_deps, "
        "layer_split, nearest_min_deps.",
    )
    custom_split_points: list[str] | None = _merak(
        "custom_split_points", "Split points (module names or globs) for layer_split."
    )
    trace_method: str | None = _merak(
        "trace_method", "fx (torch.fx, falling back to torch.export), dynamo (torch.export), or None (no tracing)."
    )
    trace_model: str = _doc(
        "A model class name to register for tracing: merak captures any class, so it is "
        "only checked to name the model's class.",
        default="",
    )
    init_method_std: float = _doc(
        "Std of the init of tensor-parallel weights in the original. Not used: merak's "
        "tensor-parallel shards are slices of the model's own initialized weights "
        "(one process's numbers); another value is named in the trainer's warning.",
        default=0.02,
    )
    activation_checkpointing: bool | str = _merak(
        "activation_checkpointing",
        "Recompute activations in the backward (merak's recomputation, per "
        "pipeline part; gradient_checkpointing is its alias); 'selective' keeps what "
        "selective_recompute names inside the checkpointed parts.",
    )
    checkpoint_num_layers: int = _merak("checkpoint_num_layers", "Parts (layers) per checkpointed chunk.")
    input_names: list[str] | None = _merak(
        "input_names", "Forward arguments fed from the data (default: the dataset fields the model's forward accepts)."
    )
    num_layers: int | None = _doc(
        "Layers of the model; sets shard_count's default to 2 x num_layers (without it merak chooses the shard count).",
        default=None,
    )
    seq_length: int | None = _doc("Sequence length; checked against the training samples.", default=None)
    num_heads: int | None = _doc("Attention heads; checked against the model config.", default=None)
    wall_clock_breakdown: bool = _merak(
        "wall_clock_breakdown", "Record every instruction's time; write timeline.png/json."
    )
    measure_activation_memory: bool = _merak(
        "measure_activation_memory",
        "Count every tensor saved for backward to report the exact peak of "
        "saved activations per stage (costs host time).",
    )
    shard_count: int | None = _merak("shard_count", "Number of graph shards (default 2 x num_layers).")
    prescale_gradients: bool = _merak("prescale_gradients", "Divide gradients by dp before the all-reduce.")
    gradient_predivide_factor: float = _merak(
        "gradient_predivide_factor", "Divide by this before the reduction and by dp/this after."
    )
    zero_optimization: bool = _merak("zero_optimization", "Shard optimizer state (and gradients at stage 2) over dp.")
    zero_allow_untested_optimizer: bool = _merak(
        "zero_allow_untested_optimizer", "Allow ZeRO with a non-elementwise optimizer."
    )
    zero_stage: int = _merak("zero_stage", "ZeRO stage: 1, 2 or 3.")
    zero_allgather_bucket_size: float = _merak("zero_allgather_bucket_size", "Elements per all-gather after the step.")
    zero_reduce_bucket_size: float = _merak("zero_reduce_bucket_size", "Elements per gradient reduce-scatter.")
    save: bool | None = _doc(
        "Write checkpoints: True (every save_steps, or as save_strategy says, and at the "
        "end), False (none), None (as save_strategy says, Hugging Face's way).",
        default=None,
    )
    finetune: bool = _merak("finetune", "Load weights only from the checkpoint; step, optimizer and RNG start fresh.")
    no_save_rng: bool = _merak("no_save_rng", "Do not save RNG states.")
    no_save_optim: bool = _merak("no_save_optim", "Do not save the optimizer.")
    no_load_rng: bool = _merak("no_load_rng", "Do not load RNG states.")
    no_load_optim: bool = _merak("no_load_optim", "Do not load the optimizer.")
    split_inputs: bool = _doc(
        "Split input data between tensor-parallel ranks (not supported: every stage "
        "receives exactly the fields it needs).",
        default=False,
    )
    parallel_vocab: bool = _merak("parallel_vocab", "Split embeddings and the output layer by vocabulary when tp > 1.")
    sequence_parallel: bool = _merak(
        "sequence_parallel", "Split activations along the sequence between blocks when tp > 1."
    )
    sequence_dim: int = _merak("sequence_dim", "Sequence dimension of hidden states.")
    dealloc_pipeoutput: bool = _merak("dealloc_pipeoutput", "Release sent activations.")
    activation_checkpoint_ratio: float | None = _merak(
        "activation_checkpoint_ratio", "Checkpointed fraction of the first stage (others stage-aware), in [0, 1]."
    )
    tp_overlapping_level: int = _merak(
        "tp_overlapping_level", "0 none, 1 overlap within linear pairs, 2 sub-pipelined blocks (3 is not supported)."
    )
    loss_scale: float = _merak("loss_scale", "fp16: 0 = dynamic, else this static scale.")
    initial_scale_power: int = _merak("initial_scale_power", "fp16 dynamic scale starts at 2**this.")
    loss_scale_window: int = _merak("loss_scale_window", "Clean steps before the dynamic scale doubles.")
    hysteresis: int = _merak("hysteresis", "Overflows tolerated before the dynamic scale halves.")
    min_loss_scale: int = _merak("min_loss_scale", "Smallest dynamic loss scale.")
    custom_partition: list[int] | None = _merak("custom_partition", "pp+1 shard boundaries, e.g. [0, 6, 12].")
    no_tie_modules: bool = _doc(
        "Do not tie shared weights across stages (not supported: tied weights are always kept identical).",
        default=False,
    )
    save_total_limit: int | None = _merak("save_total_limit", "Keep the newest n checkpoints (-1: all).")
    eval_iters: int | None = _merak("eval_iters", "Evaluation steps per evaluation (None: the whole evaluation set).")
    text_generation: bool = _doc("Generate text from the prompts of the evaluation set after training.", default=False)
    out_seq_length: int | None = _doc("Length of generated sequences, prompt included.", default=1024)
    temperature: float = _doc("Sampling temperature (0: greedy).", default=0.9)
    top_k: int = _doc("Sample among the k most likely tokens (0: all).", default=0)
    top_p: float = _doc("Sample among the most likely tokens whose probabilities add up to p (1: all).", default=1.0)
    lora_config: str | None = _doc(
        "LoRA: a JSON file of peft.LoraConfig fields, or a directory saved by save_adapter (config and weights).",
        default=None,
    )
    adapter_name: str = _doc("Name of the injected adapter.", default="default")
    logging_steps: float = _merak(
        "logging_steps", "Log (and write metrics.jsonl) every n steps; below 1: a fraction of the run."
    )
    # merak extensions
    pipeline_chunks: int | None = _merak("pipeline_chunks", "Model chunks per pipeline rank (interleaved_1f1b).")
    init_device: str = _merak("init_device", "auto, cpu or meta (used with model_init).")
    autopipe_costs: str = _merak(
        "autopipe_costs",
        "autopipe's shard cost: estimate (FLOPs, bytes and operations on the device "
        "kind's nominal rates), calibrated (on rates measured by a short timed run), "
        "flops or time.",
    )
    leaf_modules: list[str] | None = _merak("leaf_modules", "Class or module names kept whole when tracing.")
    pretrained_weights: str | None = _merak(
        "pretrained_weights", "A Hugging Face model directory (safetensors) to start from."
    )
    peak_tflops: float | None = _merak("peak_tflops", "Per-device peak TFLOP/s for MFU (default: known GPUs).")
    backend: str = _merak("backend", "torch.distributed backend: auto (gloo on CPU, nccl with CUDA), gloo or nccl.")
    timeout_s: float = _merak("timeout_s", "A collective waiting longer fails instead of hanging.")
    cuda_graphs: bool = _merak("cuda_graphs", "Replay compiled stages as CUDA graphs (needs torch_compile and CUDA).")
    # energy (Merak-Zeus's names; docs/energy.md)
    profile: bool = _merak(
        "profile",
        "Profile every pipeline instruction's time and energy at each GPU clock instead of "
        "training (train() or profile()); writes the profile the energy planner reads.",
    )
    num_warmup_steps: int = _merak("num_warmup_steps", "Profiling: steps run at each clock before measuring.")
    num_prof_steps: int = _merak("num_prof_steps", "Profiling: steps measured at each clock.")
    pfo_server_url: str | None = _merak(
        "pfo_server_url", "A Perseus/zeus server that chooses each instruction's clock while training."
    )
    energy_device: str = _merak("energy_device", "auto (NVML on CUDA machines where it answers; else energy "
                                "features on a simulated GPU, plain training unmeasured), nvml, simulated or none.")
    simulated_gpu: str = _merak("simulated_gpu", "The simulated GPU's model (energy features without a GPU).")
    simulated_tflops: float = _merak("simulated_tflops", "The simulated GPU's speed, TFLOP/s.")
    frequency_plan: str | None = _merak(
        "frequency_plan", "A frequency plan (merak-energy plan output): each instruction runs at its planned clock."
    )
    frequency_frontier: str | None = _merak(
        "frequency_frontier", "A frontier (merak-energy plan's frontier.json): run its fastest plan, and slow the "
        "data-parallel pipelines that would wait for a straggler."
    )
    frontier_deadline: float | None = _merak("frontier_deadline", "Start at the frontier's least-energy plan "
                                             "predicted within this step time (seconds).")
    straggler_window: int = _merak("straggler_window", "Steps measured between straggler decisions (0: never).")
    straggler_hysteresis: float = _merak("straggler_hysteresis", "Relative move of the straggler's time that "
                                         "triggers new plans.")
    straggler_margin: float = _merak("straggler_margin", "How far below the straggler's time a slowed pipeline aims.")
    simulated_straggler_pipeline: int | None = _merak("simulated_straggler_pipeline", "Testing: the data-parallel "
                                                      "rank whose simulated GPUs are capped.")
    simulated_straggler_clock: int | None = _merak("simulated_straggler_clock", "Testing: their clock cap (MHz).")
    max_consecutive_skipped_steps: int = _merak(
        "max_consecutive_skipped_steps",
        "Steps in a row whose loss or gradient norm is not finite (each skipped on every rank) before training "
        "stops with an error; fp16 overflows a smaller loss scale may cure do not count.",
    )

    @cached_property
    def _setup_devices(self) -> torch.device:
        # merak owns the process group (merak.init, with its backend and timeout): unlike
        # TrainingArguments, building the arguments must not start accelerate's, which under torchrun
        # variables waits for a rendezvous.
        self.distributed_state = None
        self._n_gpu = 1 if torch.cuda.is_available() and not self.use_cpu else 0
        if self._n_gpu:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    def __post_init__(self):
        if self.output_dir is None:
            self.output_dir = "merak-output"
        super().__post_init__()

    def problems(self) -> list[str]:
        """What cannot work in these arguments (empty when fine); merak's own checks come on top."""
        problems = []
        if self.split_inputs:
            problems.append(
                "split_inputs=True is not supported: each pipeline stage already receives only the "
                "microbatch fields it needs; leave it False"
            )
        if self.no_tie_modules:
            problems.append(
                "no_tie_modules=True is not supported: weights a model shares (e.g. GPT-2's "
                "embedding and output layer) are kept identical across stages; leave it False"
            )
        if self.tp_overlapping_level == 3:
            problems.append("tp_overlapping_level=3 (rewriting the whole model) is not supported; use 0, 1 or 2")
        if _enum_value(self.optim) not in OPTIMIZER_ALIASES:
            problems.append(
                f"optim={_enum_value(self.optim)!r}: merak implements {', '.join(sorted(OPTIMIZER_ALIASES))}"
            )
        if self.eval_iters is not None and self.eval_iters < 1:
            problems.append(f"eval_iters={self.eval_iters}: use a positive number or None (the whole set)")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature}: use 0 (greedy) or a positive number")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p}: use a value in (0, 1]")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k}: use 0 (off) or a positive number")
        if self.lora_config and not os.path.exists(self.lora_config):
            problems.append(f"lora_config={self.lora_config}: no such file or directory")
        if self.logging_steps <= 0:
            problems.append(f"logging_steps={self.logging_steps}: use a positive number")
        if self.custom_partition is not None and self.partition_method != "custom":
            problems.append(
                f"custom_partition={self.custom_partition} is only read with partition_method='custom' "
                f"(it is {self.partition_method!r}): set partition_method='custom' or drop it"
            )
        if self.num_layers is not None and self.num_layers < 1:
            problems.append(f"num_layers={self.num_layers}: use a positive number")
        return problems

    def model_problems(self, model, sample: dict | None) -> list[str]:
        """The seed's model-size fields checked against the model and a training sample: merak reads the
        sizes from the model itself, so a value that disagrees is a mistake worth stopping for."""
        problems = []
        config = getattr(model, "config", None)
        heads = next(
            (
                getattr(config, name)
                for name in ("num_attention_heads", "n_head", "num_heads")
                if config is not None and isinstance(getattr(config, name, None), int)
            ),
            None,
        )
        if self.num_heads is not None and heads is not None and self.num_heads != heads:
            problems.append(f"num_heads={self.num_heads} but the model has {heads} attention heads")
        ids = (sample or {}).get("input_ids")
        if self.seq_length is not None and ids is not None and ids.shape[-1] != self.seq_length:
            problems.append(f"seq_length={self.seq_length} but the training samples hold {ids.shape[-1]} tokens")
        if self.trace_model and model is not None:
            names = {cls.__name__ for cls in type(model).__mro__}
            if self.trace_model not in names:
                problems.append(
                    f"trace_model={self.trace_model!r} but the model is a {type(model).__name__} "
                    f"(merak captures any class: leave trace_model empty)"
                )
        return problems


def _enum_value(value) -> str:
    """The string of a Hugging Face enum field (optim, lr_scheduler_type) or of a plain string."""
    return getattr(value, "value", value)


def trainer_settings(args: MerakArguments, *, total_steps_hint: int | None = None, cadence=None) -> dict:
    """The ``trainer`` group of a run config from MerakArguments (its flat names, merak.config.SECTION_OF);
    with the resolved ``cadence`` (merak.hf.cadence), checkpoints are written as it says."""
    known = set(TRAINER_FIELDS)
    values = {name: getattr(args, name) for name in known if hasattr(args, name)}
    values["train_schedule"] = SCHEDULE_ALIASES.get(args.train_schedule, args.train_schedule)
    values["lr_scheduler_type"] = _enum_value(args.lr_scheduler_type)
    values["optim"] = OPTIMIZER_ALIASES.get(_enum_value(args.optim), _enum_value(args.optim))
    values["output_dir"] = os.path.abspath(args.output_dir)
    if 0 < args.warmup_steps < 1:  # Hugging Face's way of giving a ratio of the run
        values["warmup_ratio"], values["warmup_steps"] = float(args.warmup_steps), 0
    else:
        values["warmup_steps"] = int(args.warmup_steps)
    values["save_steps"] = _steps(args.save_steps, total_steps_hint)
    values["logging_steps"] = _steps(args.logging_steps, total_steps_hint)
    values["disable_tqdm"] = bool(args.disable_tqdm)
    # MerakTrainer evaluates its eval_data and reports through transformers' callbacks itself.
    values.update(eval_steps=None, eval_iters=None, report_to="none", run_name=None)
    if args.shard_count is None and args.num_layers:  # the original's default: two shards per layer
        values["shard_count"] = 2 * args.num_layers
    values["save"] = bool(args.save)
    if cadence is not None:
        values["save"] = cadence.save_every is not None
        values["save_steps"] = cadence.save_every or values["save_steps"]
    values["no_save_optim"] = bool(args.no_save_optim or args.save_only_model)
    values["no_save_rng"] = bool(args.no_save_rng or args.save_only_model)
    values["global_batch_size"] = None
    for name in ("zero_reduce_bucket_size", "zero_allgather_bucket_size"):
        values[name] = int(values[name]) if float(values[name]).is_integer() else values[name]
    values["min_loss_scale"] = float(args.min_loss_scale)
    resume = args.resume_from_checkpoint
    values["resume_from_checkpoint"] = (
        {"true": True, "false": None}.get(str(resume).lower(), resume) if resume is not None else None
    )
    return json.loads(json.dumps(values, default=str))


def _steps(value: float, total: int | None) -> int:
    """Hugging Face's step counts: a value below 1 is a fraction of the run's steps."""
    if value < 1 and total:
        return max(1, round(value * total))
    return max(1, int(value))
