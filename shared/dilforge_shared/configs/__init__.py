"""One pydantic model per stage config (`<stage>.py`) and what they share (`base.py`); import the one you need."""
