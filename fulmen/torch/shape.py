"""Torch language: shape (being written)."""
