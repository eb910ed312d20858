"""torchvision (and what imports it) works on the CPU torch."""

from __future__ import annotations

import subprocess
import sys

import torch

from merak.compat.torchvision_ops import nms_reference


def _brute_force_nms(boxes, scores, threshold):
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    keep = []
    for i in order:
        ok = True
        for j in keep:
            x1 = max(boxes[i][0], boxes[j][0]); y1 = max(boxes[i][1], boxes[j][1])
            x2 = min(boxes[i][2], boxes[j][2]); y2 = min(boxes[i][3], boxes[j][3])
            inter = max(0.0, x2 - x1) * max(0.0, y2 - y1)
            area = lambda b: (b[2] - b[0]) * (b[3] - b[1])  # noqa: E731
            if inter / (area(boxes[i]) + area(boxes[j]) - inter) > threshold:
                ok = False
                break
        if ok:
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
