"""The OpenAI-compatible HTTP API (chat completions with video, models, health, metrics, live
session events): a second front door onto the same service the gRPC API reaches.

    routes.create_app(backend)      the ASGI app (FastAPI) over a Backend (backends.py)
    uvicorn_host.HttpServer         uvicorn on the embedded server's event loop
    ray_ingress                     the HTTP ingress deployment under Ray Serve
"""
