#!/usr/bin/env python3
"""Build kimiserve's tiny Kimi-layout tokenizer (kimiserve/presets/tiny) offline and deterministically.

Layout: ids 0..255 are the 256 single bytes (in GPT-2 byte-level order, as in tiktoken vocab files),
256..767 are 512 BPE merges learnt here, 768..1023 are Kimi's 256 special slots ([BOS]=768 ...
[PAD]=1023). The training text is built in this file (fixed passages + seeded synthetic lines),
pre-split with Kimi's pat_str.

The merge learner only accepts a new token when every token of the vocabulary still has exactly
one way of being written as two vocabulary tokens. With that property tiktoken's rank-driven
merging (merge any adjacent pair whose concatenation has the lowest rank) and HF's merge-list BPE
take the same steps, so tokenizer.json and tiktoken.model give identical ids; the script checks it.

Usage: python scripts/build_tiny_tokenizer.py [--out kimiserve/presets/tiny]
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import random
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kimiserve.tokenizer.tokenizer import (  # noqa: E402
    NUM_SPECIAL_SLOTS,
    ONIG_PAT_STR,
    PACKAGED_TEMPLATE,
    byte_to_unicode,
    kimi_tokenizer_config,
    load_tokenizer,
)

NUM_BASE = 768
SEED = 20250711

PASSAGES = [
    """The quick brown fox jumps over the lazy dog. A tokenizer turns text into a sequence of integer
ids, and a detokenizer turns the ids back into the very same text. Byte-level BPE starts from the
256 possible bytes and repeatedly merges the most frequent adjacent pair, so any string can be
encoded, even one it has never seen before. It's simple, it's fast, and it doesn't lose information.
We'll test it on English, on code, on numbers like 3.14159 or 1,024,000, and on other scripts.""",
    """Inference engines load the model weights, build a key-value cache, and then generate one token
at a time. The scheduler batches requests together; the sampler picks the next token with a
temperature, a top-p threshold, or greedily. When the model emits the end-of-turn token the request
is finished and the text is streamed back to the client as it is produced.""",
    """def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Cache:
    def __init__(self, size=4096):
        self.size = size
        self.blocks = {}

    def get(self, key, default=None):
        return self.blocks.get(key, default)


if __name__ == "__main__":
    print(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
""",
    """{"model": "kimi", "messages": [{"role": "system", "content": "You are a helpful assistant."},
{"role": "user", "content": "What's the weather like in Beijing today?"}], "temperature": 0.6,
"max_tokens": 512, "stream": true, "tools": [{"type": "function", "function": {"name": "get_weather",
"description": "Get weather information", "parameters": {"type": "object", "properties": {"city":
{"type": "string", "description": "City name"}}, "required": ["city"]}}}]}""",
    """人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。
今天北京的天气很好，阳光明媚，气温二十五度。我们一起去公园散步吧！你好，世界。这是一个测试句子，用来检查中文分词。
模型会把文本切分成词元，然后再把词元还原成原来的文本。""",
    """日本語のテキストも含めます。今日はいい天気ですね。トークナイザーはテキストをトークンに分割します。
한국어 문장도 있습니다. 오늘 날씨가 좋네요. 토크나이저는 텍스트를 토큰으로 나눕니다.""",
    """Привет, мир! Это пример текста на русском языке. Быстрая коричневая лиса прыгает через ленивую собаку.
Γειά σου κόσμε! Αυτό είναι ένα παράδειγμα. مرحبا بالعالم! هذا نص تجريبي باللغة العربية.
שלום עולם! नमस्ते दुनिया! यह एक परीक्षण वाक्य है। Xin chào thế giới! Tiếng Việt có dấu.""",
    """Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Ærøskøbing, Łódź, İstanbul, crème brûlée.
Emoji: 😀 🎉 👍🏽 🇨🇳 ❤️ 🚀 — and symbols: © ® ™ ° ± × ÷ ≤ ≥ ≠ ∞ ∑ ∫ √ π µ € £ ¥ ₹ → ← ↔ ★ ✓.
Math: E = mc², a² + b² = c², ∀x ∈ ℝ, f(x) = x³ − 2x + 1; 1/3 ≈ 0.333; 10^9 = 1e9; 50% off!""",
    """Shell: $ pip install kimiserve && kimiserve serve --model ./checkpoints/tiny --port 8000
    curl -s http://localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d @req.json
Markdown: # Title\n## Section\n- item one\n- item two\n**bold** and *italic* and `code`.
HTML: <div class="note"><p>Hello &amp; welcome</p></div>
URL: https://example.com/path/to/page?query=value&lang=en#anchor""",
]

