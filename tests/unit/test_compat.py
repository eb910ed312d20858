"""torchvision (and what imports it) works on the CPU torch."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

from merak.compat.torchvision_ops import nms_reference


def _iou(a, b) -> float:
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    area_a = (a[2] - a[0]) * (a[3] - a[1])
    area_b = (b[2] - b[0]) * (b[3] - b[1])
    return inter / (area_a + area_b - inter)


def _brute_force_nms(boxes, scores, threshold):
    keep = []
    for i in sorted(range(len(scores)), key=lambda i: -scores[i]):
        if all(_iou(boxes[i], boxes[j]) <= threshold for j in keep):
            keep.append(i)
    return keep


def test_nms_reference_matches_brute_force():
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand(40, 2, generator=generator) * 50
    boxes = torch.cat([corners, corners + 5 + torch.rand(40, 2, generator=generator) * 20], dim=1)
    scores = torch.rand(40, generator=generator)
    for threshold in (0.1, 0.3, 0.5, 0.9):
        assert nms_reference(boxes, scores, threshold).tolist() == _brute_force_nms(
            boxes.tolist(), scores.tolist(), threshold)
    assert nms_reference(torch.empty(0, 4), torch.empty(0), 0.5).tolist() == []


def test_torchvision_timm_and_transformers_vision_import_in_a_fresh_process():
    code = (
        "import merak, torch, torchvision, timm\n"
        "from transformers import ViTForImageClassification, ViTConfig\n"
        "b = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60.]])\n"
        "print(torch.ops.torchvision.nms(b, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist())\n"
        "print(sum(p.numel() for p in torchvision.models.wide_resnet50_2().parameters()))\n"
        "print(timm.create_model('vit_tiny_patch16_224', pretrained=False)(torch.randn(1, 3, 224, 224)).shape[-1])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.split()
    assert lines[:3] == ["[0,", "2]", "68883240"]
    assert lines[3] == "1000"


def _run_fresh(code: str, cwd) -> subprocess.CompletedProcess:
    # Another working directory: the fix must come from the installed environment, not from the checkout.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=cwd)


def test_models_timm_and_torchvision_import_before_merak(tmp_path):
    """The start-up hook (merak-torchvision.pth, written by merak's install) makes the import order free."""
    code = (
        "from transformers import GPT2LMHeadModel, GPT2Config\n"
        "import timm, torchvision, torch\n"
        "import merak\n"
        "model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))\n"
        "print(model(torch.zeros(1, 4, dtype=torch.long)).logits.shape[-1])\n"
        "print(timm.create_model('vit_tiny_patch16_224', pretrained=False).num_classes)\n"
        "print(type(torchvision.__spec__.loader).__name__ != '_DeclareFirstLoader')\n"
    )
    result = _run_fresh(code, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["64", "1000", "True"]


def _merak_is_installed() -> bool:
    try:
        importlib.metadata.distribution("merak")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _merak_is_installed(), reason="merak used from a checkout (PYTHONPATH): no start-up hook")
def test_start_up_hook_is_installed_and_imports_no_torch(tmp_path):
    """Every Python start-up in the environment runs the hook: it must not import torch on its own, nor when
    a library only asks whether torchvision is installed."""
    code = (
        "import importlib.util, sys\n"
        "print('_merak_torchvision' in sys.modules)\n"
        "print(importlib.util.find_spec('torchvision') is not None, 'torch' in sys.modules)\n"
    )
    result = _run_fresh(code, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True", "False"], "merak-torchvision.pth missing: run `make setup`"
