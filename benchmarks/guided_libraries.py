"""Grammar libraries for guided decoding, side by side: xgrammar and llguidance on a Kimi-layout vocabulary.

What it measures, for one library per run (each library in its own environment, so neither's
dependencies help the other):

- tokenizer setup time (the library's view of the vocabulary);
- compile time of JSON schemas (nested objects, arrays with bounds, enums, bounded numbers,
  patterns, required fields; a wide 40-property schema), regexes, a choice list, a Lark/EBNF
  grammar and the Kimi tool-call section (special tokens around embedded JSON schemas), each
  compiled cold (a fresh compiler / no cache);
- the mask: per decode step, filling one bitmask per row at batch 1 and 64 (the library's
  batched fill) and advancing each matcher by one token, on random walks: each row draws a
  random allowed token (EOS with probability 1/2 once the grammar allows it);
- correctness on the byte-level vocabulary: every finished walk's bytes must decode as strict
  UTF-8 (tokens that split a character may only be allowed where the character can continue),
  parse with json.loads and validate with jsonschema; no special token may ever be allowed inside
  JSON text; the tool-call walks must have the section's special tokens where the grammar puts them;
- forks and rollback: copying a matcher mid-walk and rolling a matcher back k tokens must give the
  same masks as a fresh matcher fed the same prefix.

    python benchmarks/guided_libraries.py --library llguidance [--tokenizer tiny|DIR] [--out FILE]
    python benchmarks/guided_libraries.py --library xgrammar ...

`--tokenizer DIR` takes any Kimi-layout tokenizer folder (`load_tokenizer`); `--tekken FILE`
builds one from a Mistral tekken.json (150,000 byte-level BPE tokens, shipped inside the PyPI
package mistral-common as mistral_common/data/tekken_240911.json) followed by Kimi's 256 special
slots: a realistic 150,256-id vocabulary next to Kimi's 163,840. Results are in BENCHMARKS.md
("Guided decoding").
"""

from __future__ import annotations

import argparse
import base64
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kimiserve.tokenizer import load_tokenizer  # noqa: E402
from kimiserve.tokenizer.tokenizer import kimi_tokenizer_config  # noqa: E402

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "minLength": 1, "maxLength": 12, "pattern": "^[a-z]+$"},
        "status": {"enum": ["active", "inactive", "pending", "日本語", "café"]},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "note": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "login": {"type": "string", "maxLength": 8},
                "admin": {"type": "boolean"},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["login", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {"type": "object",
                      "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                     "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                      "required": ["sku", "qty"], "additionalProperties": False},
            "maxItems": 2,
        },
    },
    "required": ["id", "name", "status", "owner"],
    "additionalProperties": False,
}

WIDE = {
    "type": "object",
    "properties": {
        **{f"field_{i}": {"type": ["string", "integer", "boolean", "number"][i % 4],
                          **({"maxLength": 16} if i % 4 == 0 else {})} for i in range(36)},
        "kind": {"enum": [f"kind_{i}" for i in range(30)]},
        "when": {"type": "string", "format": "date-time"},
        "email": {"type": "string", "format": "email"},
        "children": {"type": "array", "items": {"type": "object", "properties": {
            "k": {"type": "string", "maxLength": 8}, "v": {"type": "integer"}}, "required": ["k"]}, "maxItems": 4},
    },
    "required": ["field_0", "field_1", "kind"],
    "additionalProperties": False,
}

