"""The automatic pipeline-splitting section of the ``trainer`` config: capture the unmodified model,
cut it into shards, group shards into stages. Received by merak.shard.plan.plan_pipeline and
merak.session.assemble."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import positive_int_problem, setting

# Where a worker builds the model before its own stage is materialized (merak.session.assemble).
INIT_DEVICES = ("auto", "cpu", "meta")
PARTITION_METHODS = ("autopipe", "uniform", "uniform_floor", "parameters", "custom")
AUTOPIPE_COSTS = ("estimate", "calibrated", "flops", "time")


@dataclass(frozen=True)
class ShardingSettings:
    """How the model is captured, cut and partitioned into pipeline stages."""

    trace_method: str | None = setting("fx", "fx (torch.fx, else torch.export) | dynamo (torch.export) | "
                                             "null (no tracing: the recipe supplies stages)")
    split_method: str = setting("min_bytes", "min_bytes (cut where the fewest bytes cross) | farthest_min_deps | "
                                             "nearest_min_deps | layer_split")
    shard_count: int | None = setting(None, "farthest/nearest_min_deps: shards to cut (null: 2 x the model's "
                                            "layer count)")
    custom_split_points: list[str] | None = setting(
        None, "layer_split cut points: module names or globs, e.g. ['transformer.h.*']")
    partition_method: str = setting("autopipe", "autopipe (balance estimated costs, 1F1B-scored) | uniform | "
                                                "uniform_floor | parameters | custom")
    custom_partition: list[int] | None = setting(None, "partition_method=custom: pp+1 shard boundaries, "
                                                       "e.g. [0, 7, 14]")
    leaf_modules: list[str] | None = setting(None, "class names or module names kept whole when tracing")
    init_device: str = setting("auto", "auto (meta above 1B parameters) | cpu | meta (materialize own stage "
                                       "only)")
    autopipe_costs: str = setting("estimate", "autopipe's per-shard cost: estimate (FLOPs, bytes, operations "
                                              "on nominal rates) | calibrated (measured rates) | flops | time")

    def problems(self, *, pp: int | None, has_split_points: bool, builds_own_stages: bool) -> list[str]:
        """What is wrong with these values for ``pp`` stages (None: the layout is invalid), given
        whether the recipe has default split points and hand-made stages."""
        from merak.core.partition import custom_boundary_problem
        from merak.shard.split import SPLIT_METHODS
        from merak.trace.capture import TRACE_METHODS

        problems = []
        if self.trace_method is None:
            if pp and pp > 1 and not builds_own_stages:
                problems.append(f"trainer.trace_method=null with parallel.pp={pp}: without tracing the "
                                f"recipe must supply stages (RecipeSpec.build_stages); use trace_method=fx")
        elif self.trace_method not in TRACE_METHODS:
            problems.append(f"trainer.trace_method={self.trace_method!r}; choose fx, dynamo or null")
        if self.split_method not in SPLIT_METHODS:
            problems.append(f"trainer.split_method={self.split_method!r}; choose one of {', '.join(SPLIT_METHODS)}")
        elif self.split_method == "layer_split" and not (self.custom_split_points or has_split_points):
            problems.append("trainer.split_method=layer_split needs trainer.custom_split_points (module names or "
                            "globs such as 'transformer.h.*'); this recipe has no default split points")
        if self.shard_count is not None:
            positive_int_problem("trainer.shard_count", self.shard_count, problems)
        if self.partition_method not in PARTITION_METHODS:
            problems.append(f"trainer.partition_method={self.partition_method!r}; choose one of "
                            f"{', '.join(PARTITION_METHODS)}")
        elif self.partition_method == "custom":
            if not self.custom_partition:
                problems.append("trainer.partition_method=custom needs trainer.custom_partition: pp+1 shard "
                                "boundaries such as [0, 6, 12]")
            elif pp:
                problem = custom_boundary_problem(self.custom_partition, pp)
                if problem:
                    problems.append(f"trainer.{problem}")
        if self.autopipe_costs not in AUTOPIPE_COSTS:
            problems.append(f"trainer.autopipe_costs={self.autopipe_costs!r}; choose one of "
                            f"{', '.join(AUTOPIPE_COSTS)}")
        if self.init_device not in INIT_DEVICES:
            problems.append(f"trainer.init_device={self.init_device!r}; choose one of {', '.join(INIT_DEVICES)}")
        return problems
