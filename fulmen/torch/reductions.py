"""Torch language: reductions (being written)."""
