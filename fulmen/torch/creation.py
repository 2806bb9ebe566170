"""Torch language: creation (being written)."""
