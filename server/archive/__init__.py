"""Archives on the server: the TAR/ZIP writers GetBatch answers with, and the indexes that let a
request name one member of a shard (TAR, TGZ, ZIP) without reading the whole shard.
"""
