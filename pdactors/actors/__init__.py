"""Trio actors: one per module, each a thin shell around a core/ state machine."""
