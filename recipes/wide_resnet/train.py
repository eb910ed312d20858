"""Train a Wide ResNet with merak: python recipes/wide_resnet/train.py [model=...] [parallel=...] [trainer.*=...]."""

import hydra

import merak
from recipes.wide_resnet.spec import SPEC


@hydra.main(version_base=None, config_path="conf", config_name="train")
def main(cfg) -> None:
    merak.run_command(SPEC, cfg)


if __name__ == "__main__":
    main()
