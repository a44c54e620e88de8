"""Talking to object stores: the ``ObjectClient`` protocol and its backends (AIStore native API, S3,
in-memory), the HTTP/1 connection pool they share, and GetBatch streaming (with its emulation over
plain GETs for stores that lack it).

Layer: beside ``cache``, below the engine; imports ``batchfs.wire`` for the protocol.
"""
