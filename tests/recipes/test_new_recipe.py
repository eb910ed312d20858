"""`merak new-recipe`: a copied recipe trains its own files, under its own name, as copied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_py import run_train_py

from merak.cli import main as merak_command
from merak.scaffold import ScaffoldError, new_recipe

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
MARKER = "model.py of the copy in use"


@pytest.mark.timeout(300)
def test_copy_of_gpt_trains_its_own_files(tmp_path, cache_dir, monkeypatch, capsys):
    """The scaffold (`merak new-recipe`, called in this process) copies gpt outside the repository; the
    copy's train.py, a process of its own, runs the copy's spec and model."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # run_train_py passes this environment on
    monkeypatch.chdir(tmp_path)
    dest = tmp_path / "work" / "mymodel"
    assert merak_command(["new-recipe", "mymodel", "--from", "gpt", "--dest", str(dest)]) == 0
    printed = capsys.readouterr().out
    assert "created recipe mymodel" in printed and "next steps:" in printed
    assert "docs/writing_a_recipe.md" in printed
    assert 'name="mymodel"' in (dest / "spec.py").read_text()
    # GPT-2's own trainer defaults (sequence parallelism) stay with gpt; the copy uses merak's.
    assert not (dest / "conf" / "trainer").exists()
    assert "  - trainer: default\n" in (dest / "conf" / "train.yaml").read_text()
    assert "recipes/mymodel/train.py" in (dest / "train.py").read_text()
    # What names gpt is renamed or left behind: its schema classes, its models' option files, its README.
    assert "class MymodelModel(" in (dest / "schema.py").read_text()
    assert "GptModel" not in (dest / "spec.py").read_text()
    assert sorted(p.name for p in (dest / "conf" / "model").glob("*.yaml")) == ["demo.yaml", "toy.yaml"]
    assert "gpt3-175b.yaml" in printed  # named among what was left behind
    readme = (dest / "README.md").read_text()
    assert readme.startswith("# mymodel\n") and "GPT-2" not in readme
    # An edit to the copy's model.py shows in the run: the copy imports its own files, not recipes.gpt.
    model_py = dest / "model.py"
    marked = (f"    import logging\n\n    logging.getLogger(__name__).warning({MARKER!r})\n"
              "    return GPT2LMHeadModel(config)")
    model_py.write_text(model_py.read_text().replace("    return GPT2LMHeadModel(config)", marked))

    run_dir = tmp_path / "run"
    # pp2 with spawned workers: they import the copy again by its own package name.
    result = run_train_py(["model=toy", "parallel=pp2", "launcher.start_method=spawn", "trainer.max_steps=1",
                           "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=2",
                           f"hydra.run.dir={run_dir}"], cache_dir, script=dest / "train.py", cwd=tmp_path,
                          timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["recipe"] == "mymodel" and summary["steps"] == 1
    assert MARKER in result.stdout + result.stderr
    assert "recipes.gpt" not in result.stdout + result.stderr


def test_scaffold_refuses_what_cannot_work(tmp_path):
    """Names that are no identifiers, an existing destination, a source that is no recipe: each says why."""
    with pytest.raises(ScaffoldError, match="must be a Python identifier"):
        new_recipe("my-model", dest=tmp_path / "my-model")
    new_recipe("mine", dest=tmp_path / "mine")
    with pytest.raises(ScaffoldError, match="exists already"):
        new_recipe("mine", dest=tmp_path / "mine")
    with pytest.raises(ScaffoldError, match=r"name one of merak's recipes \(bert, gpt, "):
        new_recipe("other", source="nope", dest=tmp_path / "other")
    (tmp_path / "text.py").write_text("")
    with pytest.raises(ScaffoldError, match="would hide that module"):
        new_recipe("text", dest=tmp_path / "text")


def test_copy_of_a_copy_and_of_every_recipe_renames_the_spec(tmp_path):
    """Any recipe copies (by name or path); only the spec name and recipes/<name>/ paths change."""
    for source in ("bert", "t5", "vit", "swin", "wide_resnet"):
        made = new_recipe(f"my_{source}", source=source, dest=tmp_path / f"my_{source}")
        assert f'name="my_{source}"' in (made.dest / "spec.py").read_text()
        assert (made.dest / "model.py").read_text() == (REPO / "recipes" / source / "model.py").read_text()
    again = new_recipe("again", source=str(tmp_path / "my_vit"), dest=tmp_path / "again")
    assert 'name="again"' in (again.dest / "spec.py").read_text() and again.source.name == "my_vit"
