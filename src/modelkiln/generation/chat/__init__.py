"""Chats: templates rendered as transformers renders them, their token ids, and tool calls."""
