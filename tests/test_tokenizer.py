"""Tests for kimiserve.tokenizer: the tiny preset, both backends, the chat template."""

from __future__ import annotations

import base64
import json
import shutil

import pytest

from kimiserve.tokenizer import KimiTokenizer, load_tokenizer
from kimiserve.tokenizer import tokenizer as tk_mod

pytestmark = pytest.mark.fixed_threads  # no torch (tokenizer, chat template): OMP_NUM_THREADS changes nothing

TINY = tk_mod.PRESETS_DIR / "tiny"

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's, I'M, we'll, they'd, YOU'RE, don't; she'S 'quoted' ſs K",
    "Numbers: 1 12 123 1234 12345 3.14159 1,024,000 -42 0x1F 1e-9 ½ ² ４５６ Ⅻ",
    "  leading   spaces\tand\ttabs\n\n\nnew lines\r\nCRLF \u3000ideographic\u00a0nbsp \u2028ls\u0085nel ",
    "人工智能是计算机科学的一个分支。今天北京的天气很好！〇々",
    "日本語のテキスト、カタカナとひらがな。한국어 문장입니다. 𠀀𪛖",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم ١٢٣ שלום नमस्ते",
    "Emoji: 😀🎉 👍🏽 🇨🇳 ❤️ 👨‍👩‍👧 and symbols © ™ ≤ ≥ ∞ → ★ ✓ €",
    "Café naïve résumé Zürich Ærøskøbing Łódź İstanbul e\u0301 a\u0308\u0301 ǅungla",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tpass\n",
    '{"role": "user", "content": "What\'s the weather?", "n": 42}',
    "<div class=\"x\">a &amp; b</div> https://example.com/a?b=c#d $ echo $HOME && ls -la | wc -l",
    "",
    " ",
    "\n",
    "a" * 300 + " " * 50 + "!" * 40,
]

SLOTS = {
    768: "[BOS]", 769: "[EOS]", 770: "<|im_end|>", 771: "<|im_user|>", 772: "<|im_assistant|>",
    773: "<|reserved_token_773|>", 774: "<|start_header_id|>", 775: "<|end_header_id|>",
    776: "<|reserved_token_776|>", 777: "[EOT]", 778: "<|im_system|>", 779: "<|tool_calls_section_begin|>",
    780: "<|tool_calls_section_end|>", 781: "<|tool_call_begin|>", 782: "<|tool_call_argument_begin|>",
    783: "<|tool_call_end|>", 784: "<|reserved_token_784|>", 785: "<|im_middle|>", 786: "<|media_begin|>",
    787: "<|media_content|>", 788: "<|media_end|>", 789: "<|media_pad|>", 790: "<think>", 791: "</think>",
    792: "<|reserved_token_792|>", 1021: "<|reserved_token_1021|>", 1022: "[UNK]", 1023: "[PAD]",
}


@pytest.fixture(scope="module")
def hf_tok() -> KimiTokenizer:
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def tt_tok(tmp_path_factory) -> KimiTokenizer:
    folder = tmp_path_factory.mktemp("tiny_tiktoken")
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)
    return load_tokenizer(folder)


@pytest.fixture(params=["tokenizers", "tiktoken"])
def tok(request, hf_tok, tt_tok) -> KimiTokenizer:
    return hf_tok if request.param == "tokenizers" else tt_tok


def test_backends_are_what_they_claim(hf_tok, tt_tok):
    assert hf_tok.backend == "tokenizers"
    assert tt_tok.backend == "tiktoken"


def test_tiny_layout(tok):
    assert tok.vocab_size == 1024
    assert tok.num_base_tokens == 768
    specials = tok.special_tokens
    assert len(specials) == 256 and sorted(specials.values()) == list(range(768, 1024))
    for tid, name in SLOTS.items():
        assert specials[name] == tid
        assert tok.token_to_id(name) == tid
    assert all(specials[f"<|reserved_token_{i}|>"] == i for i in range(792, 1022))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (768, 770, 1023, 1022)
    assert tok.stop_token_ids == [770, 769]
    assert tok.token_to_id("no such token, surely") is None
    # base vocab: the 256 single bytes come first, every base token is distinct
    assert sorted(tok.decode_token_bytes(i) for i in range(256)) == [bytes([b]) for b in range(256)]
    assert len({tok.decode_token_bytes(i) for i in range(768)}) == 768


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < 768 for i in ids)
    assert tok.decode(ids) == text
    assert b"".join(tok.decode_token_bytes(i) for i in ids) == text.encode("utf-8")


