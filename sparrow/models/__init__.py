"""Target and draft models."""

from .draft import DraftConfig, SparrowDraft
from .target import PrefillOutput, TargetModel, TargetState

__all__ = ["TargetModel", "TargetState", "PrefillOutput", "SparrowDraft", "DraftConfig"]
