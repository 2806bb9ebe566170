"""Torch language: losses (being written)."""
