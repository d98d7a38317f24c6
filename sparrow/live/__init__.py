"""Live video sessions: a stream that keeps growing, questions asked about "now".

    session.py        LiveSession: feed bytes or frames, ask, standing questions, stats
    window.py         the newest frame pairs in one KV cache (LiveConfig, FramePair)
    media_feed.py     container bytes as media: MPEG-TS framing checked, one decoder per media
                      (video/growing_stream.py's LiveDecoder: decoded on a thread as they are fed)
    events.py         what a session hands out: stats, answers, events
    source_health.py  the source's clock, camera time, and silence (STALE / RESUMED)
    questions.py      questions in flight per session: bounded, queued, refused
    alerts.py         an alert rule's yes/no decision with hysteresis and cooldown
    rules.py          a session's alert rules run on its window

The gRPC Live call over a session is sparrow.services.live.call; the synthetic live world that
tests and benchmarks it is sparrow.world.live_stream."""
