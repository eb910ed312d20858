"""Train a GPT with merak: python recipes/gpt/train.py [model=...] [parallel=...] [trainer.*=...]."""

import hydra

import merak
from recipes.gpt.spec import SPEC


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg) -> None:
    merak.run_command(SPEC, cfg)


if __name__ == "__main__":
    main()
