"""The Ray Serve application builder a RayService (or `serve run`/`serve deploy`) names:

    import_path: sparrow.services.ray_entry:app_builder
    args:
      settings_file: /etc/sparrow/settings.yaml     # optional: AppSettings as YAML (a ConfigMap)
      target: /models/target                        # any AppSettings field, overriding the file
      service: {max_new_tokens: 1024}               # nested dataclasses merge key by key

Serve calls `app_builder(args)` once per deploy, in its build task, and ships the result to
the replicas: the settings file must be readable there (mount the ConfigMap on every Ray
pod). Deployment options (replicas, autoscaling, ray_actor_options) belong in the Serve
config's `deployments:` list, which overrides what the code sets; `target_deployment` /
`draft_deployment` here are the code-side defaults under those.

Unknown keys are an error: a typo in a ConfigMap must fail the deploy, not be ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparrow.config import SpecConfig
from sparrow.models.draft import DraftArchitecture
from sparrow.config import EngineConfig

from .config import ServiceConfig
from .settings import AppSettings

SETTINGS_FILE_KEY = "settings_file"
NESTED = {"spec": SpecConfig, "service": ServiceConfig, "engine": EngineConfig, "draft_arch": DraftArchitecture}     # AppSettings fields that are dataclasses


def app_builder(args: dict):
    """Serve config `args` -> the Sparrow application (ray_app.build_app)."""
    from .ray_app import build_app      # Ray is imported only when an app is built

    return build_app(settings_from_args(args))


def settings_from_args(args: Mapping[str, Any] | None) -> AppSettings:
    """AppSettings from a settings file (if named) overlaid with the inline args."""
    args = dict(args or {})
    path = args.pop(SETTINGS_FILE_KEY, None)
    merged = _merge(load_settings_file(path) if path else {}, args)
    _reject_unknown(merged, AppSettings, "settings")
    values = dict(merged)
    for name, cls in NESTED.items():
        if name in values:
            given = values[name] or {}
            if not isinstance(given, Mapping):
                raise ValueError(f"settings.{name} must be a mapping, got {type(given).__name__}")
            _reject_unknown(given, cls, f"settings.{name}")
            values[name] = cls(**_coerce(cls, given))
            if name == "spec":
                values["spec_given"] = frozenset(given)
    return AppSettings(**_coerce(AppSettings, values))


def load_settings_file(path: str | Path) -> dict:
    import yaml     # a dependency of ray[serve], so present wherever this runs

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: settings must be a YAML mapping, got {type(data).__name__}")
    return data


def _merge(base: Mapping, override: Mapping) -> dict:
    """Override wins; mappings merge key by key (so `service: {max_new_tokens: ...}` inline
    keeps the file's other service limits)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _reject_unknown(given: Mapping, cls, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"unknown {where} key(s) {unknown}; known: {sorted(known)}")


def _coerce(cls, given: Mapping) -> dict:
    """YAML has lists where the frozen dataclasses hold tuples (hashable, immutable)."""
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    return {key: tuple(value) if isinstance(value, list) and "tuple" in types[key] else value
            for key, value in given.items()}
