"""The decoder graph's tensor names: the contract between the exporter (convert/decoder_export.py)
and the engine (decoder.py)."""
INPUT_IDS, ATTENTION_MASK, POSITION_IDS, LOGITS = "input_ids", "attention_mask", "position_ids", "logits"


def past_key_name(i: int) -> str:
    return f"past_key_values.{i}.key"


def past_value_name(i: int) -> str:
    return f"past_key_values.{i}.value"


def present_key_name(i: int) -> str:
    return f"present.{i}.key"


def present_value_name(i: int) -> str:
    return f"present.{i}.value"
