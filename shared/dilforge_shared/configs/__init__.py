"""What the stage config sections share: the base types (`base.py`), CPT and SFT's knobs, the language settings.
Each section is its stage package's `config.py`."""
