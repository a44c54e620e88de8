"""Where objects live on a node: mountpaths, the catalog of objects and versions, writing
(atomically, durably) and reading them, and placing names onto mountpaths.
"""
