"""batchfs: feed map-style training loaders from object storage, a batch at a time.

Importing this package is cheap and never imports torch, pyfuse3 or trio.
"""

__version__ = "0.1.0"
