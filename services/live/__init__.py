"""The Live RPC: one live session per bidirectional gRPC stream.

    call.py        the call: client messages to the session, its events back
    host.py        what a call needs of its server (limits, engine, admission)
    messages.py    LiveOpen as a LiveConfig, stats and errors as messages
    url_feed.py    the server reading the video itself from an http(s) or RTSP URL
    incidents.py   alert rules from messages, incidents to the stream and a webhook
    webhook.py     incidents POSTed as JSON, off the caller's thread, retried

The session itself is the library's (sparrow.live.session)."""
