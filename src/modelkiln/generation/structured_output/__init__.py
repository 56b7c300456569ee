"""Structured outputs: grammars (llguidance), their bitmasks, and closing an answer within its budget."""