def test_every_special_token_is_one_id(tok):
    for name, tid in tok.special_tokens.items():
        assert tok.encode(name) == [tid], name
        assert tok.decode([tid]) == name
        assert tok.decode_token_bytes(tid) == name.encode()
        ids = tok.encode(f"x{name}y")
        assert tid in ids and tok.decode(ids) == f"x{name}y"


def test_allow_special_false_encodes_plain_text(tok):
    ids = tok.encode("<|im_end|>", allow_special=False)
    assert len(ids) > 1 and all(i < 768 for i in ids)
    assert tok.decode(ids) == "<|im_end|>"
    text = "a<|im_user|>b<think>c"
    plain = tok.encode(text, allow_special=False)
    assert all(i < 768 for i in plain) and tok.decode(plain) == text
    assert tok.encode(text) != plain


def test_tiktoken_and_tokenizers_paths_agree(hf_tok, tt_tok):
    corpus = CORPUS + [
        "".join(chr(c) for c in range(0x20, 0x2FFF, 3)),
        "<|im_system|>system<|im_middle|>sys<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>",
        (TINY / "tokenizer_config.json").read_text(encoding="utf-8"),
        (TINY / "chat_template.jinja").read_text(encoding="utf-8"),
        tk_mod.__doc__,
        json.dumps({"k": ["ü", "中文", 1.5, None, True]}, ensure_ascii=False),
    ]
    for text in corpus:
        for allow in (True, False):
            assert hf_tok.encode(text, allow) == tt_tok.encode(text, allow), text[:60]


KIMI_PAT_STR = (
    r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_patterns(hf_tok):
    assert tk_mod.PAT_STR == KIMI_PAT_STR
    assert "&&" not in tk_mod.ONIG_PAT_STR
    saved = json.loads((TINY / "tokenizer.json").read_text())["pre_tokenizer"]["pretokenizers"][0]
    assert saved["pattern"]["Regex"] == tk_mod.ONIG_PAT_STR and saved["behavior"] == "Isolated"


def test_pretokenizer_split_matches_tiktoken_and_regex(hf_tok):
    regex = pytest.importorskip("regex")
    tiktoken = pytest.importorskip("tiktoken")
    pre = hf_tok._backend.tok.pre_tokenizer  # Split(ONIG pattern) + ByteLevel, as saved in tokenizer.json
    to_byte = {c: b for b, c in tk_mod.byte_to_unicode().items()}
    reference = regex.compile("(?V1)" + tk_mod.PAT_STR)
    for text in CORPUS[:-4]:
        hf_pieces = [bytes(to_byte[c] for c in p).decode() for p, _ in pre.pre_tokenize_str(text)]
        assert hf_pieces == reference.findall(text), text
        # tiktoken's own split: with a vocabulary holding every expected piece whole, tiktoken emits
        # exactly one token per piece only if its regex cut the text the same way.
        ranks = {bytes([b]): b for b in range(256)}
        for piece in hf_pieces:
            ranks.setdefault(piece.encode(), len(ranks))
        enc = tiktoken.Encoding("split-probe", pat_str=tk_mod.PAT_STR, mergeable_ranks=ranks, special_tokens={})
        by_rank = {r: b for b, r in ranks.items()}
        assert [by_rank[i] for i in enc.encode_ordinary(text)] == [p.encode() for p in hf_pieces], text


def _reference_long_split(text: str, window: int, limit: int) -> list[str]:
    out = []
    for w in range(0, len(text), window):
        chunk = text[w:w + window]
        start, run, prev = 0, 0, None
        for i, ch in enumerate(chunk):
            space = ch.isspace()
            run = run + 1 if space == prev else 1
            prev = space
            if run > limit:
                out.append(chunk[start:i])
                start, run = i, 1
        out.append(chunk[start:])
    return out


def test_long_text_pre_splitting(monkeypatch, hf_tok, tt_tok):
    import random

    rng = random.Random(7)
    monkeypatch.setattr(tk_mod, "MAX_ENCODE_CHARS", 23)
    monkeypatch.setattr(tk_mod, "MAX_NO_WHITESPACE_CHARS", 4)
    for _ in range(300):
        text = "".join(rng.choice("ab \n\u3000x") * rng.randrange(1, 9) for _ in range(rng.randrange(1, 12)))
        assert tk_mod.split_long_text(text) == _reference_long_split(text, 23, 4), repr(text)
    monkeypatch.undo()
    text = "y" * 25_001 + " " * 3 + "中" * 10
    assert [len(p) for p in tk_mod.split_long_text(text)] == [25_000, 14]
    assert hf_tok.encode(text) == tt_tok.encode(text)
    assert hf_tok.decode(hf_tok.encode(text)) == text


def test_decode_details(tok):
    lead = next(i for i in range(256) if tok.decode_token_bytes(i) == b"\xe4")  # first byte of a CJK char
    assert tok.decode([lead]) == "\ufffd"
    assert tok.decode(tok.encode("ab") + [lead]) == "ab\ufffd"
    msg = tok.encode("<think>r</think>ok<|tool_calls_section_begin|><|im_end|>[EOS]<|reserved_token_900|>")
    assert tok.decode(msg, skip_special_tokens=True) == "<think>r</think>ok<|tool_calls_section_begin|>"
    assert tok.decode(msg) == "<think>r</think>ok<|tool_calls_section_begin|><|im_end|>[EOS]<|reserved_token_900|>"
    with pytest.raises(ValueError):
        tok.decode([1024])
    with pytest.raises(ValueError):
        tok.decode_token_bytes(-1)
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"  # lone surrogate


def test_tiny_files_have_kimi_shape():
    lines = (TINY / "tiktoken.model").read_text().splitlines()
    assert len(lines) == 768
    for rank, line in enumerate(lines):
        token, r = line.split(" ")
        assert int(r) == rank and base64.b64decode(token, validate=True)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    assert sorted(map(int, decoder)) == list(range(768, 1024))
    assert {int(k): v["content"] for k, v in decoder.items() if int(k) in SLOTS} == SLOTS
    assert decoder["790"]["special"] is False and decoder["781"]["special"] is False
    assert decoder["770"]["special"] is True and decoder["900"]["special"] is True
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == \
        ("[BOS]", "[EOS]", "[PAD]", "[UNK]")
    assert (TINY / "chat_template.jinja").read_text() == tk_mod.PACKAGED_TEMPLATE.read_text()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Beijing and Shanghai?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "Two cities, two calls.",
     "tool_calls": [
         {"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Beijing"}'}},
         {"id": "functions.get_weather:1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Shanghai"}}},
     ]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "functions.get_weather:0",
     "content": '{"weather": "Sunny"}'},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "Rainy"},
]

