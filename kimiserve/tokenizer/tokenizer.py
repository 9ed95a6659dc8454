"""KimiTokenizer: Kimi's byte-level BPE + 256 special slots + K2-style chat template.

Two interchangeable backends produce the same ids:
  * `tokenizers` (HF) when the folder has a tokenizer.json;
  * `tiktoken` when it only has Kimi's tiktoken.model (base64 token, rank per line).
Special ids live right after the base vocab: slot k of 256 is id num_base + k, named from
tokenizer_config.json `added_tokens_decoder`, unnamed slots being `<|reserved_token_{id}|>`.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _kimi_pattern(upper: str, lower: str) -> str:
    """Kimi's 8-alternative pre-tokenisation regex with the given non-Han upper/lower letter classes."""
    words = r"[^\r\n\p{L}\p{N}]?%s%s(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    return "|".join([r"[\p{Han}]+", words % (upper + "*", lower + "+"), words % (upper + "+", lower + "*"),
                     r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


# Kimi's pat_str verbatim, as the release tokenizer hands it to tiktoken (fancy-regex `&&` intersection).
PAT_STR = _kimi_pattern(r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]")
# The same language without class intersection: `[X&&[^\p{Han}]]` -> `(?:(?!\p{Han})[X])` matches the same
# single characters. Written to tokenizer.json (Oniguruma; also portable to engines lacking `&&`).
ONIG_PAT_STR = _kimi_pattern(r"(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])", r"(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])")

NUM_SPECIAL_SLOTS = 256
# Named special slots of the K2 family, as offsets from the first special id (163584 in Kimi).
SPECIAL_SLOT_NAMES: dict[int, str] = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
# Markers Kimi declares `special: false`, so skip_special_tokens keeps them for the tool/reasoning parsers.
NON_SKIPPED_MARKERS = frozenset({
    "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
})
ADDITIONAL_SPECIAL_TOKENS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                             "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
CHAT_END_TOKEN = "<|im_end|>"

# Kimi's long-input guard (tiktoken issue #195): 400k-char windows, then no run of more than
# 25k consecutive whitespace / non-whitespace characters in one piece.
MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACE_CHARS = 25_000

TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")
PACKAGED_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
ROLES = ("system", "user", "assistant", "tool")


def reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def added_token_entry(name: str, special: bool) -> dict[str, Any]:
    return {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}


def kimi_added_tokens_decoder(num_base: int) -> dict[str, dict[str, Any]]:
    """`added_tokens_decoder` for Kimi's layout placed after `num_base` base tokens (every slot listed)."""
    names = [SPECIAL_SLOT_NAMES.get(k, reserved_name(num_base + k)) for k in range(NUM_SPECIAL_SLOTS)]
    return {str(num_base + k): added_token_entry(n, n not in NON_SKIPPED_MARKERS) for k, n in enumerate(names)}


