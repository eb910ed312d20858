"""The ``merak`` command (also ``python -m merak``): one command, a verb per tool.

    merak plan RECIPE [overrides] [--cluster ...]   rank every parallel layout (merak.autoplan.cli)
    merak simulate --schedule 1f1b --stages 4 ...    a schedule's timeline without a model (merak.pipeline.cli)
    merak export CHECKPOINT OUT_DIR                 a checkpoint as a Hugging Face directory (merak.checkpoint.export)
    merak energy plan|serve ...                     per-instruction GPU clock plans (merak.energy.cli)
    merak new-recipe NAME [--from gpt]              copy a recipe as a new one (merak.scaffold)
    merak sweep-summary SWEEP_DIR                   the table of a finished multirun (merak.report.sweep)
    merak settings [SECTION ...]                    every trainer/launcher setting: type, default, meaning

The older names (``merak-plan``, ``merak-simulate``, ``merak-export``, ``merak-energy``) run the same
code. A verb's module is imported only when that verb runs, so ``merak --help`` is instant.
"""

from __future__ import annotations

import importlib
import sys

# verb -> (module with main(argv, prog=...), one line of help)
VERBS: dict[str, tuple[str, str]] = {
    "plan": ("merak.autoplan.cli", "rank every parallel layout of a recipe on a cluster"),
    "simulate": ("merak.pipeline.cli", "check a pipeline schedule and show its timeline"),
    "export": ("merak.checkpoint.export", "write a checkpoint as a Hugging Face model directory"),
    "energy": ("merak.energy.cli", "plan per-instruction GPU clocks from a profile, or serve a plan"),
    "new-recipe": ("merak.scaffold", "copy a recipe directory as a new recipe"),
    "sweep-summary": ("merak.report.sweep", "(re)write the summary table of a finished sweep"),
    "settings": ("merak.config.docs", "print every setting of the config sections: type, default, meaning"),
}


def usage() -> str:
    """The command's help: its verbs, one line each."""
    width = max(len(verb) for verb in VERBS)
    lines = ["usage: merak VERB [arguments]  (merak VERB --help for a verb's own options)", "", "verbs:"]
    lines += [f"  {verb.ljust(width)}  {summary}" for verb, (_, summary) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the ``merak`` command with ``argv`` (default: the process's arguments); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"{usage()}\n\nmerak: unknown verb {verb!r}; choose one of {', '.join(VERBS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    return module.main(rest, prog=f"merak {verb}") or 0
