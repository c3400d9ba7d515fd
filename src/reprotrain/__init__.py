"""reprotrain: reproducible, device-agnostic PyTorch training runs recorded in MLflow."""

__version__ = "0.1.0"
