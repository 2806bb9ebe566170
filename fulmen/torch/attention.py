"""Torch language: attention (being written)."""
