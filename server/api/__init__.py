"""The server's HTTP front: the aiohttp application, AIStore native routes, the S3 subset (XML,
SigV4, listing, multipart), the GetBatch and archive-read fronts, authentication, connection
limits and metrics. Handlers parse a request, call the node, and render the answer.
"""
