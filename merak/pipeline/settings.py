"""The schedule, recomputation and compiled-stage sections of the ``trainer`` config. The engine
receives them: the schedule section for recomputation, the compile section for its stages."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import positive, setting

SELECTIVE = "selective"
# What selective recomputation saves inside checkpointed parts (merak.pipeline.selective).
SELECTIVE_MODES = ("matmuls", "attention")
# Selective recomputation decides per aten operator; a compiled part reaches it as one opaque graph.
SELECTIVE_WITH_COMPILE = ("trainer.activation_checkpointing=selective saves outputs operator by operator, but "
                          "trainer.torch_compile runs each part as one compiled graph, which would be recomputed "
                          "whole: compile without it (activation_checkpointing=true) or run eagerly")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _checkpointing_choice(value) -> bool:
    return value is True or value is False or value == SELECTIVE


def _selective_mode(value) -> bool:
    return value in SELECTIVE_MODES


@dataclass(frozen=True)
class ScheduleSettings:
    """The pipeline schedule, activation recomputation and what the executor records."""

    train_schedule: str = setting("1f1b", "1f1b | ds_default | gpipe | pre_recompute_1f1b | "
                                          "last_no_recompute_1f1b | shifted_critical_path | interleaved_1f1b | "
                                          "zb_h1 (docs/schedules.md)")
    pipeline_chunks: int | None = setting(None, "interleaved_1f1b: model chunks per pipeline rank (null: 2)")
    activation_checkpointing: bool | str = setting(
        True, "true: checkpointed parts keep only their inputs and the backward recomputes them; selective: "
              "they also keep what selective_recompute names; false: no recomputation",
        check=_checkpointing_choice, requirement="must be true, false or selective")
    selective_recompute: str = setting(
        "matmuls", "with activation_checkpointing=selective, what checkpointed parts save: matmuls (outputs of "
                   "matrix products and fused attention) | attention (all but the attention core)",
        check=_selective_mode, requirement=f"must be {' or '.join(SELECTIVE_MODES)}")
    checkpoint_num_layers: int = setting(1, "parts (shards) per checkpointed chunk", check=positive,
                                         requirement="must be a positive integer")
    activation_checkpoint_ratio: float | list[float] | None = setting(
        None, "null: every part; 0.5: the first stage's ratio, the others stage-aware; or one per stage")
    dealloc_pipeoutput: bool = setting(False, "release sent activations (backward keeps what it reads)")
    wall_clock_breakdown: bool = setting(False, "record every instruction; write timeline.png, timeline.json, "
                                                "timeline_vs_simulated.png")
    measure_activation_memory: bool = setting(False, "count every tensor saved for backward (exact peak per "
                                                      "stage; costs host time)")

    @property
    def selective_mode(self) -> str | None:
        """What checkpointed parts save with selective recomputation (None: full or no recomputation)."""
        return self.selective_recompute if self.activation_checkpointing == SELECTIVE else None

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: the setting, else 2 for interleaved schedules and 1 otherwise."""
        from merak.pipeline.schedules import DEFAULT_CHUNKS, schedule_info

        if self.pipeline_chunks is not None:
            return self.pipeline_chunks
        return DEFAULT_CHUNKS if schedule_info(self.train_schedule).chunked else 1

    def problems(self, *, pp: int | None, num_microbatches: int) -> list[str]:
        """What is wrong with the schedule for ``pp`` stages (None: the layout is invalid) and
        ``num_microbatches``; the schedule of every stage is built and simulated."""
        from merak.pipeline.recompute import stage_checkpoint_ratios
        from merak.pipeline.schedules import build_schedule, schedule_info, schedule_names
        from merak.pipeline.simulate import ScheduleError, simulate

        if self.train_schedule not in schedule_names():
            return [f"trainer.train_schedule={self.train_schedule!r} is unknown; choose one of "
                    f"{', '.join(schedule_names())}"]
        problems = []
        info = schedule_info(self.train_schedule)
        name = f"trainer.train_schedule={self.train_schedule}"
        chunks = self.pipeline_chunks
        if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
            return [f"trainer.pipeline_chunks={chunks!r} must be a positive integer"]
        if chunks is not None and chunks > 1 and not info.chunked:
            problems.append(f"trainer.pipeline_chunks={chunks} needs an interleaved schedule "
                            f"(train_schedule=interleaved_1f1b)")
        if info.needs_checkpoint_ratio and not (self.activation_checkpointing
                                                and self.activation_checkpoint_ratio is not None):
            problems.append(f"{name} moves recomputation off the critical path: it needs "
                            f"trainer.activation_checkpointing=true and trainer.activation_checkpoint_ratio (the "
                            f"first stage's ratio, e.g. 0.5)")
        if pp is None or num_microbatches < 1:
            return problems
        if self.activation_checkpoint_ratio is not None:
            try:
                stage_checkpoint_ratios(self.activation_checkpoint_ratio, pp * self.chunks)
            except (TypeError, ValueError) as error:
                problems.append(f"trainer.{error}")
        try:
            lists = [build_schedule(name=self.train_schedule, stage_id=s, num_stages=pp,
                                    num_microbatches=num_microbatches, num_chunks=self.chunks)
                     for s in range(pp)]
            simulate(lists)
        except (ValueError, ScheduleError) as error:
            problems.append(f"{name} with pp={pp} and {num_microbatches} microbatches "
                            f"(gradient_accumulation_steps): {error}")
        return problems


