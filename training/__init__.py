"""Sparrow draft training: online distillation from a frozen target, its data, feature store and
evaluation (the synthetic world that trains a tiny target is sparrow.world).   import: sparrow.training"""

from .config import TrainConfig
from .data import Sample, load_samples, write_manifest
from .evaluate import TauReport, held_out_tau
from .feature_store import FeatureStore, StoreConfig, build_store
from .trainer import DraftTrainer, new_draft

__all__ = ["DraftTrainer", "FeatureStore", "Sample", "StoreConfig", "TauReport", "TrainConfig", "build_store",
           "held_out_tau", "load_samples", "new_draft", "write_manifest"]
