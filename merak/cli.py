"""The ``merak`` command (also ``python -m merak``): small helpers around the recipes.

    merak new-recipe NAME [--from gpt] [--dest DIR]   copy a recipe as a new one (merak.scaffold)
"""

from __future__ import annotations

import argparse
import logging
import sys

from merak.scaffold import ScaffoldError, new_recipe, next_steps


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="merak", description="merak's command-line helpers")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("new-recipe", help="copy a recipe directory as a new recipe",
                                 description="Copy a recipe directory as the recipe NAME; the copy trains as it is.")
    create.add_argument("name", metavar="NAME", help="the new recipe's name (a Python identifier)")
    create.add_argument("--from", dest="source", default="gpt",
                        help="the recipe to copy: a name under recipes/ (gpt, bert, t5, vit, swin, wide_resnet) "
                             "or a recipe directory (default: gpt)")
    create.add_argument("--dest", default=None, help="the new recipe's directory (default: recipes/NAME)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``merak`` command with ``argv`` (default: the process's arguments); returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        made = new_recipe(args.name, source=args.source, dest=args.dest)
    except ScaffoldError as error:
        print(f"merak new-recipe: {error}", file=sys.stderr)
        return 2
    print(next_steps(made))
    return 0
