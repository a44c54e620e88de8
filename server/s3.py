"""S3 subset: placeholder until the S3 change lands."""
from aiohttp import web


def add_routes(app: web.Application) -> None:
    pass


def error_response(request, status, message, headers):
    return web.Response(status=status, text=message, headers=headers)
