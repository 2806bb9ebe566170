"""Torch language: linalg (being written)."""
