"""token_bytes: summed over a tokenizer's own encoding of a text, the token
byte lengths give the text's UTF-8 length, for tokenizers trained here:
byte-level BPE (tokenizers, raw and wrapped by transformers) and
SentencePiece BPE with byte fallback (sentencepiece, and a transformers
tokenizer over the same vocabulary); tiktoken when installed."""
import io

import numpy as np
import pytest

import lmmetrics

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café 日本語 🙂",
    "Ünïcödé façade — Здравствуй, мир! مرحبا بالعالم",
    "中文字符与한국어 mixed with ελληνικά and emoji 👍🏽🎉 (not in the corpus)",
    "tabs\tand\nnewlines  and   runs of spaces, digits 12345 and ½ ¾ ∑ ∞",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "naïve café résumé coöperate Ünïcödé façade",
    "日本語のテキスト、そして中文。",
    "Здравствуй, мир! Привет всем.",
    "مرحبا بالعالم",
    "hello world, this is a small corpus for a small tokenizer 0123456789",
] * 40


def utf8(text):
    return len(text.encode("utf-8"))


# ----------------------------------------------------------------- byte-level BPE (tokenizers)

@pytest.fixture(scope="module", params=["gpt2", "llama3"])
def byte_level(request):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    if request.param == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # Llama 3: a regex split, then byte-level without its own regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+"), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_raw_tokenizer(byte_level, text):
    table = lmmetrics.token_bytes(byte_level)
    assert table.dtype == np.int64 and table.shape == (byte_level.get_vocab_size(with_added_tokens=True),)
    ids = byte_level.encode(text).ids
    assert byte_level.decode(ids) == text  # the tokenizer round-trips the text
    assert table[ids].sum() == utf8(text)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_transformers(byte_level, text):
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level.__class__.from_str(byte_level.to_str()),
                                               bos_token="<|endoftext|>", pad_token="<|pad|>")
    tok.add_tokens(["<tag>"])  # an added, non-special token counts its text
    table = lmmetrics.token_bytes(tok)
    assert table.shape == (len(tok),)
    assert table[tok.convert_tokens_to_ids(["<|endoftext|>", "<|pad|>"])].tolist() == [0, 0]
    text = f"{text} <tag> end"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<tag>") in ids
    assert table[ids].sum() == utf8(text)
    # special tokens in the ids count no bytes
    assert table[[tok.bos_token_id] + ids + [tok.pad_token_id]].sum() == utf8(text)


def test_byte_level_normalizer():
    """tokenizers' ByteLevel normalizer (rather than its pre-tokenizer) maps
    the bytes to the same characters: "Ġ" was 2 bytes, not a space."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    table = lmmetrics.token_bytes(tok)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert "Ġ" in "".join(tok.encode(text).tokens)
        assert table[ids].sum() == utf8(text)


def test_byte_level_prefix_space_is_one_byte_more():
    """add_prefix_space=True puts a space (Ġ) before a text that does not start with one: one
    byte more, as documented (as SentencePiece's dummy prefix)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    table = lmmetrics.token_bytes(tok)
    for text in TEXTS:
        assert table[tok.encode(text).ids].sum() == utf8(text) + 1
    assert table[tok.encode(" the fox").ids].sum() == utf8(" the fox")


def test_unknown_token_of_a_raw_tokenizer_is_zero():
    """The model's unknown token counts no bytes where it is not an added
    token too (it counted the 5 bytes of "[UNK]"), as SentencePiece's."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    for model in (models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"),
                  models.BPE({"a": 0, "b": 1, "[UNK]": 2}, [], unk_token="[UNK]")):
        tok = tokenizers.Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece() if isinstance(model, models.WordPiece) else None
        enc = tok.encode("ab x")
        assert enc.ids[-1] == tok.token_to_id("[UNK]"), enc.tokens
        table = lmmetrics.token_bytes(tok)
        assert table[tok.token_to_id("[UNK]")] == 0 and sorted(table.tolist()) == [0, 1, 1]
        assert table[enc.ids].sum() == 2


def test_unknown_piece_of_a_unigram_model_is_zero():
    """A Unigram model names its unknown piece by id (unk_id), which
    UnigramTrainer(unk_token=...) puts in the vocabulary without adding it
    as a token: it counts no bytes, as BPE's and WordPiece's (each stretch
    of unknown text counted the 5 bytes of "<unk>"), raw and wrapped."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    tok.train_from_iterator([t for t in CORPUS if t.isascii()], trainers.UnigramTrainer(
        vocab_size=200, unk_token="<unk>", show_progress=False))
    unk = tok.token_to_id("<unk>")
    assert not tok.get_added_tokens_decoder()
    tables = [lmmetrics.token_bytes(tok)]
    transformers = pytest.importorskip("transformers")
    tables.append(lmmetrics.token_bytes(transformers.PreTrainedTokenizerFast(tokenizer_object=tok)))
    text = "the fox \x00 日本"
    enc = tok.encode(text)
    assert enc.ids.count(unk) == 2
    for table in tables:
        assert table[unk] == 0
        assert table[enc.ids].sum() == utf8(text) - utf8("\x00日本")


