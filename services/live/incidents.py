"""The Live RPC's alert rules: rule messages to the session's rules (sparrow/live/rules.py),
and its incidents to the response stream and, when the session names one, a webhook.

    add_rule / replace_rule / remove_rule / list_rules  -> session.alerts (a RuleList answers list)
    a check that fired or cleared its rule (the loop)   -> AlertIncident on the stream
                                                        -> the same, as JSON, to WebhookSink
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable

from sparrow.live.alerts import AlertRule, Check, Incident
from sparrow.errors import InvalidRequest, ResourceExhausted
from sparrow.live.session import LiveSession

from sparrow.services.config import ServiceConfig
from sparrow.services.protos import pb
from sparrow.services.live.webhook import WebhookSink, check_webhook_url

log = logging.getLogger(__name__)

MAX_RULES = 64                  # alert rules one session may hold
MAX_WEBHOOK_CHARS = 2048
DEFAULT_EVERY_S = 2.0           # a rule's cadence when the message leaves it 0 (a frame pair at 1 fps)
_KINDS = {"fired": pb.INCIDENT_KIND_FIRED, "cleared": pb.INCIDENT_KIND_CLEARED}
RULE_REQUESTS = ("add_rule", "replace_rule", "remove_rule", "list_rules")   # LiveRequest kinds LiveRules.handle takes


def rule_id_of(request: pb.LiveRequest) -> str:
    """The rule a rule request names ("" for list_rules, or an add that leaves the id to the server)."""
    kind = request.WhichOneof("kind")
    return "" if kind == "list_rules" else getattr(request, kind).rule_id


def rule_of(message: pb.AlertRule, rule_id: str, max_chars: int) -> AlertRule:
    """A rule message as an AlertRule (zero fields: the defaults AlertRule's docstring gives)."""
    if len(message.question) > max_chars:
        raise ResourceExhausted(f"the rule's question is {len(message.question)} characters, "
                                f"over the limit of {max_chars}")
    return AlertRule(rule_id, message.question, every_s=message.every_s or DEFAULT_EVERY_S,
                     fire_at=message.fire_at or 0.5,
                     clear_at=message.clear_at if message.HasField("clear_at") else None,
                     fire_after=message.fire_after or 1, clear_after=message.clear_after or 1,
                     cooldown_s=message.cooldown_s)


def rule_message(rule: AlertRule) -> pb.AlertRule:
    message = pb.AlertRule(rule_id=rule.rule_id, question=rule.question, every_s=rule.every_s, fire_at=rule.fire_at,
                           fire_after=rule.fire_after, clear_after=rule.clear_after, cooldown_s=rule.cooldown_s)
    if rule.clear_at is not None:
        message.clear_at = rule.clear_at
    return message


def incident_message(incident: Incident, session_id: str, source: str) -> pb.AlertIncident:
    return pb.AlertIncident(
        rule_id=incident.rule_id, kind=_KINDS[incident.kind], probability=incident.probability,
        start_s=incident.start_s, end_s=incident.end_s, question=incident.question,
        source_pts_s=incident.source_pts_s, wall_time_s=incident.wall_time_s, session_id=session_id,
        incident_id=uuid.uuid4().hex, source=source)


def webhook_body(message: pb.AlertIncident) -> dict:
    """An incident as the webhook's JSON: AlertIncident's fields, kind as "fired" / "cleared"."""
    return {"incident_id": message.incident_id, "session_id": message.session_id, "rule_id": message.rule_id,
            "kind": "fired" if message.kind == pb.INCIDENT_KIND_FIRED else "cleared",
            "probability": message.probability, "start_s": message.start_s, "end_s": message.end_s,
            "question": message.question, "source_pts_s": message.source_pts_s,
            "wall_time_s": message.wall_time_s, "source": message.source}


def check_webhook(url: str, cfg: ServiceConfig) -> None:
    """A session's webhook must lie under one of the server's allowed prefixes (WebhookPrefix:
    the same scheme, host and port, and a path at or below the prefix's)."""
    if len(url) > MAX_WEBHOOK_CHARS:
        raise InvalidRequest(f"the webhook URL is longer than {MAX_WEBHOOK_CHARS} characters")
    check_webhook_url(url, cfg.live_webhook_prefixes)


class LiveRules:
    """One Live call's alert rules. `put` sends a response on the stream (on the loop)."""

    def __init__(self, session: LiveSession, session_id: str, source: str, cfg: ServiceConfig,
                 put: Callable[[pb.LiveResponse], None], webhook: WebhookSink | None = None):
        self.session, self.session_id, self.source, self.cfg = session, session_id, source, cfg
        self.put, self.webhook = put, webhook
        self._ids = itertools.count(1)

    # ----- requests (the session's threads) -----------------------------------------------------
    def handle(self, request: pb.LiveRequest) -> pb.LiveResponse:
        """A rule request (RULE_REQUESTS), answered with the session's rules after it."""
        kind = request.WhichOneof("kind")
        if kind == "add_rule":
            self.add(request.add_rule)
        elif kind == "replace_rule":
            self.replace(request.replace_rule)
        elif kind == "remove_rule":
            self.remove(request.remove_rule.rule_id)
        return self.listing()

    def add(self, message: pb.AlertRule) -> str:
        alerts = self.session.alerts
        if len(alerts.list()) >= MAX_RULES:
            raise ResourceExhausted(f"the session holds {MAX_RULES} alert rules, the most it may")
        rule_id = message.rule_id or self._fresh_id()
        return alerts.add(rule_of(message, rule_id, self.cfg.max_prompt_chars))

    def replace(self, message: pb.AlertRule) -> None:
        if not message.rule_id:
            raise InvalidRequest("replace_rule needs the rule_id of the rule it replaces")
        self.session.alerts.replace(rule_of(message, message.rule_id, self.cfg.max_prompt_chars))

    def remove(self, rule_id: str) -> None:
        if not self.session.alerts.remove(rule_id):
            raise InvalidRequest(f"no alert rule {rule_id!r}")

    def listing(self) -> pb.LiveResponse:
        return pb.LiveResponse(rules=pb.RuleList(rules=[rule_message(r) for r in self.session.alerts.list()]))

    def _fresh_id(self) -> str:
        taken = {r.rule_id for r in self.session.alerts.list()}
        while True:
            candidate = f"a{next(self._ids)}"
            if candidate not in taken:
                return candidate

    # ----- checks (the loop) ----------------------------------------------------------------------
    def on_check(self, check: Check) -> None:
        if check.incident is None:
            return
        message = incident_message(check.incident, self.session_id, self.source)
        self.put(pb.LiveResponse(incident=message))
        if self.webhook is not None:
            try:
                self.webhook.post(webhook_body(message))
            except RuntimeError:          # the sink closed: the session is ending
                log.info("live session %s: incident %s not posted (webhook closed)", self.session_id,
                         message.incident_id)

    def close(self) -> None:
        """Blocking (the webhook's queue is flushed): call off the loop."""
        if self.webhook is not None:
            self.webhook.close()


__all__ = ["RULE_REQUESTS", "LiveRules", "check_webhook", "incident_message", "rule_id_of", "rule_message", "rule_of",
           "webhook_body"]
