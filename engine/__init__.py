"""Generation engine (KV cache, decoding, speculative decoding)."""
