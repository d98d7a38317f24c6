"""Alert rules over the Live RPC (real gRPC on loopback, the embedded host, a tiny Qwen2.5-VL
saved and loaded like a served model): rules created, listed, replaced and removed while the
session runs, each answered with the rules now; incidents on the stream with their rule,
kind, probability and window; the same incidents POSTed to a loopback webhook, each once; a
webhook outside the server's allowed prefixes is PERMISSION_DENIED."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest
from conftest_services import SPEC_KWARGS
from webhook_recorder import Recorder

from sparrow import SpecConfig
from sparrow.services.client import SparrowClient
from sparrow.services.config import ServiceConfig
from sparrow.services.protos import pb
from sparrow.services.server import BackgroundServer
from sparrow.services.servicer import SparrowService
from sparrow.services.settings import AppSettings, build_engine
from sparrow.tiny import synthetic_frames

MiB = 1 << 20
OPEN = dict(fps=2.0, window_s=60.0, max_lag_s=100.0, min_pixels=28 * 28, max_pixels=84 * 112, stats_every_s=0)


@pytest.fixture(scope="module")
def hook_port() -> int:
    """The loopback port this module's webhook receivers listen on, one at a time: the server's
    allowed prefix names it (a prefix matches scheme, host and port exactly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dirs, hook_port):
    config = ServiceConfig(max_message_bytes=4 * MiB, live_webhook_prefixes=(f"http://127.0.0.1:{hook_port}/hook",))
    settings = AppSettings(target=str(tiny_model_dirs[0]), draft=str(tiny_model_dirs[1]),
                           spec=SpecConfig(**SPEC_KWARGS), service=config)
    engine, cache = build_engine(settings)
    with BackgroundServer(SparrowService(engine, cache, config)) as running:
        yield running


def _rules(response) -> list[tuple[str, str, float]]:
    return [(r.rule_id, r.question, r.fire_at) for r in response.rules.rules]


def test_rules_mid_session_incidents_on_the_stream_and_the_webhook(server, hook_port):
    frames = synthetic_frames(16, 84, 112, seed=2)
    times = np.arange(16) / 2.0
    # P(yes) of a random tiny target is neither 0 nor 1: fire_at 0.001 fires at the first check,
    # and a replacement asking 0.9999 / clear_at 0.9998 clears at the next.
    low = pb.AlertRule(rule_id="low", question="is a red shape in view ?", every_s=2.0, fire_at=0.001)
    with Recorder(fail_first=1, port=hook_port) as hook, \
            SparrowClient(server.address, max_message_bytes=4 * MiB) as client:
        with client.live(**OPEN, rules=[low], webhook_url=hook.url) as live:
            opened = live.opened()
            assert list(opened.rule_ids) == ["low"]
            it = iter(live)
            live.send_frames(frames[:4], times[:4])                  # to 2 s: low's first check
            fired = _next(it, lambda r: r.HasField("incident"))
            inc = fired.incident
            assert (inc.rule_id, inc.kind, inc.session_id) == ("low", pb.INCIDENT_KIND_FIRED, opened.session_id)
            assert (inc.start_s, inc.end_s) == (0.0, 2.0) and 0.001 <= inc.probability <= 1.0
            assert inc.question == "is a red shape in view ?" and inc.wall_time_s > 0
            # Created, listed, replaced, removed mid-session: each answered with the rules now.
            live.add_rule(pb.AlertRule(question="is a blue shape in view ?", every_s=4.0, fire_at=0.99))
            assert _rules(_next(it, lambda r: r.HasField("rules"))) == [
                ("low", "is a red shape in view ?", pytest.approx(0.001)), ("a1", "is a blue shape in view ?",
                                                                             pytest.approx(0.99))]
            live.replace_rule(pb.AlertRule(rule_id="low", question="is a green shape in view ?", every_s=2.0,
                                           fire_at=0.9999, clear_at=0.9998))
            assert _rules(_next(it, lambda r: r.HasField("rules")))[0] == ("low", "is a green shape in view ?",
                                                                          pytest.approx(0.9999))
            live.remove_rule("a1")
            assert [r[0] for r in _rules(_next(it, lambda r: r.HasField("rules")))] == ["low"]
            live.remove_rule("a1")
            event = _next(it, lambda r: r.HasField("event")).event
            assert (event.code, event.question_id) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "a1")
            live.add_rule(pb.AlertRule(rule_id="bad", question="q ?", fire_at=0.5, clear_at=0.7))
            event = _next(it, lambda r: r.HasField("event")).event
            assert (event.code, event.question_id) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "bad")
            live.list_rules()
            assert [r[0] for r in _rules(_next(it, lambda r: r.HasField("rules")))] == ["low"]
            live.send_frames(frames[4:8], times[4:8])               # to 4 s: the replaced rule clears
            cleared = _next(it, lambda r: r.HasField("incident")).incident
            assert (cleared.rule_id, cleared.kind, cleared.end_s) == ("low", pb.INCIDENT_KIND_CLEARED, 4.0)
            assert cleared.question == "is a green shape in view ?" and cleared.probability < 0.9998
            live.close()
            rest = list(it)
        assert rest[-1].HasField("stats") and rest[-1].stats.final
        assert not any(r.HasField("incident") for r in rest)
        # The webhook got both incidents, each exactly once (the first POST was refused and retried).
        assert [b["incident_id"] for b in hook.accepted] == [inc.incident_id, cleared.incident_id]
        assert [b["kind"] for b in hook.accepted] == ["fired", "cleared"] and len(hook.refused) == 1
        assert hook.accepted[0]["session_id"] == opened.session_id
        assert hook.accepted[0]["probability"] == pytest.approx(inc.probability)