REGEXES = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z0-9._%+-]{1,20}@[a-z0-9.-]{1,20}\.[a-z]{2,4}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
}
CHOICE = ["positive", "negative", "neutral", "mixed", "unknown", "très bien", "很好", "sehr gut"]
ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,4}/
"""
TOOLS = [
    ("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                     "required": ["city"], "additionalProperties": False}),
    ("search", {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                                 "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
                "required": ["query"], "additionalProperties": False}),
]
SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>")


def hostile_deep(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def hostile_enum(n: int) -> dict:
    return {"enum": [f"value_{i:06d}_{'x' * (i % 7)}" for i in range(n)]}


def tekken_tokenizer(path: Path, out: Path):
    """A Kimi-layout tokenizer folder from a tekken.json: its BPE tokens, then Kimi's 256 special slots."""
    vocab = json.loads(path.read_text())["vocab"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiktoken.model").write_text("".join(f"{e['token_bytes']} {e['rank']}\n" for e in vocab))
    (out / "tokenizer_config.json").write_text(json.dumps(kimi_tokenizer_config(len(vocab))))
    return load_tokenizer(out)


# ---- the two libraries behind one interface -----------------------------------------------------
class Llguidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance as llg
        import llguidance.torch as llgt

        self.llg, self.llgt, self.tok = llg, llgt, tok
        t0 = time.perf_counter()
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(tok)))
        self.setup_s = time.perf_counter() - t0
        self.executor = llg.LLExecutor()
        self.version = llg.__version__

    def compile(self, kind: str, spec):
        M = self.llg.LLMatcher
        if kind == "json":
            grammar = M.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))
        elif kind == "lark":
            grammar = M.grammar_from_lark(spec)
        elif kind == "tools":
            b, e, cb, ab, ce = SECTION
            alts = " | ".join(f'"functions.{n}:" IDX {ab} %json{json.dumps(s)}' for n, s in spec)
            grammar = M.grammar_from_lark(f"start: {b} call+ {e}\ncall: {cb} ({alts}) {ce}\nIDX: /[0-9]+/\n")
        else:
            raise ValueError(kind)
        matcher = M(self.lltok, grammar, log_level=0)  # builds the lexer and parser: the compile
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.lltok, compiled, log_level=0)

    def alloc(self, batch: int):
        return self.llgt.allocate_token_bitmask(batch, self.tok.vocab_size)

    def fill(self, matchers, mask):
        if len(matchers) == 1:
            self.llgt.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            self.llgt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, m, token) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()

    def fork(self, m):
        return m.deep_copy()

    def rollback(self, m, k):
        m.rollback(k)


class _Wrapped:
    """What llguidance's TokenizerWrapper reads: token bytes, special ids, eos/bos and encode."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_token_id, self.bos_token_id = tok.eos_token_id, tok.bos_token_id
        self.tokens = [tok.decode_token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = list(range(tok.num_base_tokens, tok.vocab_size))

    def __call__(self, s):
        return self.tok.encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s, allow_special=False)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        self.xgr, self.tok = xgr, tok
        # special tokens as empty strings: xgrammar then treats them as special (never text); the
        # names would make them ordinary text tokens that a JSON string could contain
        vocab = [tok.decode_token_bytes(i) if i < tok.num_base_tokens else b"" for i in range(tok.vocab_size)]
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                                      stop_token_ids=[tok.eos_token_id])
        self.setup_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher()
        import importlib.metadata as _md; self.version = _md.version("xgrammar")

    def compile(self, kind: str, spec):
        c = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        if kind == "lark":
            return c.compile_lark(spec)
        if kind == "tools":
            ids = {n: self.tok.special_tokens[n] for n in SECTION}
            b, e, cb, ab, ce = (ids[n] for n in SECTION)
            call = {"type": "or", "elements": [
                {"type": "sequence", "elements": [
                    {"type": "token", "token": cb}, {"type": "const_string", "value": f"functions.{n}:"},
                    {"type": "regex", "pattern": "[0-9]+"}, {"type": "token", "token": ab},
                    {"type": "json_schema", "json_schema": s}, {"type": "token", "token": ce}]} for n, s in spec]}
            tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
                {"type": "token", "token": b}, {"type": "plus", "content": call}, {"type": "token", "token": e}]}}
            return c.compile_structural_tag(self.xgr.StructuralTag.from_json(tag))
        raise ValueError(kind)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def alloc(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, self.tok.vocab_size)

    def fill(self, matchers, mask):
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, m, token) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()

    def fork(self, m):
        return m.fork()

    def rollback(self, m, k):
        m.rollback(k)


def allowed_ids(mask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask_row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


# ---- measurements ---------------------------------------------------------------------------------
def timed(fn, repeat: int = 3) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def walk(lib, compiled, batch: int, steps: int, seed: int):
    """`batch` matchers on random walks; per step: one batched fill, one accept per row. Returns the
    fill and accept times per step and each row's tokens and whether it finished."""
    rng = random.Random(seed)
    V, eos = lib.tok.vocab_size, lib.tok.eos_token_id
    ms = [lib.matcher(compiled) for _ in range(batch)]
    mask = lib.alloc(batch)
    toks: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    fill_t, acc_t, errors = [], [], []
    for _ in range(steps):
        live = [i for i in range(batch) if not done[i]]
        if not live:
            break
        sub = [ms[i] for i in live]
        t0 = time.perf_counter()
        lib.fill(sub, mask)
        fill_t.append((time.perf_counter() - t0, len(live)))
        picks = []
        for j, i in enumerate(live):
            ok = allowed_ids(mask[j], V)
            if not ok:
                errors.append(f"row {i}: the mask allows no token")
                done[i] = True
                continue
            t = eos if eos in ok and rng.random() < 0.5 else rng.choice(ok)
            picks.append((i, t))
        t0 = time.perf_counter()
        for i, t in picks:
            if not lib.accept(ms[i], t):
                errors.append(f"row {i} rejected an allowed token {t}")
                done[i] = True
                continue
            if t == eos:
                done[i] = True
            else:
                toks[i].append(t)
            if lib.done(ms[i]):
                done[i] = True
        acc_t.append((time.perf_counter() - t0, len(picks)))
    return fill_t, acc_t, toks, done, errors


