"""Train a GPT with merak: python recipes/gpt/train.py [model=...] [parallel=...] [trainer.*=...]."""

import merak
from merak.recipe import load_spec

# spec.py of this directory, imported as this directory's package: a copy of the directory trains its own code.
SPEC = load_spec(__file__)


@merak.hydra_main(config_path="conf", config_name="train")
def main(cfg) -> None:
    merak.run_command(SPEC, cfg)


if __name__ == "__main__":
    main()
