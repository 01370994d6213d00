"""dilforge SFT stage: LoRA fine-tuning of a CPT model into an Azerbaijani assistant (assistant-only loss)."""