EXPECTED = (
    '<|im_system|>tool_declare<|im_middle|>[{"function":{"description":"Get weather","name":"get_weather",'
    '"parameters":{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},'
    '"type":"function"}]<|im_end|>'
    "<|im_system|>system<|im_middle|>You are a weather bot.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Beijing and Shanghai?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>Two cities, two calls.</think>Let me check."
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Shanghai"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    '<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n{"weather": "Sunny"}<|im_end|>'
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\nRainy<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>"
)

DEFAULT_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"


def test_chat_template_exact(tok):
    assert tok.apply_chat_template(CONVERSATION, tools=[WEATHER_TOOL]) == EXPECTED
    ids = tok.apply_chat_template(CONVERSATION, tools=[WEATHER_TOOL], tokenize=True)
    assert ids == tok.encode(EXPECTED) and tok.decode(ids) == EXPECTED
    role = tok.encode("assistant")
    assert ids[0] == 778 and ids[-len(role) - 2:] == [772, *role, 785]
    assert ids.count(781) == 2 and ids.count(783) == 2 and ids.count(770) == 6


def test_chat_template_without_generation_prompt_and_tools(tok):
    text = tok.apply_chat_template(CONVERSATION[:2], add_generation_prompt=False)
    assert text == ("<|im_system|>system<|im_middle|>You are a weather bot.<|im_end|>"
                    "<|im_user|>user<|im_middle|>Weather in Beijing and Shanghai?<|im_end|>")
    assert tok.apply_chat_template(CONVERSATION[:2], tools=[]) == text + "<|im_assistant|>assistant<|im_middle|>"


def test_default_system_prompt(tok):
    got = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert got == DEFAULT_SYSTEM + "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert tok.apply_chat_template([]) == DEFAULT_SYSTEM + "<|im_assistant|>assistant<|im_middle|>"
    with_tools = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL])
    assert with_tools.startswith("<|im_system|>tool_declare<|im_middle|>[{")
    assert with_tools.index("<|im_end|>" + DEFAULT_SYSTEM) > 0


def test_reasoning_content(tok):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "old thought"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need a tool",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
    ]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        DEFAULT_SYSTEM
        + "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        + "<|im_user|>user<|im_middle|>Weather?<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think>need a tool</think><|tool_calls_section_begin|>"
        + '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
        + "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        + "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>"
    )
    last = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert tok.apply_chat_template(last, add_generation_prompt=False).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>A<|im_end|>")
    no_reasoning = [{"role": "user", "content": "Q"},
                    {"role": "assistant", "content": None, "reasoning_content": None,
                     "tool_calls": [{"id": "functions.f:0", "function": {"name": "f", "arguments": "{}"}}]}]
    assert "<think></think><|tool_calls_section_begin|>" in tok.apply_chat_template(no_reasoning)


