"""Model definitions, checkpoint loading and tokenizers."""
