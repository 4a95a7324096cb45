"""Model building blocks, one concept a file (linear, embedding, norm, rotary, attention, moe)."""
