"""dilforge CPT stage: continued pre-training with vocabulary transplant, two phases, FSDP2 and Liger."""

__version__ = "0.1.0"