def kimi_tokenizer_config(num_base: int) -> dict[str, Any]:
    """tokenizer_config.json in the shape of Kimi's release files (no remote-code auto_map)."""
    return {
        "added_tokens_decoder": kimi_added_tokens_decoder(num_base),
        "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (used by byte-level tokenizer.json vocabs)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items(), key=lambda kv: ord(kv[1])))


def split_long_text(text: str) -> list[str]:
    """Kimi's encode-time pre-splitting; a no-op (one piece) for text of <= 25k characters."""
    if len(text) <= MAX_NO_WHITESPACE_CHARS:
        return [text]
    pieces = []
    for w in range(0, len(text), MAX_ENCODE_CHARS):
        window, start = text[w:w + MAX_ENCODE_CHARS], 0
        for run in re.finditer(r"\s+|\S+", window):
            # a run starting at p is cut at p + n*limit for every such point strictly inside the run
            for cut in range(run.start() + MAX_NO_WHITESPACE_CHARS, run.end(), MAX_NO_WHITESPACE_CHARS):
                pieces.append(window[start:cut])
                start = cut
        pieces.append(window[start:])
    return pieces


def _token_name(value: Any) -> str | None:
    return value.get("content") if isinstance(value, Mapping) else value


def _deep_sorted(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _deep_sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_deep_sorted(v) for v in obj]
    return obj


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Same signature as transformers' chat-template filter; unlike jinja's own, no HTML escaping.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TiktokenBackend:
    kind = "tiktoken"

    def __init__(self, ranks: dict[bytes, int], specials: dict[str, int], name: str):
        import tiktoken
        self.enc = tiktoken.Encoding(name=name, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)

    def encode(self, pieces: list[str], allow_special: bool) -> list[int]:
        if allow_special:
            return [i for p in pieces for i in self.enc.encode(p, allowed_special="all")]
        return [i for p in pieces for i in self.enc.encode_ordinary(p)]


class _TokenizersBackend:
    kind = "tokenizers"

    def __init__(self, json_str: str):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_str(json_str)
        plain = json.loads(json_str)
        plain["added_tokens"] = []  # a twin that cannot see special-token text: allow_special=False
        self.plain = Tokenizer.from_str(json.dumps(plain))

    def encode(self, pieces: list[str], allow_special: bool) -> list[int]:
        tok = self.tok if allow_special else self.plain
        if len(pieces) == 1:
            return tok.encode(pieces[0], add_special_tokens=False).ids
        return [i for enc in tok.encode_batch(pieces, add_special_tokens=False) for i in enc.ids]


class KimiTokenizer:
    """Kimi tokenizer over either backend. Build it with `load_tokenizer`."""

    def __init__(self, backend, token_bytes: list[bytes], num_base: int, added: dict[int, tuple[str, bool]],
                 config: dict[str, Any], chat_template: str, tokenizer_json: str | None = None):
        self._backend = backend
        self._token_bytes = token_bytes
        self._num_base = num_base
        self._added = dict(sorted(added.items()))  # id -> (name, special flag)
        self._special = {name: i for i, (name, _) in self._added.items()}
        self._skip = frozenset(i for i, (_, special) in self._added.items() if special)
        self._config = {k: v for k, v in config.items() if k != "chat_template"}
        self.chat_template = chat_template
        self._tokenizer_json = tokenizer_json
        self._compiled = None
        self._template_variables: frozenset[str] | None = None

    # ---- vocabulary ------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.kind

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token: a text of B UTF-8 bytes encodes to at least B / this many tokens."""
        return max(map(len, self._token_bytes))

    @property
    def num_base_tokens(self) -> int:
        return self._num_base

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def token_to_id(self, name: str) -> int | None:
        if name in self._special:
            return self._special[name]
        ids = self._backend.encode([name], False)
        return ids[0] if len(ids) == 1 and self._token_bytes[ids[0]] == name.encode() else None

    def _config_token_id(self, key: str, default: str | None) -> int | None:
        return self._special.get(_token_name(self._config.get(key, default)))

    bos_token_id = property(lambda self: self._config_token_id("bos_token", "[BOS]"))

    @property
    def eos_token_id(self) -> int | None:
        """`<|im_end|>`: every chat turn ends with it, so generation stops on it."""
        return self._special.get(CHAT_END_TOKEN, self._config_token_id("eos_token", "[EOS]"))

    @property
    def stop_token_ids(self) -> list[int]:
        ids = [self.eos_token_id, self._config_token_id("eos_token", "[EOS]")]
        return list(dict.fromkeys(i for i in ids if i is not None))

    pad_token_id = property(lambda self: self._config_token_id("pad_token", "[PAD]"))
    unk_token_id = property(lambda self: self._config_token_id("unk_token", "[UNK]"))

    # ---- encode / decode -------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        try:
            return self._backend.encode(split_long_text(text), allow_special)
        except (UnicodeEncodeError, TypeError):  # lone surrogates: replace them as tiktoken does
            fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            if fixed == text:
                raise
            return self._backend.encode(split_long_text(fixed), allow_special)

    def decode_token_bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {len(self._token_bytes)})")
        return self._token_bytes[token_id]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skip]
        return b"".join(self.decode_token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    # ---- chat template ---------------------------------------------------------------------
    def set_chat_template(self, template: str) -> None:
        """Use this Jinja chat template instead of the folder's (ValueError if it does not compile)."""
        self._compiled = _compile_template(template)
        self._template_variables = None
        self.chat_template = template

    def apply_chat_template(self, messages, /, tools=None, add_generation_prompt: bool = True,
                            tokenize: bool = False, **template_kwargs) -> str | list[int]:
        """Render a conversation. Extra keywords become template variables; ValueError for one that
        would replace the template's own inputs or its globals (`messages`, `namespace`, ...), and for
        a conversation the template cannot render (its `raise_exception`, or a Jinja error)."""
        import jinja2

        _check_messages(messages)
        _check_tools(tools)
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        clash = sorted(set(template_kwargs) & (TEMPLATE_INPUTS | set(self._compiled.environment.globals)))
        if clash:
            raise ValueError(f"chat_template_kwargs: {', '.join(map(repr, clash))} cannot be set: the chat "
                             f"template defines {'it' if len(clash) == 1 else 'them'} itself")
        context = dict(template_kwargs)
        context.update(messages=list(messages), tools=_deep_sorted(tools) if tools else None,
                       add_generation_prompt=add_generation_prompt)
        try:
            text = self._compiled.render(context)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template cannot render these messages: {e}") from e
        except (TypeError, AttributeError, KeyError, IndexError, ArithmeticError) as e:  # a value of the wrong shape
            raise ValueError(f"the chat template cannot render these messages ({type(e).__name__}: {e})") from e
        return self.encode(text, allow_special=True) if tokenize else text

    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads beyond its own inputs and globals: the names that
        `chat_template_kwargs` can usefully set (e.g. a thinking switch)."""
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        if self._template_variables is None:
            from jinja2 import meta

            env = self._compiled.environment
            names = meta.find_undeclared_variables(env.parse(self.chat_template))
            self._template_variables = frozenset(names - TEMPLATE_INPUTS - set(env.globals))
        return self._template_variables

    # ---- persistence -----------------------------------------------------------------------
    def save_pretrained(self, folder) -> list[Path]:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = dict(self._config)
        config["added_tokens_decoder"] = {str(i): added_token_entry(*v) for i, v in self._added.items()}
        files = {
            "tiktoken.model": "".join(f"{base64.b64encode(b).decode()} {rank}\n"
                                      for rank, b in enumerate(self._token_bytes[:self._num_base])),
            "tokenizer_config.json": json.dumps(dict(sorted(config.items())), indent=2, ensure_ascii=False) + "\n",
            "chat_template.jinja": self.chat_template,
        }
        if self._tokenizer_json is not None:
            files["tokenizer.json"] = self._tokenizer_json
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8", newline="")
        return [folder / name for name in files]

    def __repr__(self) -> str:
        return f"KimiTokenizer(backend={self.backend!r}, vocab_size={self.vocab_size})"


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


def _expect(ok: bool, where: str, problem: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {problem}")


def _kind(value: Any) -> str:
    return type(value).__name__


def _check_content(where: str, content: Any, required: bool) -> None:
    _expect(content is not None or not required, where, "missing (expected a string or a list of content parts)")
    _expect(content is None or isinstance(content, (str, list, tuple)), where,
            f"expected a string, a list of content parts or None, got {_kind(content)}")
    for j, part in enumerate(content if isinstance(content, (list, tuple)) else ()):
        _expect(isinstance(part, Mapping), f"{where}[{j}]", f"expected a dict content part, got {_kind(part)}")
        kind = part.get("type", "text")
        if kind not in ("image", "image_url") and "image" not in part and "image_url" not in part:
            _expect(kind == "text", f"{where}[{j}].type", f"unsupported content part type {kind!r}")
            _expect(isinstance(part.get("text"), str), f"{where}[{j}].text",
                    f"expected a string, got {_kind(part.get('text'))}")


def _check_function(where: str, fn: Any, what: str) -> None:
    _expect(isinstance(fn, Mapping), where, f"expected a dict with {what}")
    _expect(isinstance(fn.get("name"), str) and bool(fn["name"]), f"{where}.name", "expected a non-empty string")


def _check_messages(messages) -> None:
    _expect(isinstance(messages, (list, tuple)), "messages", f"expected a list of dicts, got {_kind(messages)}")
    for i, msg in enumerate(messages):
        at = f"messages[{i}]"
        _expect(isinstance(msg, Mapping), at, f"expected a dict, got {_kind(msg)}")
        _expect("role" in msg, f"{at}.role", "missing")
        role = msg["role"]
        _expect(role in ROLES, f"{at}.role", f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        _check_content(f"{at}.content", msg.get("content"), required=role != "assistant")
        for key in ("name", "reasoning_content", "tool_call_id"):
            _expect(msg.get(key) is None or isinstance(msg[key], str), f"{at}.{key}",
                    f"expected a string, got {_kind(msg.get(key))}")
        calls = msg.get("tool_calls")
        if calls is None:
            continue
        _expect(role == "assistant", f"{at}.tool_calls", f"only assistant messages carry tool calls, not {role!r}")
        _expect(isinstance(calls, (list, tuple)), f"{at}.tool_calls", f"expected a list, got {_kind(calls)}")
        for j, call in enumerate(calls):
            cat = f"{at}.tool_calls[{j}]"
            _expect(isinstance(call, Mapping), cat, f"expected a dict, got {_kind(call)}")
            _check_function(f"{cat}.function", call.get("function"), "'name' and 'arguments'")
            args = call["function"].get("arguments")
            _expect(args is None or isinstance(args, (str, Mapping)), f"{cat}.function.arguments",
                    f"expected a JSON string or a dict, got {_kind(args)}")
            _expect(call.get("id") is None or isinstance(call["id"], str), f"{cat}.id",
                    f"expected a string, got {_kind(call.get('id'))}")


def _check_tools(tools) -> None:
    if tools is None:
        return
    _expect(isinstance(tools, (list, tuple)), "tools", f"expected a list of function specs, got {_kind(tools)}")
    for i, tool in enumerate(tools):
        _expect(isinstance(tool, Mapping), f"tools[{i}]", f"expected a dict function spec, got {_kind(tool)}")
        _expect(tool.get("type") == "function", f"tools[{i}].type", f"expected 'function', got {tool.get('type')!r}")
        _check_function(f"tools[{i}].function", tool.get("function"), "'name', 'description' and 'parameters'")
        params = tool["function"].get("parameters")
        _expect(params is None or isinstance(params, Mapping), f"tools[{i}].function.parameters",
                "expected a JSON-schema dict")


# ---- loading -------------------------------------------------------------------------------
def _resolve_folder(path) -> Path:
    text = str(path)
    if "/" not in text and "\\" not in text and (PRESETS_DIR / text).is_dir():
        return PRESETS_DIR / text
    return Path(path)


TEMPLATE_INPUTS = frozenset({"messages", "tools", "add_generation_prompt"})
"""What apply_chat_template itself passes to the template."""


def _compile_template(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e


def _read_chat_template(folder: Path, config: dict[str, Any]) -> str:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # HF's list of named templates
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    if isinstance(tpl, str):
        return tpl
    return PACKAGED_TEMPLATE.read_text(encoding="utf-8")


def _read_ranks(path: Path) -> dict[bytes, int]:
    # Parsed here rather than with tiktoken.load, which caches local files by path in a temp dir.
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except Exception as exc:
                raise ValueError(f"{path}:{n}: not a '<base64 token> <rank>' line") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


def load_tokenizer(path) -> KimiTokenizer:
    """Load a tokenizer from a model folder (or the name of a built-in preset, e.g. "tiny")."""
    folder = _resolve_folder(path)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    template = _read_chat_template(folder, config)
    if (folder / "tokenizer.json").is_file():
        json_str = (folder / "tokenizer.json").read_text(encoding="utf-8")
        backend = _TokenizersBackend(json_str)
        tok = backend.tok
        num_base = tok.get_vocab_size(with_added_tokens=False)
        added = {i: (t.content, bool(t.special)) for i, t in tok.get_added_tokens_decoder().items()}
        size = max([num_base, *(i + 1 for i in added)])
        if sorted(added) != list(range(num_base, size)):
            raise ValueError(f"{folder / 'tokenizer.json'}: added tokens must fill ids {num_base}..{size - 1}")
        to_byte = {c: b for b, c in byte_to_unicode().items()}
        vocab = {i: s for s, i in tok.get_vocab(with_added_tokens=False).items()}
        token_bytes = [bytes(to_byte[c] for c in vocab[i]) for i in range(num_base)]
        token_bytes += [added[i][0].encode() for i in range(num_base, size)]
        return KimiTokenizer(backend, token_bytes, num_base, added, config, template, json_str)
    if (folder / "tiktoken.model").is_file():
        ranks = _read_ranks(folder / "tiktoken.model")
        num_base = len(ranks)
        named = {int(i): v if isinstance(v, Mapping) else {"content": v}
                 for i, v in (config.get("added_tokens_decoder") or {}).items() if int(i) >= num_base}
        size = max([num_base + NUM_SPECIAL_SLOTS, *(i + 1 for i in named)])
        added = {i: (named.get(i, {}).get("content") or reserved_name(i), bool(named.get(i, {}).get("special", True)))
                 for i in range(num_base, size)}
        backend = _TiktokenBackend(ranks, {name: i for i, (name, _) in added.items()}, "tiktoken.model")
        token_bytes = sorted(ranks, key=ranks.__getitem__) + [added[i][0].encode() for i in range(num_base, size)]
        return KimiTokenizer(backend, token_bytes, num_base, added, config, template)
    raise ValueError(f"no tokenizer in {folder}: looked for {' and '.join(TOKENIZER_FILES)}")
