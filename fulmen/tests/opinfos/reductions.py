"""OpInfos: reductions (being written)."""
