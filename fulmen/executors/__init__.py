"""Executors: the torch executor (always last) and the registry; see ``fulmen.extend`` for the public API."""
