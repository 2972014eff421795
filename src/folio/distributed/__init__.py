"""Tensor-parallel state and collectives, below the layers that use them."""
