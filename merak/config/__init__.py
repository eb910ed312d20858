"""Configuration: the Hydra config of a run checked and turned into typed settings before any worker starts.

- :mod:`merak.config.resolve`: ``resolve_settings`` composes the ``trainer`` sections (each a dataclass
  beside the code that consumes it, ``merak/*/settings.py``) and checks what spans them;
- :mod:`merak.config.overrides`: ``hydra_main`` for a recipe's train.py, command-line overrides checked
  before Hydra composes;
- :mod:`merak.config.options`: run settings turned into the engine's, planner's and optimizer's options;
- :mod:`merak.config.docs`: docs/config/ written from the sections.
"""

from merak.config.resolve import (
    TRAINER_SECTIONS,
    ConfigError,
    LauncherSettings,
    RunSettings,
    TrainerSettings,
    resolve_settings,
    total_steps,
)

__all__ = ["TRAINER_SECTIONS", "ConfigError", "LauncherSettings", "RunSettings", "TrainerSettings",
           "resolve_settings", "total_steps"]
