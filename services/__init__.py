"""Serving (import as sparrow.services): one servicer, two hosts.

    servicer.py   the Sparrow service: protobuf requests in, responses out, typed errors
    server.py     embedded host: grpc.aio around the in-process engine (`sparrow serve`)
    ray_app.py    Ray host: TargetDeployment + DraftDeployment behind Serve's gRPC proxy
    draft.py      the draft served apart from the target (DraftWorker, RemoteDraftProposer)
    runner.py     engine generations on threads, read from asyncio
    client.py     a blocking client; cli.py the `sparrow` command; protogen.py the stubs
"""
