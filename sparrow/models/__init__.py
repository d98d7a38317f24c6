"""Target and draft models (loaded on first use: placement's settings import without torch)."""

from ..lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"DraftConfig": "draft", "SparrowDraft": "draft", "PrefillOutput": "prefill",
                                      "TargetState": "prefill", "TargetModel": "target"})

__all__ = ["TargetModel", "TargetState", "PrefillOutput", "SparrowDraft", "DraftConfig"]
