"""Tiny versions of every model family merak must split, with example inputs and a loss.

Each factory returns ``(model, inputs, loss_fn)``: a freshly initialized model
(seeded by the caller), one microbatch of inputs (model inputs plus
``labels``), and ``loss_fn(model_output, batch) -> scalar``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import merak  # noqa: F401  (before transformers / torchvision)

BATCH = 2


class TinyClassifier(nn.Module):
    """One linear layer from 4 ``features`` to 3 classes: a model for MerakTrainer tests."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, features):
        return self.layer(features)


def logits_of(output):
    if isinstance(output, torch.Tensor):
        return output
    return output["logits"]


def token_loss(output, batch):
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch["labels"].reshape(-1),
                           ignore_index=-100)


def class_loss(output, batch):
    return F.cross_entropy(logits_of(output).float(), batch["labels"])


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=97, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    ids = torch.randint(0, 97, (BATCH, 16))
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}, token_loss


def bert(vocab_size: int = 101):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                        vocab_size=vocab_size, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, vocab_size, (BATCH, 16))
    return BertForMaskedLM(config), {"input_ids": ids, "labels": ids}, token_loss


def t5(vocab_size: int = 103):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0)
    source = torch.randint(1, vocab_size, (BATCH, 12))
    labels = torch.randint(1, vocab_size, (BATCH, 8))
    decoder_input_ids = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return (T5ForConditionalGeneration(config),
            {"input_ids": source, "decoder_input_ids": decoder_input_ids, "labels": labels}, token_loss)


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=3,
                       num_attention_heads=4, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return (ViTForImageClassification(config),
            {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.randint(0, 5, (BATCH,))}, class_loss)


def swin():
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 2],
                        num_heads=[2, 4], window_size=4, num_labels=5, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return (SwinForImageClassification(config),
            {"pixel_values": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 5, (BATCH,))}, class_loss)


def wide_resnet():
    from torchvision.models.resnet import Bottleneck, ResNet

    model = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=5, width_per_group=16)
    return model, {"x": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 5, (BATCH,))}, class_loss


def timm_vit():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              depth=3, num_heads=4, num_classes=5)
    return model, {"x": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 5, (BATCH,))}, class_loss


def timm_swin():
    import timm

    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=4,
                              embed_dim=16, depths=(1, 2), num_heads=(2, 4), num_classes=5)
    return model, {"x": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 5, (BATCH,))}, class_loss


class SkipNet(nn.Module):
    """A user model merak has never seen: long skip connections across most of the network."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 3)

    def forward(self, features):
        first = torch.tanh(self.inp(features))
        hidden = first
        saved = []
        for layer in self.layers:
            hidden = torch.relu(layer(hidden))
            saved.append(hidden)
        # The input embedding and the first layer's output skip to the very end.
        return self.out(hidden + first + saved[0])


def skip_net():
    return SkipNet(), {"features": torch.randn(BATCH, 8), "labels": torch.randint(0, 3, (BATCH,))}, class_loss


ALL = {"gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit, "swin": swin, "wide_resnet": wide_resnet,
       "timm_vit": timm_vit, "timm_swin": timm_swin, "skip_net": skip_net}


class GPT2BlockPart(nn.Module):
    """A GPT-2 block as a stage part: hidden states in, hidden states out."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        self.block = GPT2Block(config)

    def forward(self, hidden):
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out
