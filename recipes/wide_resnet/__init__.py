"""Wide ResNet image classification: torchvision models."""
