"""What a trained MerakTrainer produces besides metrics: the saved model or adapter, generated text,
and the energy profile. A mixin of :class:`merak.hf.trainer.MerakTrainer` (it uses the trainer's
arguments, session and process state)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import torch

from merak.distributed import groups
from merak.hf.samples import Samples

logger = logging.getLogger(__name__)


class TrainerOutputs:
    """Saving, generating and profiling for MerakTrainer."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the whole trained model to ``output_dir`` (default ``args.output_dir``); collective.

        Every rank's stage (and tensor-parallel slice) is gathered on the main process, which writes a
        directory ``from_pretrained`` loads (config.json + model.safetensors; model.safetensors alone for a
        model that is not a Hugging Face model), the ``processing_class`` (tokenizer) and
        ``training_args.bin``. With LoRA, the adapter alone, as peft saves it.
        """
        directory = os.path.abspath(output_dir or self.args.output_dir)
        if self.args.lora_config:
            self.save_adapter(directory)
            return
        from merak.checkpoint.pretrained import save_pretrained_model

        session = self._session()
        save_pretrained_model(session.engine, directory)
        if self.is_world_process_zero():
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(directory)
            torch.save(self.args, os.path.join(directory, "training_args.bin"))
            logger.info("saved the model to %s", directory)
        groups.barrier()

    def profile(self) -> dict | None:
        """Profile every pipeline instruction's time and energy at each GPU clock (``profile=True``; a
        simulated GPU without one) instead of training; writes the profile ``merak-energy plan`` reads.
        Returns the profile summary on rank 0 (None elsewhere). Collective."""
        if not self.args.profile:
            raise ValueError("profile() needs MerakArguments(profile=True)")
        from merak.energy.profile import run_profile

        session = self._session()
        os.makedirs(self.settings.output_dir, exist_ok=True)
        try:
            self.summary = run_profile(session, self.energy)
        finally:
            self.energy.close()
        return self.summary

    def _generate_from_eval_prompts(self, count: int = 4) -> None:
        """``text_generation``: continue the first evaluation samples' ``input_ids`` up to ``out_seq_length``
        tokens; rank 0 logs them and writes ``generated.jsonl`` in the output directory."""
        samples = Samples(self.eval_data)
        prompts = [samples[i]["input_ids"].tolist() for i in range(min(count, len(samples)))]
        generated = self.generate(prompts)
        if self.is_world_process_zero():
            path = os.path.join(self.settings.output_dir, "generated.jsonl")
            with open(path, "w", encoding="utf-8") as handle:
                for prompt, tokens in zip(prompts, generated):
                    handle.write(json.dumps({"prompt": prompt, "generated": tokens[len(prompt):]}) + "\n")
            decode = getattr(self.processing_class, "decode", None)
            for tokens in generated[:1]:
                logger.info("generated: %s", decode(tokens) if decode else tokens)
            logger.info("wrote %d generated sequences to %s", len(generated), path)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_length: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None) -> list[list[int]]:
        """Continue each prompt (token ids) through the pipeline with a KV cache on every stage.

        Defaults come from the arguments: ``out_seq_length`` (total length, prompt included),
        ``temperature`` (0: greedy), ``top_k``, ``top_p`` and ``seed``. Every rank returns all
        sequences; prompts are spread over the dp replicas.
        """
        import merak.hf.decoders  # noqa: F401  (registers the Hugging Face decoder families)
        from merak.generation import GenerationOptions, generate

        args = self.args
        options = GenerationOptions(
            max_length=max_length or args.out_seq_length,
            temperature=args.temperature if temperature is None else temperature,
            top_k=args.top_k if top_k is None else top_k, top_p=args.top_p if top_p is None else top_p,
            seed=args.seed if seed is None else seed)
        return generate(self._session(), prompts, options)

    def save_adapter(self, directory: str) -> None:
        """Write the LoRA adapter alone (peft's ``save_pretrained`` layout); collective."""
        from merak.hf.lora import save_adapter

        save_adapter(self, directory)


__all__ = ["TrainerOutputs"]
