"""The ``.batch/`` control tree: manifests written by a loader, the ordered TAR views and prefetch
plans they become, and the tree of control files the mount serves for them.

Layer: above the engine (it uses its readers and read-ahead), below the mount adapter.
"""
