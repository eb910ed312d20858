"""``merak new-recipe``: a new recipe made by copying an existing one.

The copy is a working recipe before it is edited: its ``train.py`` imports its own directory
(:func:`merak.recipe.load_spec`), so it trains the copied model under the new name. What is renamed:
the spec's name (``spec.py``), the schema classes (``GptModel`` -> ``<Name>Model``), the
``recipes/<source>/`` paths in usage lines, and the README (a short one naming the source). What is
left behind: the source's model-specific trainer defaults (``conf/trainer/<source>.yaml``, e.g.
GPT-2's sequence parallelism; the copy uses merak's generic ``trainer: default``) and the option
files of the source's models (``conf/model/gpt3-175b.yaml`` ...), except the default one and ``toy``,
which the copy trains with until its own options replace them.
"""

from __future__ import annotations

import argparse
import keyword
import logging
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Never copied: caches and the outputs of runs started inside the recipe directory.
IGNORED = ("__pycache__", "*.pyc", "outputs", "multirun")
# Files whose text mentions the recipe's own path (usage lines) or name.
TEXT_SUFFIXES = (".py", ".yaml", ".md")


class ScaffoldError(ValueError):
    """The recipe cannot be created as asked; the message says what to change."""


@dataclass(frozen=True)
class NewRecipe:
    """What :func:`new_recipe` made.

    Attributes:
        name: the new recipe's name (its spec name and directory name).
        source: the directory it was copied from.
        dest: the new recipe's directory.
        left_behind: files of the source not copied (relative paths), with why.
    """

    name: str
    source: Path
    dest: Path
    left_behind: tuple[str, ...] = ()


# merak's own recipes: the recipes package installed beside merak (a checkout or site-packages).
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def find_source(source: str) -> Path:
    """The recipe directory ``source`` names: a recipe directory's path, or one of merak's recipes by name."""
    path = Path(source).expanduser()
    if not (path / "spec.py").is_file() and re.fullmatch(r"\w+", source):
        path = RECIPES / source
    if not (path / "spec.py").is_file():
        known = known_recipes()
        raise ScaffoldError(f"--from {source}: not a recipe directory (no spec.py); name one of merak's recipes "
                            f"({', '.join(known)}) or the path of a recipe directory")
    return path.resolve()


def _check_name(name: str, dest: Path) -> None:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ScaffoldError(f"recipe name {name!r} must be a Python identifier (letters, digits, _), "
                            "since its directory is imported as a package")
    if dest.exists():
        raise ScaffoldError(f"{dest} exists already: choose another name or --dest")
    if (dest.parent / f"{name}.py").exists():
        raise ScaffoldError(f"{dest.parent / (name + '.py')} exists: a recipe named {name} would hide that "
                            "module; choose another name")


def new_recipe(name: str, source: str = "gpt", dest: str | Path | None = None) -> NewRecipe:
    """Copy the recipe ``source`` to ``dest`` (default ``recipes/<name>``) as the recipe ``name``.

    Raises:
        ScaffoldError: the name is not an identifier, the destination exists, or ``source`` is
            not a recipe directory.
    """
    origin = find_source(source)
    target = Path(dest if dest is not None else Path("recipes") / name).expanduser().resolve()
    _check_name(name, target)
    own_trainer = Path("conf", "trainer", f"{origin.name}.yaml")
    has_own_trainer = (origin / own_trainer).is_file()
    shutil.copytree(origin, target, ignore=shutil.ignore_patterns(*IGNORED))
    left_behind = ()
    if has_own_trainer:
        (target / own_trainer).unlink()
        _remove_if_empty(target / own_trainer.parent)
        left_behind = (f"{own_trainer.as_posix()} ({origin.name}'s model-specific trainer defaults)",)
    left_behind += _drop_other_model_options(target, origin.name)
    _rename(target, origin.name, name, reset_trainer=has_own_trainer)
    _write_readme(target, origin.name, name)
    logger.info("copied %s to %s as recipe %s", origin, target, name)
    return NewRecipe(name=name, source=origin, dest=target, left_behind=left_behind)


KEPT_MODEL_OPTIONS = ("toy",)  # the tests' size, beside the default model of conf/train.yaml


