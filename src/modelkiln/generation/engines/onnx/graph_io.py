"""The decoder graphs' tensor names: the contract between the graph writers (convert/generation/serving_graph.py,
convert/generation/decoder_export.py) and the runners that feed them (generation/runners.py).

Both kinds of graph take ``input_ids`` and per layer a past key and value, and return ``logits`` and
per layer a present key and value. The serving graph (metadata ``kiln.graph = serving``) adds
GroupQueryAttention's per-row lengths and the positions to compute logits for; the exported graph
takes an attention mask and position ids instead."""

INPUT_IDS, LOGITS = "input_ids", "logits"

# the exported graph (torch.export): [batch, past + seq] mask, [batch, seq] positions
ATTENTION_MASK, POSITION_IDS = "attention_mask", "position_ids"

# the serving graph
SEQLENS_K = "seqlens_k"  # int32 [batch]: each row's total length after this call, minus one
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"  # int32 scalar: the longest row's total length
# the serving graph built with KilnAttention (native/attention.c) takes, instead of the two above,
# each token's place: int64 [batch, sequence] each, aligned with input_ids
CACHE_ROWS = "cache_rows"  # the row of the bound KV cache its sequence owns
POSITIONS = "positions"  # its position in that row (-1: padding, computed as nothing)
LOGIT_POSITIONS = "logit_positions"  # int64 [positions]: which tokens get logits, as indices into the
# call's [batch × sequence] tokens flattened row by row (the serving graph's logits are [positions, vocab])

GRAPH_KIND_KEY = "kiln.graph"  # model metadata: which of the two contracts a graph follows
SERVING_GRAPH = "serving"
# model metadata of a KilnAttention graph whose key cache is kept in blocks of KEY_BLOCK positions,
# dimension-major (KilnAttention's ``key_blocks``, native/attention.c); absent: position-major
KEY_CACHE_KEY, KEY_BLOCKS = "kiln.key_cache", "blocks16"
KEY_BLOCK = 16


def past_key_name(i: int) -> str:
    return f"past_key_values.{i}.key"


def past_value_name(i: int) -> str:
    return f"past_key_values.{i}.value"


def present_key_name(i: int) -> str:
    return f"present.{i}.key"


def present_value_name(i: int) -> str:
    return f"present.{i}.value"
