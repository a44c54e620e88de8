"""Caches of object bytes on the client: the memory tier of chunks, and a quota-bounded, never-evicting,
checksummed disk store (``DiskStore``) that anything naming its bytes exactly can use.

Layer: below the engine, beside ``objclient``; imports only ``batchfs.buffers`` of batchfs.
"""
