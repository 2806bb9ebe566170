"""OpInfos: shape (being written)."""
