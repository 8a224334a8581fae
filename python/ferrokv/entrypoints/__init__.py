"""Serving front ends of the engine (``ferrokv serve``)."""
