"""Serving (import as sparrow.services): one servicer, two hosts.

    servicer.py      the Sparrow service: protobuf requests in, responses out, typed errors
    handler.py       its gRPC methods, written once for both hosts (an error -> a status code)
    server.py        embedded host: grpc.aio around the in-process engine (`sparrow serve`)
    ray_app.py       Ray host: the target (and the draft) as Serve deployments behind Serve's proxies
    ray_proxy.py, ray_bind.py, ray_entry.py   Serve's proxy side, the cluster's address, RayService's builder
    draft_service.py the draft served apart from the target
    async_requests.py engine requests read from asyncio; completion.py a finished generation's message
    settings.py, config.py, models.py   what a server runs, its limits, its models from a spec string
    state_cache.py, video_store.py, uploads.py, routing.py   shared state, videos, uploads, prefix routing
    wire.py, grpc_status.py, stopping.py   messages off the wire, failures as status codes, a stop that ends
    logs.py, prom.py   structured logs, Prometheus metrics
    live/            live sessions (a URL or played frames, standing questions, alerts, webhooks)
    openai_api/      the OpenAI-compatible HTTP API
    client.py        a blocking client, free of torch (`sparrow generate` starts in well under a second)
    player.py        a file played into a live session (`sparrow live`); protogen.py / protos.py the stubs
"""
