from .base import DataSource, Precision, StageConfig, StrictModel
from .cpt import CptConfig
from .eval import EvalConfig
from .model import ModelConfig
from .pipeline import STAGE_CONFIGS, PipelineConfig, StoreConfig, expand_env, load_pipeline, load_yaml, validate_model
from .sft import SftConfig
from .tokenizer import TokenizerConfig

__all__ = [
    "STAGE_CONFIGS",
    "CptConfig",
    "DataSource",
    "EvalConfig",
    "ModelConfig",
    "PipelineConfig",
    "Precision",
    "SftConfig",
    "StageConfig",
    "StoreConfig",
    "StrictModel",
    "TokenizerConfig",
    "expand_env",
    "load_pipeline",
    "load_yaml",
    "validate_model",
]