def test_the_decode_recipe_is_wrong_for_byte_level(byte_level):
    """One token at a time, a token holding part of a character decodes to
    U+FFFD: the old README recipe overcounts."""
    text = "naïve café 日本語 🙂"
    ids = byte_level.encode(text).ids
    recipe = sum(utf8(byte_level.decode([i])) for i in ids)
    assert recipe != utf8(text)
    assert lmmetrics.token_bytes(byte_level)[ids].sum() == utf8(text) == 27


# ----------------------------------------------------------------- SentencePiece with byte fallback

def train_sentencepiece(**extra):
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=0.98, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2, num_threads=1, **extra)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


@pytest.fixture(scope="module")
def sp():
    return train_sentencepiece(add_dummy_prefix=False)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_byte_fallback(sp, text):
    table = lmmetrics.token_bytes(sp)
    assert table.shape == (sp.get_piece_size(),)
    assert table[[sp.bos_id(), sp.eos_id(), sp.unk_id()]].tolist() == [0, 0, 0]
    ids = sp.encode(text)
    assert sp.decode(ids) == text and sp.unk_id() not in ids
    assert any(sp.is_byte(i) for i in ids) or text.isascii()
    assert table[ids].sum() == utf8(text)
    assert table[[sp.bos_id()] + ids + [sp.eos_id()]].sum() == utf8(text)


def test_byte_fallback_pieces_given_as_special_tokens_are_one_byte():
    """A byte-fallback BPE trained with tokenizers gets its <0x00>..<0xFF>
    pieces from the trainer's special_tokens (the usual recipe: they must be
    in the vocabulary), which makes them special added tokens; they still
    stand for one byte each (the ByteFallback decoder writes them), where
    they counted 0 and an encoding of CJK text or emoji fell short of its
    UTF-8 length, silently raising the bits per byte."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([t for t in CORPUS if t.isascii()], trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False))
    assert tok.get_added_tokens_decoder()[tok.token_to_id("<0xE6>")].special
    tables = [lmmetrics.token_bytes(tok)]
    transformers = pytest.importorskip("transformers")
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                   unk_token="<unk>")
    tables.append(lmmetrics.token_bytes(wrapped))
    # ... also where the wrapper names them special again (all_special_ids)
    listed = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>", additional_special_tokens=specials[3:])
    assert tok.token_to_id("<0xE6>") in listed.all_special_ids
    tables.append(lmmetrics.token_bytes(listed))
    for table in tables:
        assert table[tok.token_to_id("<0xE6>")] == 1
        assert table[[tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")]].tolist() == [0, 0, 0]
        for text in TEXTS:
            ids = tok.encode(text).ids
            assert tok.decode(ids, skip_special_tokens=False) == text
            assert table[ids].sum() == utf8(text), text


def test_metaspace_replacement_other_than_the_default():
    """Metaspace's replacement need not be "▁": a "Ġ" (2 bytes in UTF-8)
    stands for a space too (it counted 2 bytes a word, not 1)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    for replacement in ("\u0120", "\u2581"):
        tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=replacement, prepend_scheme="never")
        tok.decoder = decoders.Sequence([decoders.Metaspace(replacement=replacement, prepend_scheme="never"),
                                         decoders.ByteFallback(), decoders.Fuse()])
        specials = ["<unk>"] + [f"<0x{i:02X}>" for i in range(256)]
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                            show_progress=False))
        table = lmmetrics.token_bytes(tok)
        for text in TEXTS:
            ids = tok.encode(text).ids
            assert tok.decode(ids, skip_special_tokens=False) == text
            assert table[ids].sum() == utf8(text), (replacement, text)