def test_template_details(tok):
    tools = [{"function": {"parameters": {"b": 1, "a": {"z": 0, "y": "ü<&>"}}, "name": "f"}, "type": "function"}]
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools)
    assert '[{"function":{"name":"f","parameters":{"a":{"y":"ü<&>","z":0},"b":1}},"type":"function"}]' in text
    parts = [{"role": "user", "name": "bob", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "u"}}, {"type": "text", "text": "?"}]}]
    assert ("<|im_user|>bob<|im_middle|>Look:<|media_start|>image<|media_content|><|media_pad|><|media_end|>\n?"
            "<|im_end|>") in tok.apply_chat_template(parts)
    custom = [{"role": "system", "content": "s"}]
    assert tok.apply_chat_template(custom, extra_var="ignored") == \
        "<|im_system|>system<|im_middle|>s<|im_end|><|im_assistant|>assistant<|im_middle|>"


@pytest.mark.parametrize("messages, tools, field", [
    ([{"content": "hi"}], None, "messages[0].role"),
    ([{"role": "user", "content": "a"}, {"content": "hi"}], None, "messages[1].role"),
    ([{"role": "wizard", "content": "hi"}], None, "messages[0].role"),
    ([{"role": "user", "content": 5}], None, "messages[0].content"),
    ([{"role": "user"}], None, "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], None, "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "audio"}]}], None, "messages[0].content[0].type"),
    (["hello"], None, "messages[0]"),
    ("hello", None, "messages"),
    ([{"role": "assistant", "reasoning_content": 1, "content": "a"}], None, "messages[0].reasoning_content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     None, "messages[1].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": "f()"}], None, "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}], None,
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "q", "tool_calls": []}], None, "messages[0].tool_calls"),
    ([{"role": "user", "content": "q"}], {"type": "function"}, "tools"),
    ([{"role": "user", "content": "q"}], [{"name": "f"}], "tools[0].type"),
    ([{"role": "user", "content": "q"}], [WEATHER_TOOL, {"type": "function"}], "tools[1].function"),
    ([{"role": "user", "content": "q"}], [{"type": "function", "function": {"description": "d"}}],
     "tools[0].function.name"),
])
def test_bad_input_raises(hf_tok, messages, tools, field):
    with pytest.raises(ValueError) as err:
        hf_tok.apply_chat_template(messages, tools=tools)
    assert str(err.value).startswith(field + ":"), str(err.value)


def test_save_pretrained_round_trip(tok, tmp_path):
    written = {p.name for p in tok.save_pretrained(tmp_path)}
    expected = {"tiktoken.model", "tokenizer_config.json", "chat_template.jinja"}
    assert written == (expected | {"tokenizer.json"} if tok.backend == "tokenizers" else expected)
    again = load_tokenizer(tmp_path)
    assert again.backend == tok.backend
    assert again.vocab_size == tok.vocab_size and again.special_tokens == tok.special_tokens
    assert [again.decode_token_bytes(i) for i in range(1024)] == [tok.decode_token_bytes(i) for i in range(1024)]
    assert again.chat_template == tok.chat_template
    assert again._added == tok._added and again._config == tok._config
    for text in CORPUS + [EXPECTED]:
        assert again.encode(text) == tok.encode(text)
    assert (tmp_path / "tiktoken.model").read_bytes() == (TINY / "tiktoken.model").read_bytes()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == \
        json.loads((TINY / "tokenizer_config.json").read_text())
    if tok.backend == "tokenizers":
        assert (tmp_path / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()


def test_chat_template_sources(tmp_path):
    shutil.copy(TINY / "tiktoken.model", tmp_path / "tiktoken.model")
    assert load_tokenizer(tmp_path).chat_template == tk_mod.PACKAGED_TEMPLATE.read_text()  # packaged fallback
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}!"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    (tmp_path / "chat_template.jinja").write_text("[{{ messages | length }}]")
    assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[1]"
    assert load_tokenizer(tmp_path).special_tokens["<|im_end|>"] == 770


def test_tiktoken_without_config_uses_reserved_names(tmp_path):
    shutil.copy(TINY / "tiktoken.model", tmp_path / "tiktoken.model")
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 1024
    assert tok.special_tokens["<|reserved_token_770|>"] == 770
    assert tok.bos_token_id is None and tok.eos_token_id is None


def test_missing_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json.*tiktoken\.model"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="tiktoken.model"):
        load_tokenizer(tmp_path / "does-not-exist")
