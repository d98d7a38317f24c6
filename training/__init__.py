"""Sparrow draft training: online distillation from a frozen target, its data, feature store and
evaluation (the synthetic world that trains a tiny target is sparrow.world).   import: sparrow.training"""

from sparrow.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "TrainConfig": "config", "Sample": "data", "load_samples": "data", "write_manifest": "data",
    "TauReport": "evaluate", "held_out_tau": "evaluate", "FeatureStore": "feature_store",
    "StoreConfig": "feature_store", "build_store": "feature_store", "DraftTrainer": "trainer", "new_draft": "trainer"})

__all__ = ["DraftTrainer", "FeatureStore", "Sample", "StoreConfig", "TauReport", "TrainConfig", "build_store",
           "held_out_tau", "load_samples", "new_draft", "write_manifest"]
