"""Target and draft models."""

from .draft import DraftConfig, SparrowDraft
from .prefill import PrefillOutput, TargetState
from .target import TargetModel

__all__ = ["TargetModel", "TargetState", "PrefillOutput", "SparrowDraft", "DraftConfig"]
