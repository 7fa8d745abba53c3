"""Speculative decoding: draft tokens proposed cheaply (prompt lookup, a draft model) and verified by
the target model in the same batched forward as the last committed token (docs in README)."""