def test_added_tokens_that_are_pieces_count_as_pieces():
    """Gemma's tokenizer: SentencePiece's user-defined pieces (whitespace
    runs "▁▁", "▁▁▁") are pieces of the model and non-special added tokens
    with the same ids; the model emits them for the spaces the normalizer
    turned into "▁": a space a byte (each counted the 3 bytes of "▁")."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, decoders, models, normalizers

    vocab = {"<unk>": 0, "<bos>": 1, "a": 2, "b": 3, "\u2581": 4, "\u2581\u2581": 5, "\u2581\u2581\u2581": 6,
             "\n": 7, "<td>": 8}
    vocab.update({f"<0x{i:02X}>": 9 + i for i in range(256)})
    tok = tokenizers.Tokenizer(models.BPE(vocab, [("\u2581", "\u2581"), ("\u2581\u2581", "\u2581")],
                                          unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ["\u2581\u2581", "\u2581\u2581\u2581",
                                                                            "\n", "<td>"]])
    tok.add_special_tokens([AddedToken("<bos>", normalized=False, special=True)])
    table = lmmetrics.token_bytes(tok)
    assert table[:9].tolist() == [0, 0, 1, 1, 1, 2, 3, 1, 4]
    for text in ["a  b", "a   b\nb <td>  a", "ab  \n\n   "]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        assert table[ids].sum() == utf8(text), text


def test_sentencepiece_dummy_prefix_is_one_byte_more():
    """With add_dummy_prefix (SentencePiece's default) the encoding starts
    with a ▁ the text does not have: one byte more, as documented."""
    sp = train_sentencepiece()
    table = lmmetrics.token_bytes(sp)
    for text in TEXTS:
        assert table[sp.encode(text)].sum() == utf8(text) + 1


@pytest.mark.parametrize("text", TEXTS)
def test_transformers_over_a_sentencepiece_vocabulary(sp, text):
    """A Llama-2-style transformers tokenizer (BPE with byte fallback,
    Metaspace, ByteFallback decoder) over the SentencePiece vocabulary, and
    transformers' own SentencePiece wrapper."""
    transformers = pytest.importorskip("transformers")
    from transformers.tokenization_utils_base import generate_merges

    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    fast = transformers.LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab), add_prefix_space=False)
    ids = fast.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)  # the same tokenizer
    table = lmmetrics.token_bytes(fast)
    assert table.shape == (len(fast),)
    assert table[ids].sum() == utf8(text)
    assert table[[fast.bos_token_id, fast.eos_token_id]].sum() == 0
    np.testing.assert_array_equal(table, lmmetrics.token_bytes(sp))


def _sentencepiece_backend(sp, tmp_path):
    """transformers' SentencePieceBackend over the model sp (skips where
    transformers or that class is absent)."""
    transformers = pytest.importorskip("transformers")
    backend = getattr(transformers, "SentencePieceBackend", None)
    if backend is None:
        pytest.skip("no transformers.SentencePieceBackend")
    path = tmp_path / "sp.model"
    path.write_bytes(sp.serialized_model_proto())
    return backend(vocab_file=str(path))


def test_transformers_sentencepiece_backend(sp, tmp_path):
    tok = _sentencepiece_backend(sp, tmp_path)
    table = lmmetrics.token_bytes(tok)
    assert table.shape == (len(tok),)
    for text in TEXTS:
        assert table[sp.encode(text)].sum() == utf8(text)