WORDS = {
    "subject": ["The model", "A user", "The server", "Our team", "This function", "The scheduler",
                "Every request", "The cache", "A student", "The engineer", "She", "He", "They", "It"],
    "verb": ["reads", "writes", "computes", "returns", "streams", "loads", "saves", "checks", "builds",
             "encodes", "decodes", "samples", "predicts", "updates", "sends", "receives", "tests"],
    "object": ["the tokens", "a new batch", "the weights", "every layer", "the attention scores",
               "the final answer", "a short story", "the configuration", "two numbers", "the file",
               "the prompt", "its output", "the result", "some data", "the documentation"],
    "tail": ["quickly", "again", "in parallel", "on the GPU", "before noon", "without errors",
             "for the first time", "every second", "with care", "as expected", "today", "later"],
    "zh": ["模型", "服务器", "用户", "请求", "文本", "数据", "结果", "时间", "今天", "我们", "计算",
           "生成", "测试", "问题", "回答", "世界", "中国", "北京", "上海", "学习"],
}


def training_text() -> str:
    rng = random.Random(SEED)
    lines = list(PASSAGES)
    for _ in range(4000):
        s = " ".join([rng.choice(WORDS["subject"]), rng.choice(WORDS["verb"]),
                      rng.choice(WORDS["object"]), rng.choice(WORDS["tail"])])
        kind = rng.randrange(6)
        if kind == 0:
            s = s.upper() + "!"
        elif kind == 1:
            s += f" at {rng.randrange(24):02d}:{rng.randrange(60):02d} on 20{rng.randrange(10, 30)}-" \
                 f"{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}."
        elif kind == 2:
            s += f", costing ${rng.randrange(1, 10000)}.{rng.randrange(100):02d} ({rng.randrange(100)}%)."
        elif kind == 3:
            s = "".join(rng.choice(WORDS["zh"]) for _ in range(rng.randrange(3, 9))) + "。"
        elif kind == 4:
            s = f"x_{rng.randrange(100)} = compute(x_{rng.randrange(100)}, n={rng.randrange(1000)})  # {s.lower()}"
        else:
            s += "'s done; we're sure they'll see it, isn't it?"
        lines.append(s)
    return "\n".join(lines) + "\n"


def pre_tokenize(text: str) -> list[str]:
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(ONIG_PAT_STR), behavior="isolated")
    return [piece for line in text.splitlines(keepends=True) for piece, _ in split.pre_tokenize_str(line)]


