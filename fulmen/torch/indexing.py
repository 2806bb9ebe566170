"""Torch language: indexing (being written)."""