def sentencepiece_wrappers(sp, tmp_path):
    """transformers tokenizers over a SentencePiece model whose ids are not
    the model's: PLBart (fairseq's offset of 1), M2M100 and Speech2Text (a
    vocab.json in fairseq's dictionary order), Bartpho (a dictionary of its
    own)."""
    import json

    transformers = pytest.importorskip("transformers")
    model = tmp_path / "sp.model"
    model.write_bytes(sp.serialized_model_proto())
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i))]
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for p in reversed(pieces):
        vocab.setdefault(p, len(vocab))
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "dict.txt").write_text("".join(f"{p} 1\n" for p in reversed(pieces)))
    yield transformers.PLBartTokenizer(vocab_file=str(model))
    for cls in (transformers.M2M100Tokenizer, transformers.Speech2TextTokenizer):
        yield cls(vocab_file=str(tmp_path / "vocab.json"), spm_file=str(model))
    yield transformers.BartphoTokenizer(vocab_file=str(model), monolingual_vocab_file=str(tmp_path / "dict.txt"))


def test_transformers_sentencepiece_wrappers_with_their_own_ids(sp, tmp_path):
    """The table is indexed by the tokenizer's ids, not by the SentencePiece
    model's: read through the model's ids, every id had a neighbour's bytes."""
    for tok in sentencepiece_wrappers(sp, tmp_path):
        table = lmmetrics.token_bytes(tok)
        assert table.shape == (len(tok),), type(tok).__name__
        assert not table[tok.all_special_ids].any(), type(tok).__name__
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.convert_ids_to_tokens(ids) == [sp.id_to_piece(i) for i in sp.encode(text)]
            assert table[ids].sum() == utf8(text), (type(tok).__name__, text)


def test_wordpiece_counts_no_whitespace():
    """BERT's pre-tokenizer drops the whitespace, which no token holds: the
    sum is the text's bytes without it, as documented; "##" is no byte."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    table = lmmetrics.token_bytes(tok)
    assert table[[tok.token_to_id(t) for t in ("[UNK]", "[CLS]", "[SEP]")]].tolist() == [0, 0, 0]
    pieces = []
    for text in ["The quickest brown foxes jumped.", "naïve cafés résumé\tЗдравствуйте,  мир!"]:
        enc = tok.encode(text)
        assert "[UNK]" not in enc.tokens
        assert table[enc.ids].sum() == utf8("".join(text.split()))
        pieces += enc.tokens
    assert any(t.startswith("##") for t in pieces)


def test_wordpiece_prefix_without_a_decoder():
    """A raw WordPiece tokenizer need have no decoder: the "##" of its
    continuation pieces is the model's (continuing_subword_prefix) and no
    byte ("quickest" as quick ##e ##s ##t counted 14 bytes, not 8)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    for prefix in ("##", "@@"):
        tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix=prefix))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
            vocab_size=400, special_tokens=["[UNK]"], continuing_subword_prefix=prefix, show_progress=False))
        assert tok.decoder is None
        table = lmmetrics.token_bytes(tok)
        text = "The quickest brown foxes jumped."
        enc = tok.encode(text)
        assert any(t.startswith(prefix) for t in enc.tokens) and "[UNK]" not in enc.tokens
        assert table[enc.ids].sum() == utf8("".join(text.split()))


