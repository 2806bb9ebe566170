"""Torch language: nn (being written)."""