def _drop_other_model_options(target: Path, old: str) -> tuple[str, ...]:
    """Remove the copied ``conf/model/*.yaml`` of the source's own models but the default and toy."""
    folder = target / "conf" / "model"
    train = target / "conf" / "train.yaml"
    if not folder.is_dir() or not train.is_file():
        return ()
    default = re.search(r"^\s*- model:\s*([\w.-]+)", train.read_text(encoding="utf-8"), flags=re.M)
    kept = {*KEPT_MODEL_OPTIONS, default.group(1) if default else ""}
    dropped = sorted(path.name for path in folder.glob("*.yaml") if path.stem not in kept)
    for item in dropped:
        (folder / item).unlink()
    if not dropped:
        return ()
    return (f"conf/model/: {', '.join(dropped)} ({old}'s models; kept {', '.join(sorted(kept - {''}))})",)


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _write_readme(target: Path, old: str, new: str) -> None:
    """A README for the copy: what it is, how it runs, what to change (the source's described its model)."""
    (target / "README.md").write_text(
        f"# {new}\n\nA recipe copied from merak's `{old}` recipe (`merak new-recipe {new} --from {old}`): it trains "
        f"{old}'s model until `model.py` and `conf/model/` say otherwise.\n\n```bash\npython recipes/{new}/train.py "
        f"model=toy parallel=single trainer.max_steps=2\n```\n\nNext: `model.py` and `conf/model/*.yaml` (your "
        f"model and its sizes), `schema.py` (every key, with its type and range), `parallel.py` (split points, "
        f"tensor-parallel plan), `data.py` and `conf/data/` (your data). Guide: docs/writing_a_recipe.md.\n",
        encoding="utf-8")


def _remove_if_empty(folder: Path) -> None:
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _rename(target: Path, old: str, new: str, *, reset_trainer: bool) -> None:
    """Give the copy its own name (the spec's name, usage paths, the README title) and, when the
    source's own trainer defaults were left behind, merak's generic ones."""
    for path in sorted(target.rglob("*")):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES:
            continue
        text = path.read_text(encoding="utf-8")
        changed = text.replace(f"recipes/{old}/", f"recipes/{new}/")
        if path.suffix == ".py":  # the schema classes named after the recipe: GptModel, GptData
            changed = re.sub(rf"\b{re.escape(_camel(old))}(Model|Data)\b", rf"{_camel(new)}\1", changed)
        if path == target / "spec.py":
            # The spec's name and the docstring's "The <old> recipe"; nothing else (a recipe may be
            # named like one of its own modules).
            changed = re.sub(rf"""\bname=(["']){re.escape(old)}\1""", rf"name=\g<1>{new}\g<1>", changed)
            changed = re.sub(rf"\bThe {re.escape(old)} recipe\b", f"The {new} recipe", changed)
        elif path == target / "conf" / "train.yaml" and reset_trainer:
            changed = re.sub(rf"^(\s*- trainer:) {re.escape(old)}\b.*$", r"\1 default", changed, flags=re.M)
        if changed != text:
            path.write_text(changed, encoding="utf-8")
    if not re.search(rf"""\bname=(["']){re.escape(new)}\1""", (target / "spec.py").read_text(encoding="utf-8")):
        logger.warning("%s: no name=%r found to rename; set RecipeSpec(name=%r) yourself", target / "spec.py",
                       old, new)


def next_steps(made: NewRecipe) -> str:
    """What to do with the copy, as the command prints it."""
    here = Path.cwd()
    where = made.dest.relative_to(here) if made.dest.is_relative_to(here) else made.dest
    lines = [f"created recipe {made.name} in {where} (a copy of {made.source.name})"]
    lines += [f"left behind: {item}" for item in made.left_behind]
    lines += [
        "next steps:",
        f"  1. it trains as copied: python {where}/train.py model=toy parallel=single trainer.max_steps=2",
        "  2. model.py: build your model and its loss; conf/model/*.yaml: its options (start with toy);",
        "     schema.py: every key of conf/model/ and conf/data/, with its type and range",
        "  3. parallel.py: input names, split points, check_layout, the tensor-parallel plan",
        "     (merak.tensor_parallel.default_plan(model) gives merak's or the Hugging Face model's own plan)",
        "  4. data.py and conf/data/: your data; conf/train.yaml: run defaults",
        "  5. README.md: describe it; a test under tests/recipes/",
        "guide: docs/writing_a_recipe.md",
    ]
    return "\n".join(lines)


def known_recipes() -> list[str]:
    """The names of merak's own recipes (directories under recipes/ with a spec.py)."""
    return sorted(p.name for p in RECIPES.iterdir() if (p / "spec.py").is_file()) if RECIPES.is_dir() else []


def main(argv: list[str] | None = None, *, prog: str = "merak new-recipe") -> int:
    """``merak new-recipe NAME [--from gpt] [--dest DIR]``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Copy a recipe directory as the recipe NAME; the copy trains as it is.")
    parser.add_argument("name", metavar="NAME", help="the new recipe's name (a Python identifier)")
    parser.add_argument("--from", dest="source", default="gpt",
                        help=f"the recipe to copy: a name under recipes/ ({', '.join(known_recipes())}) "
                             "or a recipe directory (default: gpt)")
    parser.add_argument("--dest", default=None, help="the new recipe's directory (default: recipes/NAME)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        made = new_recipe(args.name, source=args.source, dest=args.dest)
    except ScaffoldError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    print(next_steps(made))
    return 0