def test_sentencepiece_backend_added_tokens_that_are_pieces_count_as_pieces(tmp_path):
    """Gemma's tokenizer over its SentencePiece model: the user-defined
    pieces (whitespace runs "▁▁") are also non-special added tokens
    (tokenizer_config's added_tokens_decoder); the model emits them for
    spaces: a space a byte, as the model's own table (each counted the 6
    bytes of "▁▁")."""
    transformers = pytest.importorskip("transformers")
    backend = getattr(transformers, "SentencePieceBackend", None)
    if backend is None:
        pytest.skip("no transformers.SentencePieceBackend")
    sp = train_sentencepiece(add_dummy_prefix=False, user_defined_symbols=["\u2581\u2581", "<td>"])
    path = tmp_path / "sp.model"
    path.write_bytes(sp.serialized_model_proto())
    runs, td = sp.piece_to_id("\u2581\u2581"), sp.piece_to_id("<td>")
    tok = backend(vocab_file=str(path), added_tokens_decoder={
        i: transformers.AddedToken(sp.id_to_piece(i), special=False, normalized=False) for i in (runs, td)})
    table = lmmetrics.token_bytes(tok)
    assert table[[runs, td]].tolist() == [2, 4]
    np.testing.assert_array_equal(table, lmmetrics.token_bytes(sp))
    for text in ["a  b", "The  quick   fox <td> jumps"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert runs in ids
        assert table[ids].sum() == lmmetrics.token_bytes(sp)[sp.encode(text)].sum(), text


def test_transformers_sentencepiece_added_token_past_a_gap(sp, tmp_path):
    """An added token whose id leaves a gap after the model's pieces: the
    gap's ids have no token (0), the added token its own entry."""
    tok = _sentencepiece_backend(sp, tmp_path)
    from tokenizers import AddedToken

    n = sp.get_piece_size()
    tok.add_tokens([AddedToken("<near>", special=False)])
    tok._added_tokens_decoder[n + 5] = AddedToken("<far>", special=False)
    tok._added_tokens_encoder["<far>"] = n + 5
    table = lmmetrics.token_bytes(tok)
    assert table[n:].tolist() == [6, 0, 0, 0, 0, 5]
    np.testing.assert_array_equal(table[:n], lmmetrics.token_bytes(sp))


# ----------------------------------------------------------------- tiktoken, sizes, errors

def test_tiktoken_encoding():
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([b]): b for b in range(256)}
    for piece in (b"th", b"the", b" the", b"\xc3\xa9", b"\xe6\x97", b"ca", b"caf"):
        ranks[piece] = len(ranks)
    enc = tiktoken.Encoding("local", pat_str=r"""\s?\S+|\s+""", mergeable_ranks=ranks,
                            special_tokens={"<|eot|>": len(ranks)})
    table = lmmetrics.token_bytes(enc)
    assert table.shape == (enc.n_vocab,) and table[enc.encode_single_token("<|eot|>")] == 0
    for text in TEXTS:
        assert table[enc.encode(text)].sum() == utf8(text)


def test_size_and_errors(sp):
    table = lmmetrics.token_bytes(sp, size=512)
    assert table.shape == (512,) and not table[sp.get_piece_size():].any()
    with pytest.raises(ValueError, match="size"):
        lmmetrics.token_bytes(sp, size=10)
    with pytest.raises(TypeError, match="unsupported tokenizer"):
        lmmetrics.token_bytes(object())


def test_size_accepts_numpy_integers(sp):
    """A width read off an array's shape or a config is often a numpy integer."""
    n = sp.get_piece_size()
    table = lmmetrics.token_bytes(sp, size=np.int64(512))
    assert table.shape == (512,) and type(table.shape[0]) is int
    np.testing.assert_array_equal(table[:n], lmmetrics.token_bytes(sp))
    assert lmmetrics.token_bytes(sp, size=np.uint16(n)).shape == (n,)
    for bad in (True, np.True_, 512.0, np.float64(512), "512", np.int64(10)):
        with pytest.raises(ValueError, match="size"):
            lmmetrics.token_bytes(sp, size=bad)


# ----------------------------------------------------------------- end-of-word suffix BPE (openai-gpt, CLIP)

