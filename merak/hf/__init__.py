"""The Hugging Face adapter: the seed API for the user's own model and transformers models' TP plans.

``MerakArguments`` and ``MerakTrainer`` import transformers, so they are loaded
when first asked for (``merak.hf.MerakTrainer``). The tensor-parallel plan
modules (:mod:`merak.hf.tp_plans`, which ``import merak`` registers) only read
the models given to them and import no Hugging Face library.
"""


def __getattr__(name: str):
    if name == "MerakArguments":
        from merak.hf.arguments import MerakArguments

        return MerakArguments
    if name == "MerakTrainer":
        from merak.hf.trainer import MerakTrainer

        return MerakTrainer
    raise AttributeError(f"module 'merak.hf' has no attribute {name!r}")


__all__ = ["MerakArguments", "MerakTrainer"]
