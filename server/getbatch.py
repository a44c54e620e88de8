"""GetBatch (AIStore "moss"): placeholder until the GetBatch change lands."""
from aiohttp import web


def add_routes(app: web.Application) -> None:
    pass
