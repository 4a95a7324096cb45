"""A cheap lower bound on a text's token count, to refuse an over-long prompt before tokenising it.

Every token of a byte-level BPE covers at most M bytes of the (normalised)
input, M being its longest vocabulary entry or added token, so a text of B
bytes has at least B / M tokens. Normalisers that map characters to other
characters (NFC, NFKC, lowercase) can shrink a character from 4 bytes to 1,
so they widen M by 4. A pipeline that can drop text (strip, whitespace
splitting, accent removal, fused unknown tokens) or truncates has no such
bound; the server then tokenises everything (off the event loop) and counts.
"""

from __future__ import annotations

import json

# Normalisers that rewrite characters one by one (or compose a few): none deletes text.
_MAPPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_MAPPING_SHRINK = 4  # the most UTF-8 bytes one character has, over the fewest it can become
# Pre-tokenisers that keep every character (Split and Punctuation unless their behaviour is "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Metaspace", "UnicodeScripts"}


def _components(node: dict | None, sequence_key: str) -> list[dict] | None:
    """The steps of a normaliser or pre-tokeniser (a Sequence flattened); None if malformed."""
    if node is None:
        return []
    if not isinstance(node, dict):
        return None
    if node.get("type") == "Sequence":
        steps: list[dict] = []
        for child in node.get(sequence_key) or []:
            flat = _components(child, sequence_key)
            if flat is None:
                return None
            steps.extend(flat)
        return steps
    return [node]


def max_bytes_per_token(tokenizer) -> int | None:
    """Bytes of input one token can cover at most (normalisation included); None if unbounded."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") is not None:
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")):
        return None
    normalizers = _components(spec.get("normalizer"), "normalizers")
    if normalizers is None or any(n.get("type") not in _MAPPING_NORMALIZERS for n in normalizers):
        return None
    pre_tokenizers = _components(spec.get("pre_tokenizer"), "pretokenizers")
    if pre_tokenizers is None or any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
                                     for p in pre_tokenizers):
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in pre_tokenizers)
    # Byte-level vocabularies spell each input byte as one character; others hold the text itself
    # (a Metaspace "▁" is 3 bytes for the 1-byte space it stands for: an overestimate, which is safe).
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    longest = max((len(t) if byte_level else len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    added = tokenizer.get_added_tokens_decoder().values()
    longest = max([longest, *(len(a.content.encode("utf-8", "surrogatepass")) for a in added)])
    return max(1, longest) * (_MAPPING_SHRINK if normalizers else 1)


def cannot_fit(num_chars: int, max_model_len: int, bytes_per_token: int | None) -> int | None:
    """The fewest tokens a text of `num_chars` characters has, when that alone leaves no room in
    the context; else None. (Characters, not bytes: a character is at least one byte, so the
    bound holds and costs nothing to compute.)"""
    if bytes_per_token is None:
        return None
    fewest = -(-num_chars // bytes_per_token)
    return fewest if fewest >= max_model_len else None
