"""Running a mount: the thin pyfuse3 adapter over the engine's trees, the daemon (foreground or
background, readiness, signals, logging) and the ``batchfs mount`` command line.

Layer: the top of the client; the only package that imports pyfuse3.
"""
