"""Parquet row groups served as NumPy ``.npy`` files (``.rowgroups/``): the default transform from
Arrow columns to arrays, and (next) the tree and cache that serve them.

Layer: beside ``control`` (above the engine). Imports pyarrow and numpy, which ``import batchfs``
never does: the mount imports this package only when row groups are asked for.
"""
