"""The original example command lines (the examples README and the language-modeling README) run
as written, at toy size: ``--model-name toy``, 2 processes instead of 4, ``--max_steps 2``.

Each runs from a folder that holds the data and a link to the example script, as the READMEs do.
"""

from __future__ import annotations

import math
import sys

import pytest
from seed_runs import BIN, REPO, check_training, link_example, read_metrics, run_command, seed_env, write_text_csv

from merak.distributed.launch import free_port

pytestmark = pytest.mark.recipe

TOY = ["--max_steps", "2"]
# The examples README launches with torch.distributed.launch; its port comes from the environment
# (PET_MASTER_PORT), so that the command line stays as written and parallel runs do not collide.
LAUNCH = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2"]
TORCHRUN = [BIN / "torchrun", "--standalone", "--nproc_per_node=2"]


def _launch_env(cache_dir) -> dict:
    return seed_env(cache_dir, PET_MASTER_PORT=str(free_port()))


# The examples README's two command lines (the second with ZeRO), toy-sized.
SEED_000 = {
    "plain": ["--model-name", "toy", "--data-files", "./train_context.csv", "--output_dir", "./output",
              "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
              "--data_path", "/ssd/datasets/imagenet/pytorch"],
    "zero": ["--model-name", "toy", "--zero_optimization", "True", "--data-files", "./train_context.csv",
             "--output_dir", "./output", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
             "--data_path", "/ssd/datasets/imagenet/pytorch"],
}


def test_examples_readme_gpt_commands_parse_to_their_settings():
    """Both command lines, parsed as run_gpt.py parses them: only --zero_optimization tells them apart.
    (The ZeRO one also runs as written, below; running the plain one too would prove nothing more.)"""
    from transformers import HfArgumentParser

    import merak
    from examples.seed_api import ExampleArguments
    from merak.hf.arguments import trainer_settings

    parser = HfArgumentParser((ExampleArguments, merak.MerakArguments))
    parsed = {name: parser.parse_args_into_dataclasses([*SEED_000[name], *TOY]) for name in SEED_000}
    for example, args in parsed.values():
        assert example.model_name == "toy" and example.data_files == ["./train_context.csv"]
        assert example.data_path == "/ssd/datasets/imagenet/pytorch" and args.problems() == []
    settings = {name: trainer_settings(args) for name, (_, args) in parsed.items()}
    assert {name: values["zero_optimization"] for name, values in settings.items()} == {"plain": False, "zero": True}
    assert settings["plain"] == {**settings["zero"], "zero_optimization": False}


