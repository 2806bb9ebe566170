"""OpInfos: elementwise (being written)."""
