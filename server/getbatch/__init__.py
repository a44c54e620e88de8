"""GetBatch execution on the server: parsing a request, reading its entries, and assembling them
into one TAR stream in exactly the requested order under a memory budget.
"""