def check_json(lib, toks, schema) -> tuple[int, list[str]]:
    import jsonschema

    specials = set(range(lib.tok.num_base_tokens, lib.tok.vocab_size))
    ok, problems = 0, []
    for t in toks:
        if specials & set(t):
            problems.append(f"special token inside JSON: {sorted(specials & set(t))}")
            continue
        raw = b"".join(lib.tok.decode_token_bytes(i) for i in t)
        try:
            value = json.loads(raw.decode("utf-8"))  # strict: a split character left open fails here
            jsonschema.validate(value, schema)
            ok += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported
            problems.append(f"{type(exc).__name__}: {str(exc)[:80]} in {raw[:80]!r}")
    return ok, problems


def check_tools(lib, toks) -> tuple[int, list[str]]:
    import re

    import jsonschema

    ids = {lib.tok.special_tokens[n]: n for n in SECTION}
    schemas = dict(TOOLS)
    ok, problems = 0, []
    for t in toks:
        text = "".join(ids[i] if i in ids else lib.tok.decode_token_bytes(i).decode("latin-1") for i in t)
        raw = b"".join(ids[i].encode() if i in ids else lib.tok.decode_token_bytes(i) for i in t).decode("utf-8", "strict")
        b, e, cb, ab, ce = (re.escape(x) for x in SECTION)
        m = re.fullmatch(f"{b}((?:{cb}.*?{ce})+){e}", raw, re.S)
        if not m or text.count(SECTION[0]) != 1:
            problems.append(f"section shape: {raw[:100]!r}")
            continue
        good = True
        for call in re.findall(f"{cb}(.*?){ce}", m.group(1), re.S):
            head, _, args = call.partition(SECTION[3])
            name = re.fullmatch(r"functions\.(\w+):[0-9]+", head)
            try:
                jsonschema.validate(json.loads(args), schemas[name.group(1)])
            except Exception as exc:  # noqa: BLE001
                problems.append(f"call {call[:60]!r}: {exc}"[:120])
                good = False
        ok += good
    return ok, problems