def test_a_webhook_outside_the_allowed_prefixes_is_permission_denied(server, hook_port):
    with SparrowClient(server.address, max_message_bytes=4 * MiB) as client:
        for url, code in (("http://10.0.0.1:9/hook", grpc.StatusCode.PERMISSION_DENIED),
                          (f"http://127.0.0.1:{hook_port + 1}/hook", grpc.StatusCode.PERMISSION_DENIED),
                          (f"http://127.0.0.1:{hook_port}0/hook", grpc.StatusCode.PERMISSION_DENIED),
                          (f"http://127.0.0.1:{hook_port}/hookevil", grpc.StatusCode.PERMISSION_DENIED),
                          ("ftp://127.0.0.1:9/hook", grpc.StatusCode.INVALID_ARGUMENT)):
            with client.live(**OPEN, webhook_url=url) as live:
                with pytest.raises(grpc.RpcError) as err:
                    live.opened()
                assert err.value.code() == code


def _next(it, want):
    for response in it:
        if want(response):
            return response
    raise AssertionError("the stream ended first")


def test_sparrow_live_rule_prints_incidents_and_posts_them(server, hook_port, tmp_path, capsys):
    from sparrow.cli import main as cli
    from sparrow.video import write_synthetic_video

    path = tmp_path / "clip.mp4"
    write_synthetic_video(path, num_frames=24, width=112, height=84, fps=4.0, seed=1)       # 6 s
    with Recorder(port=hook_port) as hook:
        assert cli.main(["live", "--server", server.address, str(path), "--speed", "20", "--window", "60",
                         "--max-lag", "100", "--min-pixels", str(OPEN["min_pixels"]), "--max-pixels",
                         str(OPEN["max_pixels"]), "--rule", "2:0.001:is a red shape in view ?",
                         "--webhook", hook.url]) == 0
        out = capsys.readouterr().out
    assert "[r1 fired 0.0-2.0s] P(yes) " in out and out.count("fired") == 1, out
    assert [(b["rule_id"], b["kind"], b["end_s"]) for b in hook.accepted] == [("r1", "fired", 2.0)]
    assert cli.main(["live", "--server", server.address, str(path), "--rule", "2:1.5:q ?"]) != 0
    assert "--rule takes EVERY_S:FIRE_AT:QUESTION" in capsys.readouterr().err
