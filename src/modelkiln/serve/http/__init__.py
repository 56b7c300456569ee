"""The HTTP edge: the ASGI app and its routes, uvicorn's protocol and server, errors as HTTP responses."""