def test_examples_readme_gpt_zero_command_with_data_path(tmp_path, cache_dir):
    """run_gpt.py accepts --data_path (unused by a text model) under torch.distributed.launch."""
    write_text_csv(tmp_path / "train_context.csv")
    link_example(tmp_path, "run_gpt.py")
    result = run_command([*LAUNCH, "run_gpt.py", *SEED_000["zero"], *TOY], cwd=tmp_path, env=_launch_env(cache_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    # 2 processes, no --pp: both are data-parallel replicas; 4 x 4 samples each per step.
    summary = check_training(tmp_path / "output", layout={"dp": 2, "tp": 1, "pp": 1}, global_batch_size=32)
    assert summary["precision"]["zero_stage"] == 1


# The language-modeling README's three torchrun command lines, toy-sized; gpt also as a pipeline.
SEED_001 = {
    "t5": (["run_t5.py", "--model-name", "toy", "--data-files", "./train_context.csv", "--cache-dir", "./t5_cache",
            "--output_dir", "./output", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"],
           {"dp": 2, "tp": 1, "pp": 1}),
    "gpt-pp2": (["run_gpt.py", "--model-name", "toy", "--data-files", "./train_context.csv", "--cache-dir",
                 "./gpt2_cache", "--output_dir", "./output", "--per_device_train_batch_size", "4",
                 "--gradient_accumulation_steps", "4", "--pp", "2"],
                {"dp": 1, "tp": 1, "pp": 2}),
    "bert": (["run_bert.py", "--model-name", "toy", "--data-files", "./train_context.csv", "--cache-dir",
              "./bert_cache", "--output_dir", "./output", "--remove_unused_columns", "false",
              "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"],
             {"dp": 2, "tp": 1, "pp": 1}),
}


@pytest.mark.parametrize("name", sorted(SEED_001))
def test_language_modeling_readme_commands_under_torchrun(tmp_path, name):
    command, layout = SEED_001[name]
    write_text_csv(tmp_path / "train_context.csv")
    link_example(tmp_path, command[0])
    # The data is tokenized into the --cache-dir of the command line.
    result = run_command([*TORCHRUN, *command, *TOY], cwd=tmp_path, env=seed_env(tmp_path / "unused-cache"))
    assert result.returncode == 0, result.stderr[-3000:]
    check_training(tmp_path / "output", layout=layout, global_batch_size=16 * layout["dp"])
    cache = command[command.index("--cache-dir") + 1]
    assert any((tmp_path / cache).iterdir()), f"nothing was cached in {cache}"
    assert "run summary" in result.stderr


def test_run_vit_without_the_imagenet_folder_trains_on_synthetic_images(tmp_path):
    """The examples README's command line for ViT, where its ImageNet folder does not exist: a
    warning names it and the recipe's synthetic images are used."""
    link_example(tmp_path, "run_vit.py")
    missing = tmp_path / "ssd/datasets/imagenet/pytorch"
    command = [*LAUNCH, "run_vit.py", "--model-name", "toy", "--output_dir", "./output",
               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
               "--data_path", missing, "--pp", "2", *TOY]
    result = run_command(command, cwd=tmp_path, env=_launch_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count(f"--data_path {missing} is not an image folder") == 1  # rank 0 only
    summary = check_training(tmp_path / "output", layout={"dp": 1, "tp": 1, "pp": 2}, global_batch_size=16)
    # The toy's 10 synthetic classes: a fresh classifier starts near ln(10).
    assert summary["first_loss"] == pytest.approx(math.log(10), abs=0.5)


def _image_folder(root, classes=("cat", "dog", "fox"), per_class=6) -> None:
    """``root/{train,val}/<class>/<i>.png``: small plain-colour images, as an ImageNet folder holds."""
    from PIL import Image

    for split in ("train", "val"):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (40, 36), (80 * c, 40 * i, 120)).save(folder / f"{i}.png")


def test_run_swin_trains_and_evaluates_on_an_image_folder(tmp_path):
    """--data_path with train/ and val/ in the ImageFolder layout: the classifier gets one output
    per class of the folder and the validation images are evaluated."""
    _image_folder(tmp_path / "imagenet")
    link_example(tmp_path, "run_swin.py")
    # One process; evaluation microbatches equal the training ones (the captured graph's shape).
    command = [sys.executable, "run_swin.py", "--model-name", "toy", "--output_dir", "./output",
               "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
               "--gradient_accumulation_steps", "2", "--data_path", "./imagenet", "--do_eval", "true", *TOY]
    result = run_command(command, cwd=tmp_path, env=seed_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "is not an image folder" not in result.stderr
    summary = check_training(tmp_path / "output", layout={"dp": 1, "tp": 1, "pp": 1}, global_batch_size=4)
    assert summary["first_loss"] == pytest.approx(math.log(3), abs=0.4)  # 3 classes, not the toy's 10
    evaluation = [r for r in read_metrics(tmp_path / "output") if "eval_loss" in r]
    # val/ holds 18 images: 4 whole steps of 2 x 2.
    assert len(evaluation) == 1 and evaluation[0]["eval_samples"] == 16
    assert math.isfinite(evaluation[0]["eval_loss"])


def test_image_examples_refuse_text_files(tmp_path):
    write_text_csv(tmp_path / "train_context.csv", rows=3)
    result = run_command([sys.executable, REPO / "examples/run_vit.py", "--data-files", "train_context.csv",
                          "--output_dir", "out"], cwd=tmp_path, env=seed_env(tmp_path / "cache"), timeout=120)
    assert result.returncode == 2
    assert "--data-files is for text models; image models read --data_path" in result.stderr


def _seed_data():
    """examples/seed_data.py, loaded from its file (examples/ is not an installed package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("seed_data", REPO / "examples/seed_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_which_image_folder_data_path_names(tmp_path):
    seed_data = _seed_data()
    assert seed_data.find_image_folders(str(tmp_path / "missing")) is None
    (tmp_path / "empty").mkdir()
    assert seed_data.find_image_folders(str(tmp_path / "empty")) is None
    flat = tmp_path / "flat"
    for name in ("a", "b"):
        (flat / name).mkdir(parents=True)
    assert seed_data.find_image_folders(str(flat)) == seed_data.ImageFolders(str(flat), None, 2)
    # An ImageNet folder: train/ and val/ are the splits, not two classes.
    _image_folder(tmp_path / "imagenet")
    found = seed_data.find_image_folders(str(tmp_path / "imagenet"))
    assert found == seed_data.ImageFolders(str(tmp_path / "imagenet/train"), str(tmp_path / "imagenet/val"), 3)
    overrides, folders = seed_data.image_overrides(str(tmp_path / "imagenet"))
    assert folders == found
    assert overrides == ["data=folder", f"data.path={found.train}", "model.num_classes=3"]
