"""merak: train unmodified PyTorch models with automated 3D parallelism.

Public API::

    import merak
    merak.init(dp=2, tp=1, pp=2)          # or let merak.run launch the workers
    merak.run(spec, cfg)                  # recipes: validate, launch, train, summarize
    merak.run_command(spec, cfg)          # the same in a train.py: one-line errors, exit statuses
    args = merak.MerakArguments(output_dir="out", ...)   # Hugging Face's TrainingArguments + Merak's fields
    merak.MerakTrainer(model=model, args=args, train_data=ds).train()
"""

from merak.compat.torchvision_ops import ensure_torchvision_importable

# Before anything imports torchvision (the Hugging Face libraries and timm do): see compat/.
# The imports below therefore come after this call on purpose (E402 marked on each).
ensure_torchvision_importable()

from merak.distributed import (  # noqa: E402  (after ensure_torchvision_importable, see above)
    RankGrid,
    get_dp_rank,
    get_dp_size,
    get_pp_rank,
    get_pp_size,
    get_rank_grid,
    get_tp_rank,
    get_tp_size,
    init,
)

# Registers the Hugging Face models' default TP plans (merak.core.plan_sources) before any plan is asked for.
from merak.hf import tp_plans as _hf_tp_plans  # noqa: E402, F401  (after the torchvision fix; registers plans)
from merak.tensor_parallel.seed_api import set_tp_layer_lists  # noqa: E402  (after the torchvision fix)

__version__ = "0.1.0"


def hydra_main(*, config_path: str, config_name: str):
    """``hydra.main`` for a recipe's ``train.py``: command-line overrides of ``trainer.*`` and
    ``launcher.*`` are checked first, a problem reported in one line. See :mod:`merak.config.overrides`."""
    from merak.config.overrides import hydra_main as _hydra_main

    return _hydra_main(config_path=config_path, config_name=config_name)


def __getattr__(name: str):
    # The trainer API imports the Hugging Face libraries: load it only when asked for.
    if name in ("MerakArguments", "MerakTrainer"):
        from merak import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'merak' has no attribute {name!r}")


def run(spec, cfg):
    """Validate a recipe config, launch its workers, train, and return the summary.

    See :func:`merak.runner.run`.
    """
    from merak.runner import run as _run

    return _run(spec, cfg)


def run_command(spec, cfg):
    """:func:`run` for a recipe's ``train.py``: errors a user can act on are logged as their message
    alone and end the process with a non-zero status; SIGINT/SIGTERM with 128 + the signal.

    See :func:`merak.runner.run_command`.
    """
    from merak.runner import run_command as _run_command

    return _run_command(spec, cfg)


__all__ = [
    "MerakArguments",
    "MerakTrainer",
    "RankGrid",
    "__version__",
    "get_dp_rank",
    "get_dp_size",
    "get_pp_rank",
    "get_pp_size",
    "get_rank_grid",
    "get_tp_rank",
    "get_tp_size",
    "hydra_main",
    "init",
    "run",
    "run_command",
    "set_tp_layer_lists",
]
