"""dilforge curate stage: raw web text → a clean, deduplicated, contact-free corpus, on datatrove."""
