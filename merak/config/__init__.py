"""Configuration: the Hydra config of a run checked and turned into typed settings before any worker starts.

Where settings live (the rule):

- A ``trainer.*`` setting is declared once, as a field of one section dataclass beside the code that
  consumes it (``merak/<package>/settings.py``, built with :func:`merak.core.fields.setting`: type,
  default, help, range). Its section also holds its checks (``problems()``) and the values derived from
  it (properties such as ``ZeroSettings.stage``).
- The consumer receives the section object itself (``PipelineEngine(optimizer=trainer.optimizer, ...)``,
  ``save_checkpoint(..., options=trainer.checkpoint)``): no options type copies a section's fields.
- Users keep writing flat names (``trainer.learning_rate``; MerakArguments' and Hugging Face's names):
  :data:`SECTION_OF` maps each to its section, and the Hydra schema, the config docs and MerakArguments'
  defaults are made from the sections. So a new setting touches its section, the code that uses it and
  its test, nothing else.
- A new ``trainer.*`` field is allowed when it changes how merak trains, checkpoints, measures or
  reports any model (its name taken from Hugging Face's TrainingArguments or DeepSpeed where either has
  one; a flat name is never reused by another section). What concerns one model or one dataset belongs
  in that recipe's ``model``/``data`` group and its schema instead; what concerns how processes start,
  in ``launcher``.

Modules:

- :mod:`merak.config.resolve`: ``TrainerSettings`` (the sections), ``SECTION_OF``, and
  ``resolve_settings``, which checks every section and what spans them;
- :mod:`merak.config.overrides`: ``hydra_main`` for a recipe's train.py, command-line overrides checked
  before Hydra composes;
- :mod:`merak.config.docs`: ``merak settings``, the reference of every setting printed from the sections.
"""

from merak.config.resolve import (
    SECTION_OF,
    TRAINER_FIELDS,
    TRAINER_SECTIONS,
    ConfigError,
    LauncherSettings,
    RunSettings,
    TrainerSettings,
    resolve_settings,
    total_steps,
)

__all__ = ["SECTION_OF", "TRAINER_FIELDS", "TRAINER_SECTIONS", "ConfigError", "LauncherSettings", "RunSettings",
           "TrainerSettings", "resolve_settings", "total_steps"]