class UniqueSplitBPE:
    """Greedy BPE learner whose vocabulary keeps one two-token decomposition per token."""

    def __init__(self, pieces: list[str]):
        self.vocab: list[bytes] = [bytes([b]) for b in byte_to_unicode()]  # id = rank
        self.index = {tok: i for i, tok in enumerate(self.vocab)}
        self.split_of: dict[int, tuple[int, int]] = {}
        counts = Counter(p.encode("utf-8") for p in pieces)
        self.words = [[self.index[bytes([b])] for b in w] for w in sorted(counts)]
        self.freqs = [counts[w] for w in sorted(counts)]
        self.pairs: Counter = Counter()
        self.where: dict[tuple[int, int], set[int]] = {}
        for wi, word in enumerate(self.words):
            self._count(wi, word, +1)
        self.heap = [self._entry(p) for p in self.pairs]
        heapq.heapify(self.heap)

    def _entry(self, pair):
        return (-self.pairs[pair], self.vocab[pair[0]], self.vocab[pair[1]], pair)

    def _count(self, wi, word, sign):
        for pair in zip(word, word[1:]):
            self.pairs[pair] += sign * self.freqs[wi]
            if sign > 0:
                self.where.setdefault(pair, set()).add(wi)

    def _two_token_splits(self, tok: bytes, extra: bytes = b"") -> list[tuple[bytes, bytes]]:
        known = lambda s: s in self.index or s == extra  # noqa: E731
        return [(tok[:k], tok[k:]) for k in range(1, len(tok)) if known(tok[:k]) and known(tok[k:])]

    def _acceptable(self, left: bytes, right: bytes) -> bool:
        new = left + right
        if new in self.index or self._two_token_splits(new) != [(left, right)]:
            return False
        # the new token must not give an existing longer token a second decomposition
        return all(len(self._two_token_splits(tok, new)) == 1
                   for tok in self.vocab if len(tok) > len(new) and (tok.startswith(new) or tok.endswith(new)))

    def learn(self, size: int) -> None:
        banned = set()
        while len(self.vocab) < size:
            neg, left, right, pair = heapq.heappop(self.heap)
            if -neg != self.pairs[pair] or pair in banned or -neg <= 0:
                continue  # stale heap entry
            if not self._acceptable(left, right):
                banned.add(pair)  # the vocabulary only grows, so it stays unacceptable
                continue
            self._merge(pair)

    def _merge(self, pair) -> None:
        new_id = len(self.vocab)
        self.vocab.append(self.vocab[pair[0]] + self.vocab[pair[1]])
        self.index[self.vocab[new_id]] = new_id
        self.split_of[new_id] = pair
        touched = set()
        for wi in sorted(self.where.pop(pair, ())):
            word = self.words[wi]
            if not any(p == pair for p in zip(word, word[1:])):
                continue
            self._count(wi, word, -1)
            out, k = [], 0
            while k < len(word):
                if k + 1 < len(word) and (word[k], word[k + 1]) == pair:
                    out.append(new_id)
                    k += 2
                else:
                    out.append(word[k])
                    k += 1
            self.words[wi] = out
            self._count(wi, out, +1)
            touched.update(zip(word, word[1:]), zip(out, out[1:]))
        for p in sorted(touched):
            if self.pairs[p] > 0:
                heapq.heappush(self.heap, self._entry(p))


def build_tokenizer_json(vocab: list[bytes], split_of: dict[int, tuple[int, int]], added: dict) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    to_char = byte_to_unicode()
    text = ["".join(to_char[b] for b in tok) for tok in vocab]
    merges = [(text[a], text[b]) for _, (a, b) in sorted(split_of.items())]
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(text)}, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(ONIG_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    for tid in sorted(added, key=int):
        entry = added[tid]
        token = AddedToken(entry["content"], single_word=False, lstrip=False, rstrip=False,
                           normalized=False, special=entry["special"])
        (tok.add_special_tokens if entry["special"] else tok.add_tokens)([token])
        assert tok.token_to_id(entry["content"]) == int(tid), entry
    return tok.to_str(pretty=True) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "kimiserve" / "presets" / "tiny"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)

    corpus = training_text()
    learner = UniqueSplitBPE(pre_tokenize(corpus))
    learner.learn(NUM_BASE)
    vocab = learner.vocab
    for tid, tok in enumerate(vocab[256:], 256):  # the invariant the learner promises
        assert learner._two_token_splits(tok) == [(vocab[learner.split_of[tid][0]], vocab[learner.split_of[tid][1]])]

    config = kimi_tokenizer_config(NUM_BASE)
    assert len(config["added_tokens_decoder"]) == NUM_SPECIAL_SLOTS
    template = PACKAGED_TEMPLATE.read_text(encoding="utf-8")
    files = {
        "tokenizer.json": build_tokenizer_json(vocab, learner.split_of, config["added_tokens_decoder"]),
        "tiktoken.model": "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(vocab)),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "chat_template.jinja": template,
    }
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8", newline="")

    # Both backends must agree on everything the corpus (and a stress text) contains.
    hf = load_tokenizer(out)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copy(out / name, Path(tmp) / name)
        tk = load_tokenizer(tmp)
        stress = corpus + "".join(chr(c) for c in range(0x20, 0x3000, 7)) + "  \t\n\n   x\r\n" * 20
        for line in stress.splitlines(keepends=True):
            a, b = hf.encode(line), tk.encode(line)
            assert a == b, (line, a, b)
            assert hf.decode(a) == line
    ids = hf.encode(corpus)
    print(f"wrote {', '.join(files)} to {out}: vocab {hf.vocab_size}, "
          f"corpus {len(corpus.encode())} bytes -> {len(ids)} tokens")


if __name__ == "__main__":
    main()
