"""Shared Hydra config groups (parallel/, trainer/, launcher/, hydra/launcher/), found through
pkg://merak.conf.

Hydra imports this package when it reads the search path, before it composes anything, so the
typed schemas that trainer/ and launcher/ extend (merak.conf.schemas) and the resolvers the shared
configs use are registered here:

``${merak_tasks_per_node:DP,TP,PP,NODES}``
    dp*tp*pp / nodes, the SLURM tasks per node of a layout (hydra/launcher/merak_slurm.yaml).
"""

from omegaconf import OmegaConf

from merak.conf.schemas import register_schemas


def tasks_per_node(dp: int, tp: int, pp: int, nodes: int) -> int:
    """One SLURM task per rank, spread evenly over ``nodes``."""
    world = int(dp) * int(tp) * int(pp)
    if int(nodes) < 1 or world % int(nodes):
        raise ValueError(f"parallel.dp*tp*pp = {dp}*{tp}*{pp} = {world} ranks cannot be spread evenly over "
                         f"hydra.launcher.nodes={nodes}; change the nodes or set hydra.launcher.tasks_per_node")
    return world // int(nodes)


OmegaConf.register_new_resolver("merak_tasks_per_node", tasks_per_node, replace=True)

# The trainer and launcher groups extend these typed schemas (merak.conf.schemas).
register_schemas()
