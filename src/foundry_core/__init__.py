"""Foundry: save CUDA graphs with their device context once, restore them bit-exactly at every start."""

__version__ = "0.1.0"
