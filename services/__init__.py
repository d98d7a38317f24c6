"""Serving (import as sparrow.services): one servicer, two hosts.

    servicer.py   the Sparrow service: protobuf requests in, responses out, typed errors
    handler.py    its gRPC methods, written once for both hosts (an error -> a status code)
    server.py     embedded host: grpc.aio around the in-process engine (`sparrow serve`)
    ray_app.py    Ray host: TargetDeployment + DraftDeployment behind Serve's gRPC proxy
    draft.py      the draft served apart from the target (DraftWorker, RemoteDraftProposer)
    runner.py     engine generations on threads, read from asyncio
    client.py     a blocking client; protogen.py the stubs
    cli.py        the `sparrow` command; cli_<command>.py each of its commands
"""
