"""Pure quantizer functions (no state): rotation, codebooks, polar, QJL, integers, low rank, PQ, bit packing."""
