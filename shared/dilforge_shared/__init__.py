"""dilforge's own library: the contract every stage and the coordinator share; nothing here imports torch."""

import re

# The shape every control token of the known families has (<|eot_id|>, <|im_start|>, <|reserved_special_token_3|>):
# text a user gave holding one would forge a turn, so curate strips them and the other stages refuse them.
CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]{1,64}\|>")
