"""The filesystem without FUSE: configuration, the inode table and namespace tree, object readers
(chunked parallel range reads through the caches), read-ahead, and the one table that turns
exceptions into errnos.

Layer: above ``cache`` and ``objclient``; never imports pyfuse3 (tests drive it directly).
"""
