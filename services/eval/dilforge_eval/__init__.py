"""dilforge eval stage: did the tokenizer, CPT and SFT make the model better at Azerbaijani, and at what cost."""