SUFFIX_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "naïve café 日本語 and again",
    "hello, world. this is a small corpus: 0123456789!",
]
CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def train_suffix_bpe(byte_level):
    """vocab and merges of a BPE with openai-gpt's / CLIP's "</w>" suffix,
    trained here with the pre-tokenizer the transformers class uses."""
    tokenizers = pytest.importorskip("tokenizers")
    import json

    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(end_of_word_suffix="</w>", continuing_subword_prefix="",
                                          unk_token="<unk>"))
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([t.lower() for t in CORPUS], trainers.BpeTrainer(
        vocab_size=400, end_of_word_suffix="</w>", show_progress=False,
        special_tokens=["<unk>", "<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else []))
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    # like the real vocabularies: every base character alone and word-final
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else set("".join(CORPUS + SUFFIX_TEXTS).lower())
    for piece in [p for a in sorted(alphabet) for p in (a, a + "</w>")]:
        vocab.setdefault(piece, len(vocab))
    return vocab, [tuple(m) for m in model["merges"]]


@pytest.fixture(scope="module", params=["openai-gpt", "clip"])
def suffix_tokenizer(request):
    transformers = pytest.importorskip("transformers")
    if request.param == "openai-gpt":
        return transformers.OpenAIGPTTokenizer(*train_suffix_bpe(byte_level=False))
    return transformers.CLIPTokenizer(*train_suffix_bpe(byte_level=True))


@pytest.mark.parametrize("text", SUFFIX_TEXTS)
def test_end_of_word_suffix_is_one_byte(suffix_tokenizer, text):
    """The suffix is the word boundary, which the tokenizer decodes as one
    space: the sum is the byte length of the decoded text and of its final
    boundary (never the 4 bytes of "</w>" per word)."""
    tok = suffix_tokenizer
    table = lmmetrics.token_bytes(tok)
    ids = tok.encode(text, add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens[-1].endswith("</w>") and "<unk>" not in tokens
    decoded = tok.decode(ids)
    assert table[ids].sum() == utf8(decoded) + 1
    if set(text) <= set("abcdefghijklmnopqrstuvwxyz "):
        # lowercase ASCII words separated by single spaces decode to the text itself
        assert decoded == text and table[ids].sum() == utf8(text) + 1
    special = [i for i in tok.all_special_ids if i < len(table)]
    assert special and not table[special].any()


# ----------------------------------------------------------------- nanochat's tokenizer objects

class NanochatHF:
    """The shape of nanochat's HuggingFaceTokenizer (nanochat/tokenizer.py):
    a tokenizers.Tokenizer as .tokenizer, special tokens added to it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def get_vocab_size(self):
        return self.tokenizer.get_vocab_size()


class NanochatRustBPE:
    """The shape of nanochat's RustBPETokenizer: a tiktoken Encoding as .enc."""

    def __init__(self, enc):
        self.enc = enc

    def encode(self, text):
        return self.enc.encode_ordinary(text)


def test_nanochat_huggingface_tokenizer(byte_level):
    tok = NanochatHF(byte_level.__class__.from_str(byte_level.to_str()))
    tok.tokenizer.add_special_tokens(["<|bos|>", "<|user_start|>"])
    table = lmmetrics.token_bytes(tok)
    assert table.shape == (tok.tokenizer.get_vocab_size(with_added_tokens=True),)
    assert table[tok.tokenizer.token_to_id("<|bos|>")] == 0
    for text in TEXTS:
        assert table[tok.encode(text)].sum() == utf8(text)


def test_nanochat_rustbpe_tokenizer():
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"th"] = 256
    enc = tiktoken.Encoding("local", pat_str=r"""\s?\S+|\s+""", mergeable_ranks=ranks,
                            special_tokens={"<|bos|>": 257})
    table = lmmetrics.token_bytes(NanochatRustBPE(enc))
    assert table.shape == (258,) and table[257] == 0
    for text in TEXTS:
        assert table[enc.encode_ordinary(text)].sum() == utf8(text)


def test_byt5_bytes():
    """ByT5's tokenizer (bytes as ids after pad, EOS and unknown; its extra
    ids special): each byte's id is one byte, so an encoding sums to the
    text's UTF-8 length (its EOS counts 0); a non-special added token counts
    its text."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.ByT5Tokenizer()
    table = lmmetrics.token_bytes(tok)
    assert table.shape == (len(tok),)
    for text in ("The quick brown fox", "héllo wörld ✓ 日本語 🙂", "a\nb\tc"):
        ids = tok(text)["input_ids"]
        assert ids[-1] == tok.eos_token_id and table[ids].sum() == len(text.encode("utf-8")), text
    assert table[tok.pad_token_id] == table[tok.unk_token_id] == table[tok.convert_tokens_to_ids("<extra_id_0>")] == 0
    tok.add_tokens(["<näh>"])
    table = lmmetrics.token_bytes(tok, size=len(tok) + 4)
    assert table[tok.convert_tokens_to_ids("<näh>")] == len("<näh>".encode()) and table[-4:].sum() == 0