def check_fork_rollback(lib, compiled, seed: int) -> dict:
    """Masks after fork / rollback equal those of a fresh matcher fed the same prefix."""
    rng = random.Random(seed)
    V = lib.tok.vocab_size
    m = lib.matcher(compiled)
    mask = lib.alloc(1)
    prefix = []
    for _ in range(12):
        lib.fill([m], mask)
        ok = [t for t in allowed_ids(mask[0], V) if t != lib.tok.eos_token_id]
        if not ok:
            break
        t = rng.choice(ok)
        lib.accept(m, t)
        prefix.append(t)

    def mask_of(matcher):
        out = lib.alloc(1)
        lib.fill([matcher], out)
        return out.clone()

    fresh = lib.matcher(compiled)
    for t in prefix[:-4]:
        lib.accept(fresh, t)
    child = lib.fork(m)
    same_fork = torch.equal(mask_of(child), mask_of(m))
    lib.rollback(m, 4)
    same_rollback = torch.equal(mask_of(m), mask_of(fresh))
    return {"fork_equal": bool(same_fork), "rollback_equal": bool(same_rollback), "prefix_tokens": len(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--library", choices=["llguidance", "xgrammar"], required=True)
    ap.add_argument("--tokenizer", default="tiny")
    ap.add_argument("--tekken", type=Path, help="build a realistic vocabulary from this tekken.json")
    ap.add_argument("--walks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.tekken:
        tok = tekken_tokenizer(args.tekken, Path(tempfile.mkdtemp()) / "tekken_kimi")
        tok_name = f"tekken+kimi specials ({tok.vocab_size} ids)"
    else:
        tok = load_tokenizer(args.tokenizer)
        tok_name = f"{args.tokenizer} ({tok.vocab_size} ids)"
    lib = {"llguidance": Llguidance, "xgrammar": Xgrammar}[args.library](tok)
    res: dict = {"library": lib.name, "version": lib.version, "tokenizer": tok_name,
                 "cpu": platform.processor() or platform.machine(), "setup_ms": lib.setup_s * 1e3,
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                          text=True).stdout.strip(), "date": time.strftime("%Y-%m-%d")}
    cases = {"json_nested": ("json", NESTED), "json_wide": ("json", WIDE),
             **{f"regex_{k}": ("regex", v) for k, v in REGEXES.items()}, "choice": ("choice", CHOICE),
             "lark_arith": ("lark", ARITH_LARK), "tool_calls": ("tools", TOOLS),
             "hostile_deep_64": ("json", hostile_deep(64)), "hostile_enum_10000": ("json", hostile_enum(10000))}
    compiled, res["compile_ms"] = {}, {}
    for name, (kind, spec) in cases.items():
        try:
            secs, compiled[name] = timed(lambda: lib.compile(kind, spec), repeat=1 if name.startswith("hostile") else 3)
            res["compile_ms"][name] = round(secs * 1e3, 3)
        except Exception as exc:  # noqa: BLE001 - a library refusing a grammar is a result
            res["compile_ms"][name] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        print(f"compile {name}: {res['compile_ms'][name]}", flush=True)
    res["mask"] = {}
    for batch in (1, 64):
        fill_t, acc_t, toks, done, errors = walk(lib, compiled["json_nested"], batch, args.steps, seed=batch)
        full = [t for t, n in fill_t if n == batch] or [t for t, _ in fill_t]
        res["mask"][f"batch_{batch}"] = {
            "fill_ms_per_step_median": round(statistics.median(full) * 1e3, 4),
            "fill_us_per_row_median": round(statistics.median(t / n for t, n in fill_t) * 1e6, 2),
            "accept_us_per_row_median": round(statistics.median(t / n for t, n in acc_t) * 1e6, 2),
            "steps": len(fill_t), "rows_finished": sum(done), "errors": errors[:3]}
        print(f"mask batch {batch}: {res['mask'][f'batch_{batch}']}", flush=True)
    checks = {}
    for name, schema in (("json_nested", NESTED), ("json_wide", WIDE)):
        _, _, toks, done, errors = walk(lib, compiled[name], args.walks, 400, seed=7)
        fin = [t for t, d in zip(toks, done) if d]
        ok, problems = check_json(lib, fin, schema)
        checks[name] = {"walks": args.walks, "finished": len(fin), "valid": ok, "problems": problems[:3] + errors[:3]}
    _, _, toks, done, errors = walk(lib, compiled["tool_calls"], args.walks, 400, seed=8)
    fin = [t for t, d in zip(toks, done) if d]
    ok, problems = check_tools(lib, fin)
    checks["tool_calls"] = {"walks": args.walks, "finished": len(fin), "valid": ok, "problems": problems[:3] + errors[:3]}
    for name in ("choice", "regex_date"):
        _, _, toks, done, errors = walk(lib, compiled[name], args.walks, 100, seed=9)
        fin = [b"".join(tok.decode_token_bytes(i) for i in t).decode("utf-8", "replace") for t, d in zip(toks, done) if d]
        import re

        good = sum(s in CHOICE for s in fin) if name == "choice" else sum(bool(re.fullmatch(REGEXES["date"], s)) for s in fin)
        checks[name] = {"walks": args.walks, "finished": len(fin), "valid": good, "problems": errors[:3]}
    checks["fork_rollback"] = check_fork_rollback(lib, compiled["json_nested"], seed=3)
    res["checks"] = checks
    for k, v in checks.items():
        print(f"check {k}: {v}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
