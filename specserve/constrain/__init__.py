"""Constrained decoding: grammars (JSON schemas, tool-call formats) compiled by xgrammar, one
matcher per constrained sequence, and the masks the engine applies to the target's logits."""
