"""Train a BERT masked LM with merak: python recipes/bert/train.py [model=...] [parallel=...] [trainer.*=...]."""

import hydra

import merak
from recipes.bert.spec import SPEC


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg) -> None:
    merak.run_command(SPEC, cfg)


if __name__ == "__main__":
    main()
