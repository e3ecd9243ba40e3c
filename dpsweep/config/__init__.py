"""Typed configuration: one module per config group, each with its schema dataclasses and its checks.

The groups are :mod:`.dataset`, :mod:`.model`, :mod:`.task` (each task's own settings), :mod:`.dp`,
:mod:`.optimizer`, :mod:`.train`, :mod:`.tracking`, :mod:`.sweep` and :mod:`.launcher`; :mod:`.schema`
holds the root :class:`Config` (registered in Hydra's ConfigStore, flattened, hashed), and
:func:`validate` runs the groups' checks in one fixed order (:mod:`.validation`), each failure a
:class:`ConfigError` naming the key, the bad value and what is allowed. Import every name from here.
"""

from __future__ import annotations

from dpsweep.config.audit import AuditConfig
from dpsweep.config.checks import ConfigError
from dpsweep.config.dataset import (
    NATURAL_USER_DATASETS,
    USER_ASSIGNMENTS,
    DatasetConfig,
    DigitsConfig,
    Flowers102Config,
    MovieLensConfig,
    PlantedRatingsConfig,
    RatingsConfig,
    TorchvisionDatasetConfig,
    validate_for_dataset,
)
from dpsweep.config.dp import (
    RENAMED_MODES,
    UNITS,
    Accountant,
    Clipping,
    DPConfig,
    GradSampleMode,
    PrivacyUnit,
    QuantileMethod,
    RdpOrders,
    UnitFacts,
    population,
    step_kind,
)
from dpsweep.config.launcher import LauncherConfig, trials_per_device, validate_launcher
from dpsweep.config.model import CNNConfig, MLPConfig, ModelConfig, VGG16FrozenConfig
from dpsweep.config.optimizer import AdamConfig, OptimizerConfig, SGDConfig
from dpsweep.config.schema import (
    NON_IDENTITY_PREFIXES,
    SWEEPER_KEYS,
    TASK_SECTIONS,
    Config,
    flatten,
    given_overrides,
    identity,
    identity_hash,
    register_configs,
    settings,
    structured,
    to_config,
)
from dpsweep.config.sweep import SweepConfig
from dpsweep.config.task import (
    GAN_IMAGE_SHAPE,
    ClassifierTaskConfig,
    GanTaskConfig,
    RecommenderTaskConfig,
    TaskConfig,
    shown_model,
    task_objectives,
    task_schemas,
    validate_input_shape,
)
from dpsweep.config.tracking import TrackingConfig
from dpsweep.config.train import RANK_KEYS, Device, TrainConfig, ranks_shape, world_size
from dpsweep.config.validation import validate

__all__ = [
    "GAN_IMAGE_SHAPE",
    "NATURAL_USER_DATASETS",
    "NON_IDENTITY_PREFIXES",
    "RANK_KEYS",
    "RENAMED_MODES",
    "SWEEPER_KEYS",
    "TASK_SECTIONS",
    "UNITS",
    "USER_ASSIGNMENTS",
    "Accountant",
    "AdamConfig",
    "AuditConfig",
    "CNNConfig",
    "ClassifierTaskConfig",
    "Clipping",
    "Config",
    "ConfigError",
    "DPConfig",
    "DatasetConfig",
    "Device",
    "DigitsConfig",
    "Flowers102Config",
    "GanTaskConfig",
    "GradSampleMode",
    "LauncherConfig",
    "MLPConfig",
    "ModelConfig",
    "MovieLensConfig",
    "OptimizerConfig",
    "PlantedRatingsConfig",
    "PrivacyUnit",
    "QuantileMethod",
    "RatingsConfig",
    "RdpOrders",
    "RecommenderTaskConfig",
    "SGDConfig",
    "SweepConfig",
    "TaskConfig",
    "TorchvisionDatasetConfig",
    "TrackingConfig",
    "TrainConfig",
    "UnitFacts",
    "VGG16FrozenConfig",
    "flatten",
    "given_overrides",
    "identity",
    "identity_hash",
    "population",
    "ranks_shape",
    "register_configs",
    "settings",
    "shown_model",
    "step_kind",
    "structured",
    "task_objectives",
    "task_schemas",
    "to_config",
    "trials_per_device",
    "validate",
    "validate_for_dataset",
    "validate_input_shape",
    "validate_launcher",
    "world_size",
]
