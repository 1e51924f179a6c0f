"""The UTF-8 byte length of every token of a tokenizer's vocabulary, for bits
per byte: ``token_bytes(tokenizer)[ids].sum()`` is the number of bytes of the
text ``ids`` encode."""
from __future__ import annotations

import json
import operator
import re
from functools import lru_cache
from typing import Any, Dict, Iterable, Optional, Set

import numpy as np

from ._engine.types import I64Array

_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's whitespace


@lru_cache(maxsize=1)
def _byte_level_decoder() -> Dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: the printable character
    a byte-level BPE vocabulary writes for each byte, back to the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _utf8_len(s: str) -> int:
    return len(s.encode("utf-8"))


def _types(node: Any) -> Set[str]:
    """Every component "type" in a tokenizers JSON subtree (Sequence nests)."""
    out: Set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            out.add(node["type"])
        for v in node.values():
            out |= _types(v)
    elif isinstance(node, list):
        for v in node:
            out |= _types(v)
    return out


def _metaspace(node: Any) -> Optional[str]:
    """The replacement of the first Metaspace component in a tokenizers JSON
    subtree (Sequence nests), None without one."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and isinstance(node.get("replacement"), str):
            return str(node["replacement"])
        node = list(node.values())
    if isinstance(node, list):
        for v in node:
            found = _metaspace(v)
            if found is not None:
                return found
    return None


def _from_tokenizers(tok: Any, special_ids: Iterable[int], size_hint: int,
                     wrapper_unk: Optional[int] = None) -> I64Array:
    """A ``tokenizers.Tokenizer``: the scheme comes from its decoder and
    pre-tokenizer (byte-level, SentencePiece-style byte fallback / ▁, else
    the token text as is). wrapper_unk: the unknown token's id that a
    transformers tokenizer over it names (``unk_token_id``)."""
    spec = json.loads(tok.to_str())
    kinds = _types(spec.get("decoder")) | _types(spec.get("pre_tokenizer")) | _types(spec.get("normalizer"))
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in kinds
    byte_fallback = bool(model.get("byte_fallback")) or "ByteFallback" in kinds
    spiece = (byte_fallback or "Metaspace" in kinds
              or _SPIECE_SPACE in json.dumps(spec.get("decoder"), ensure_ascii=False))
    # the character that stands for a space: Metaspace's replacement ("▁"
    # unless set otherwise)
    space = _metaspace([spec.get("pre_tokenizer"), spec.get("decoder")]) or _SPIECE_SPACE
    # WordPiece's "##": the model's continuing_subword_prefix (a raw
    # tokenizer need have no decoder), else the WordPiece decoder's
    wordpiece_prefix = model.get("continuing_subword_prefix") or None
    if wordpiece_prefix is None and spec.get("decoder") and spec["decoder"].get("type") == "WordPiece":
        wordpiece_prefix = spec["decoder"].get("prefix", "##")
    # openai-gpt / CLIP: a word-final token carries the model's suffix
    # ("the</w>"), a word boundary the decoder writes as one space
    suffix = model.get("end_of_word_suffix") or ""

    added = tok.get_added_tokens_decoder()  # {id: AddedToken}
    vocab = tok.get_vocab(with_added_tokens=False)
    n = max([size_hint, tok.get_vocab_size(with_added_tokens=True)] +
            [i + 1 for i in vocab.values()] + [i + 1 for i in added])
    out = np.zeros(n, np.int64)
    bd = _byte_level_decoder() if byte_level else None
    for piece, i in vocab.items():
        boundary = 0
        if suffix and piece.endswith(suffix):
            piece, boundary = piece[:-len(suffix)], 1
        if wordpiece_prefix and piece.startswith(wordpiece_prefix):
            piece = piece[len(wordpiece_prefix):]
        if bd is not None:
            out[i] = sum(1 if ch in bd else _utf8_len(ch) for ch in piece)
        elif byte_fallback and _BYTE_PIECE.match(piece):
            out[i] = 1
        elif spiece:
            out[i] = _utf8_len(piece.replace(space, " "))
        else:
            out[i] = _utf8_len(piece)
        out[i] += boundary
    _set_added(out, added, [i for i, t in added.items() if vocab.get(getattr(t, "content", None)) == i])
    # the model's unknown token stands for text it has no piece for: no bytes,
    # as SentencePiece's, also where it is not an added token (BPE's and
    # WordPiece's by its text; a Unigram's by its unk_id, unless a
    # transformers tokenizer over it names another unknown token: its XLM-R
    # built over a vocabulary without fairseq's four tokens first points
    # unk_id at a real piece)
    unk = vocab.get(model.get("unk_token") or "")
    unk_id = model.get("unk_id")
    if (unk is None and model.get("type") == "Unigram" and isinstance(unk_id, int)
            and wrapper_unk in (None, unk_id)):
        unk = unk_id
    for i in [*special_ids, *([] if unk is None else [unk])]:
        if 0 <= i < n:
            out[i] = 0
    if byte_fallback:
        # byte pieces a tokenizers trainer was given as special_tokens (the
        # usual way to put <0x00>..<0xFF> in the vocabulary) are special added
        # tokens, which a transformers wrapper may list again as special
        # (additional_special_tokens), and still one byte each: the model
        # emits them for text it has no piece for, and the ByteFallback
        # decoder writes them
        for i, t in added.items():
            if _BYTE_PIECE.match(getattr(t, "content", "")):
                out[i] = 1
    return out


def _from_sentencepiece(sp: Any, size_hint: int) -> I64Array:
    """A ``sentencepiece.SentencePieceProcessor``: byte pieces ``<0xAB>`` are
    one byte, ``▁`` a space; control, unknown and unused pieces 0."""
    n = sp.get_piece_size()
    out = np.zeros(max(n, size_hint), np.int64)
    for i in range(n):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            continue
        out[i] = 1 if sp.is_byte(i) else _utf8_len(sp.id_to_piece(i).replace(_SPIECE_SPACE, " "))
    return out


def _from_sentencepiece_wrapper(tok: Any, size_hint: int) -> I64Array:
    """A transformers tokenizer over a ``sentencepiece`` model (``sp_model``).
    Its ids need not be the model's (PLBart's fairseq offset of 1, M2M100's
    and Speech2Text's own vocabulary files, Bartpho's reduced one): each id
    goes through its token to the piece of that text. Added tokens count
    their text (0 when special), but for those that are also a piece of the
    model (its user-defined pieces, Gemma's "▁▁"), which count as the piece;
    a token that is neither a piece nor an added token counts 0, as an id
    with no token."""
    sp = tok.sp_model
    pieces = _from_sentencepiece(sp, 0)
    added = getattr(tok, "added_tokens_decoder", {})
    n = max([size_hint] + [i + 1 for i in added])
    out = np.zeros(n, np.int64)
    kept = []
    for i in range(n):
        if i in added:
            # an added token that is also a piece of the model (a user-defined piece, Gemma's "▁▁"): the
            # piece's count, as a tokenizers model's (`_set_added`)
            text = getattr(added[i], "content", None)
            j = sp.piece_to_id(text) if isinstance(text, str) else 0
            if sp.id_to_piece(j) == text and not (sp.is_control(j) or sp.is_unknown(j) or sp.is_unused(j)):
                out[i] = pieces[j]
                kept.append(i)
            continue
        try:
            token = tok.convert_ids_to_tokens(i)
        except (IndexError, KeyError):  # a gap below an added token's id
            continue
        if isinstance(token, str):
            j = sp.piece_to_id(token)
            if sp.id_to_piece(j) == token:
                out[i] = pieces[j]
    _set_added(out, added, kept)
    return out


def _from_byte_ids(tok: Any, size_hint: int) -> I64Array:
    """A transformers tokenizer whose ids stand for the 256 byte values,
    after ``offset`` ids of its own (ByT5: pad, EOS, unknown, then one id a
    byte, then its extra ids): a byte's id is one byte, an added token
    counts its text (0 when special)."""
    added = getattr(tok, "added_tokens_decoder", {})
    n = max([size_hint, int(tok.offset) + int(tok._utf_vocab_size)] + [i + 1 for i in added])
    out = np.zeros(n, np.int64)
    out[int(tok.offset):int(tok.offset) + int(tok._utf_vocab_size)] = 1
    _set_added(out, added)
    return out


def _set_added(out: I64Array, added: Dict[int, Any], pieces: Iterable[int] = ()) -> None:
    """Added tokens (id: tokenizers' or transformers' ``AddedToken``) into
    out: each matches, and decodes to, its own text, whose bytes it counts;
    0 when special. pieces: the ids of added tokens that are also the
    model's piece of their text (SentencePiece's user-defined pieces, as
    Gemma's whitespace runs "▁▁"), which keep the piece's count: the model
    emits them for the text the piece stands for (two spaces, not the 6
    bytes of "▁▁")."""
    keep = set(pieces)
    for i, t in added.items():
        if getattr(t, "special", False):
            out[i] = 0
        elif i not in keep:
            out[i] = _utf8_len(getattr(t, "content", str(t)))


def _from_tiktoken(enc: Any) -> I64Array:
    n = int(enc.n_vocab)
    out = np.zeros(n, np.int64)
    special = set(getattr(enc, "_special_tokens", {}).values())
    for s in getattr(enc, "special_tokens_set", ()):
        special.add(enc.encode_single_token(s))
    for i in range(n):
        if i in special:
            continue
        try:
            out[i] = len(enc.decode_single_token_bytes(i))
        except KeyError:  # a gap in the ids
            pass
    return out


def _is_tiktoken(x: Any) -> bool:
    return hasattr(x, "decode_single_token_bytes") and hasattr(x, "n_vocab")


def _is_tokenizers(x: Any) -> bool:
    """A ``tokenizers.Tokenizer`` (duck-typed)."""
    return hasattr(x, "to_str") and hasattr(x, "get_added_tokens_decoder")


def _integer(x: Any) -> Optional[int]:
    """x as a Python int when it is an integer (int, numpy's integers), not a bool."""
    if isinstance(x, (bool, np.bool_)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def token_bytes(tokenizer: Any, *, size: Optional[int] = None) -> I64Array:
    """The number of UTF-8 bytes each token of a tokenizer's vocabulary stands for.

    0 for special and control tokens (BOS, EOS, pad, unknown), nanochat's
    convention. The bytes are those the tokenizer itself maps a token to, not
    those of decoding tokens one at a time (a byte-level token holding part
    of a UTF-8 character decodes alone to U+FFFD, 3 bytes). Supported:

    * transformers tokenizers backed by ``tokenizers`` (``PreTrainedTokenizerFast``,
      ``TokenizersBackend``) and raw ``tokenizers.Tokenizer``: byte-level BPE
      (GPT-2, Llama 3, Qwen: each character of a token is one byte through the
      inverse of GPT-2's ``bytes_to_unicode``); SentencePiece-style
      vocabularies (Llama 2, Mistral, Gemma: ``<0xAB>`` byte-fallback tokens
      are one byte, ``▁``, or Metaspace's own ``replacement``, is a space);
      the continuation prefix (WordPiece's ``##``, the model's
      ``continuing_subword_prefix``) is dropped;
      end-of-word suffixes (openai-gpt, CLIP: ``"the</w>"``) are one byte,
      the space the decoder writes for them; any other token counts the
      UTF-8 bytes of its text. Added tokens that are not special count their
      text, but for those that are also the model's piece of that text
      (Gemma's whitespace runs ``"▁▁"``: two spaces), which count as the
      piece.
    * ``sentencepiece.SentencePieceProcessor`` and transformers tokenizers
      wrapping one (``sp_model``; an added token that is also a piece of
      the model, as Gemma's ``"▁▁"``, counts as the piece there too).
    * transformers' byte tokenizer (ByT5's): each byte's id is one byte.
    * tiktoken ``Encoding`` (``decode_single_token_bytes``).
    * nanochat's tokenizers: ``RustBPETokenizer`` (its tiktoken ``.enc``) and
      ``HuggingFaceTokenizer`` (its ``tokenizers.Tokenizer``, ``.tokenizer``).

    The sum over an encoding is the byte length of the text the tokenizer
    actually encoded: SentencePiece's dummy prefix (``add_dummy_prefix``, or
    Metaspace's ``prepend_scheme="first"``) adds a ``▁`` the text did not
    have (one byte more per encoded text), as a byte-level pre-tokenizer's
    ``add_prefix_space=True`` adds a ``Ġ``, and a normalizer that rewrites the
    text (NFKC, collapsing spaces) changes its byte count. A pre-tokenizer
    that drops whitespace (BERT's ``BertPreTokenizer``, ``Whitespace``,
    ``WhitespaceSplit``) leaves it in no token: a WordPiece sum is the byte
    length of the text without its whitespace (``"the fox"``: 6), and
    XLM-R's (``WhitespaceSplit``, then ``▁``) counts each run of whitespace
    as one space; the whitespace an added token with ``lstrip`` or
    ``rstrip`` takes is in no token either (``"a <m> b"``: 5). Text the
    vocabulary has no piece for (a vocabulary without byte fallback) is the
    unknown token, 0 bytes: the sum falls short of that text's bytes, and
    bits per byte (nanochat's: tokens of 0 bytes leave both sums) is over
    the rest of the text, where lm-eval's ``bits_per_byte`` divides the NLL
    of every token by the whole text's bytes. An end-of-word
    suffix tokenizer drops the whitespace and splits off punctuation: its
    sum is the byte length of the text as it decodes (words and punctuation
    each followed by one space: ``"the fox, jumps. "``), one byte more than
    a text of words separated by single spaces.

    Parameters
    ----------
    tokenizer : object
        One of the tokenizers above.
    size : int or None, default None
        The length of the table: the model's logits width, often padded past
        the tokenizer (the extra ids get 0). ``len(tokenizer)`` (the
        vocabulary with added tokens) when None.

    Returns
    -------
    numpy.ndarray
        int64, one entry per token id.

    Raises
    ------
    TypeError
        A tokenizer of a kind not listed above.
    ValueError
        A ``size`` that is not an integer >= the vocabulary's.

    Examples
    --------
    >>> import lmmetrics
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> tok = Tokenizer(models.BPE({"a": 0, "Ã": 1, "©": 2, "Ã©": 3}, [("Ã", "©")]))
    >>> tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    >>> lmmetrics.token_bytes(tok, size=5)          # "Ã©" stands for the two bytes of "é"; id 4 pads
    array([1, 1, 1, 2, 0])
    """
    special: Set[int] = set()
    size_hint = 0
    # nanochat's tokenizer objects wrap a tiktoken Encoding (RustBPETokenizer.enc)
    # or a tokenizers.Tokenizer (HuggingFaceTokenizer.tokenizer)
    if not (_is_tiktoken(tokenizer) or _is_tokenizers(tokenizer) or hasattr(tokenizer, "all_special_ids")):
        inner = getattr(tokenizer, "enc", None) or getattr(tokenizer, "tokenizer", None)
        if _is_tiktoken(inner) or _is_tokenizers(inner):
            tokenizer = inner
    if _is_tiktoken(tokenizer):
        out = _from_tiktoken(tokenizer)
    else:
        if hasattr(tokenizer, "all_special_ids"):  # transformers
            special = {int(i) for i in tokenizer.all_special_ids if i is not None}
            size_hint = len(tokenizer)
        if hasattr(tokenizer, "backend_tokenizer"):
            out = _from_tokenizers(tokenizer.backend_tokenizer, special, size_hint,
                                   _integer(getattr(tokenizer, "unk_token_id", None)))
            special = set()  # (zeroed there, but for byte-fallback pieces)
        elif hasattr(tokenizer, "sp_model"):
            out = _from_sentencepiece_wrapper(tokenizer, size_hint)
        elif hasattr(tokenizer, "offset") and getattr(tokenizer, "_utf_vocab_size", None) == 256:
            out = _from_byte_ids(tokenizer, size_hint)
        elif hasattr(tokenizer, "is_byte") and hasattr(tokenizer, "id_to_piece"):
            out = _from_sentencepiece(tokenizer, 0)
        elif _is_tokenizers(tokenizer):
            out = _from_tokenizers(tokenizer, special, 0)
        else:
            raise TypeError(
                f"token_bytes: unsupported tokenizer {type(tokenizer).__name__}; expected a transformers "
                f"tokenizer over tokenizers (backend_tokenizer) or sentencepiece (sp_model), ByT5's, a "
                f"tokenizers.Tokenizer, a sentencepiece.SentencePieceProcessor, a tiktoken Encoding or a "
                f"nanochat tokenizer")
        for i in special:
            if 0 <= i < out.shape[0]:
                out[i] = 0
    if size is not None:
        n = _integer(size)
        if n is None or n < out.shape[0]:
            raise ValueError(f"size must be an integer >= the tokenizer's vocabulary ({out.shape[0]}), got {size!r}")
        out = np.concatenate([out, np.zeros(n - out.shape[0], np.int64)])
    return out
