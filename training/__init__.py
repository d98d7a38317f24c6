"""Sparrow draft training (online distillation from a frozen target) and the synthetic video
world that gives a tiny target something real to know.   import: sparrow.training"""

from .config import TrainConfig
from .data import Sample, load_samples, write_manifest
from .evaluate import TauReport, held_out_tau
from .feature_store import FeatureStore, StoreConfig, build_store
from .trainer import DraftTrainer, new_draft

__all__ = ["DraftTrainer", "FeatureStore", "Sample", "StoreConfig", "TauReport", "TrainConfig", "build_store",
           "held_out_tau", "load_samples", "new_draft", "write_manifest"]
