"""The README's "Example usage" as written, with its ``...`` filled in at toy size.

Run under ``torchrun --nproc_per_node=4`` (dp=2 x pp=2) by tests/recipes/test_seed_api_and_run_sh.py,
from a folder outside the checkout, so ``import Merak`` is the installed package.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import Merak
from Merak import MerakArguments, MerakTrainer

# Init Merak with degrees of 3D parallelism.
dp = 2
tp = 1
pp = 2
Merak.init(dp, tp, pp)

# Set training args MerakArgument.
training_args = MerakArguments(
    output_dir='./path/to/save',
    # toy size: two steps of 2 microbatches of 2 sequences on each of the 2 data-parallel replicas
    max_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
    disable_tqdm=True,
)

torch.manual_seed(0)  # the same initial weights in every process
model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2))
tokens = torch.randint(96, (24, 16), generator=torch.Generator().manual_seed(1))
train_data = [{"input_ids": row, "labels": row} for row in tokens[:16]]
eval_data = [{"input_ids": row, "labels": row} for row in tokens[16:]]

# Set our Trainer
trainer = MerakTrainer(
     do_train=True,
     model=model,
     args=training_args,
     train_data=train_data,
     eval_data=eval_data,
)

# Do train
trainer.train()