@dataclass(frozen=True)
class CompileSettings:
    """Compiled stages (docs/gpu.md): each stage's parts become torch.compile graphs, forward and backward.
    The first three are Hugging Face's names; as there, naming a backend or a mode turns compiling on."""

    torch_compile: bool = setting(False, "compile every stage")
    torch_compile_backend: str | None = setting(None, "null: inductor; aot_eager compiles without generating "
                                                      "kernels (debugging)")
    torch_compile_mode: str | None = setting(None, "null (default) | reduce-overhead | max-autotune | "
                                                   "max-autotune-no-cudagraphs")
    cuda_graphs: bool = setting(False, "replay compiled stages as CUDA graphs (inductor's CUDA graph trees; "
                                       "CUDA only)")

    @property
    def enabled(self) -> bool:
        """Whether stages are compiled (as in Hugging Face, naming a backend or a mode turns it on)."""
        return bool(self.torch_compile or self.torch_compile_backend or self.torch_compile_mode)

    @property
    def backend(self) -> str:
        """The ``torch.compile`` backend (inductor unless one is named)."""
        return self.torch_compile_backend or "inductor"

    @property
    def effective_mode(self) -> str | None:
        """The mode passed to ``torch.compile``: cuda_graphs asks for reduce-overhead unless the mode
        already implies CUDA graphs."""
        if self.cuda_graphs and self.torch_compile_mode not in CUDA_GRAPH_MODES:
            return "reduce-overhead"
        return self.torch_compile_mode

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether compiled ranges are replayed as CUDA graphs (on a CUDA device)."""
        return self.enabled and self.backend == "inductor" and self.effective_mode in CUDA_GRAPH_MODES

    def contradictions(self) -> list[str]:
        """The values that contradict each other, as messages naming the fields (without ``trainer.``)."""
        mode, backend = self.torch_compile_mode, self.backend
        if mode not in COMPILE_MODES:
            return [f"torch_compile_mode={mode!r} is not one of {', '.join(str(m) for m in COMPILE_MODES[1:])}"]
        problems = []
        if self.cuda_graphs and not self.enabled:
            problems.append("cuda_graphs=true needs torch_compile=true (CUDA graphs replay compiled stages)")
        if self.cuda_graphs and mode == "max-autotune-no-cudagraphs":
            problems.append("cuda_graphs=true contradicts torch_compile_mode=max-autotune-no-cudagraphs")
        if mode is not None and backend != "inductor":
            problems.append(f"torch_compile_mode={mode!r} applies to the inductor backend, not {backend!r}")
        if self.cuda_graphs and backend != "inductor":
            problems.append(f"cuda_graphs=true needs torch_compile_backend=inductor, not {backend!r}")
        return problems

    def problems(self, *, on_cuda: bool) -> list[str]:
        """What is wrong with these values, for a run on CUDA devices or not."""
        problems = [f"trainer.{problem}" for problem in self.contradictions()]
        if problems:
            return problems
        if self.enabled:
            from torch._dynamo import list_backends

            if self.backend not in list_backends(exclude_tags=()):
                problems.append(f"trainer.torch_compile_backend={self.backend!r} is not a torch.compile "
                                f"backend; choose one of {', '.join(list_backends())}")
        if self.uses_cuda_graphs and not on_cuda:
            problems.append("trainer.cuda_graphs=true (or a torch_compile_mode with CUDA graphs) needs CUDA "
                            "devices; this run trains on the CPU")
        return problems
