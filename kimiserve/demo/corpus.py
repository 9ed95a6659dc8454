"""The demo model's synthetic corpus: conversations in the Kimi chat format, for training and evaluation.

Every example is a conversation (OpenAI-shaped messages, optional OpenAI-shaped tools) whose last
message is the assistant turn the model must produce. `render` turns one into token ids through
the Kimi chat template (`KimiTokenizer.apply_chat_template`) with a loss mask on what the model
generates: the final assistant turn as the model writes it after the generation prompt
(`<think>reasoning</think>content[tool calls]<|im_end|>`), plus earlier assistant turns whose
rendering in the history is exactly that (chat answers without reasoning, tool-call turns).

Kinds (`KINDS`): short chat answers, multi-turn follow-ups that refer back to an earlier turn,
arithmetic with worked steps in `<think>`, word problems, tool use (call with JSON arguments, answer
from the tool result; answer directly or decline when no declared tool fits), passkey retrieval
in filler, and file edits (a settings file in the prompt, one change asked for, the whole file
written back: most of the reply repeats the prompt, as an agent's file rewrite does). Templates are
simple and regular so that a ~10M-parameter byte-level model learns them in minutes. The same generator with another seed gives the held-out evaluation set.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END, TURN_END = "<think>", "</think>", "<|im_end|>"

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
    "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "China": "Beijing",
    "Russia": "Moscow", "Greece": "Athens", "Norway": "Oslo", "Cuba": "Havana", "Chile": "Santiago",
    "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin", "Portugal": "Lisbon", "Sweden": "Stockholm",
}
ANIMAL_SOUNDS = {"dog": "barks", "cat": "meows", "cow": "moos", "duck": "quacks", "sheep": "baas",
                 "lion": "roars", "horse": "neighs", "frog": "croaks", "owl": "hoots", "bee": "buzzes"}
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "up": "down", "day": "night", "happy": "sad",
             "light": "dark", "old": "new", "open": "closed", "early": "late", "wet": "dry", "full": "empty"}
NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Ivy", "Jack", "Kate", "Leo",
         "Mia", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tina", "Omar", "Yuki", "Zara", "Ben", "Lena"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown"]
FAVORITES = {"color": COLORS, "animal": list(ANIMAL_SOUNDS), "city": list(CAPITALS.values()),
             "number": [str(n) for n in range(1, 100)]}
ITEMS = ["apples", "books", "pens", "cookies", "marbles", "stickers", "cards", "coins", "shells", "stamps"]
CONDITIONS = ["sunny", "cloudy", "rainy", "snowy", "windy", "foggy"]
CITIES = list(CAPITALS.values()) + ["London", "New York", "Sydney", "Toronto", "Seoul", "Mumbai"]
TABLES = {"phone_numbers": lambda rng: f"555-{rng.randrange(10000):04d}",
          "departments": lambda rng: rng.choice(["sales", "research", "support", "finance", "design"]),
          "ages": lambda rng: str(rng.randrange(18, 70))}
GREETINGS = ["Hello!", "Hi!", "Hello", "Hi there!", "Good morning!", "Hey!"]
FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
          "The river flows on.", "Birds sing in the trees.", "The road is long."]
IDENTITY = "I am Kimi, an AI assistant created by Moonshot AI."


def _fn(name: str, description: str, **props: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
                       "required": list(props)}}}


TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _fn("get_weather", "Current weather of a city", city="city name"),
    "calculator": _fn("calculator", "Evaluate an arithmetic expression", expression="e.g. 12 * 7"),
    "get_time": _fn("get_time", "Current local time in a city", city="city name"),
    "lookup_table": _fn("lookup_table", "Look up a key in a table", table="table name", key="row key"),
}


@dataclass
class Example:
    """One conversation; `messages[-1]` is the assistant turn to produce (the target)."""

    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    answer: str | None = None
    """The value the final content must contain (arithmetic result, passkey, name, ...)."""
    expected_call: dict[str, Any] | None = None
    """For a tool-call target: {"name": ..., "arguments": {...}}."""
    filler_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_messages(self) -> list[dict[str, Any]]:
        return self.messages[:-1]


def assistant(content: str = "", reasoning: str = "", tool_calls: list | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def generation_text(msg: dict[str, Any]) -> str:
    """What the model writes for an assistant message after the generation prompt (the template's
    rendering of a turn that keeps its reasoning)."""
    text = THINK_START + (msg.get("reasoning_content") or "") + THINK_END + (msg.get("content") or "")
    calls = msg.get("tool_calls")
    if calls:
        text += "<|tool_calls_section_begin|>"
        for i, call in enumerate(calls):
            fn = call["function"]
            text += ("<|tool_call_begin|>" + (call.get("id") or f"functions.{fn['name']}:{i}")
                     + "<|tool_call_argument_begin|>" + fn["arguments"] + "<|tool_call_end|>")
        text += "<|tool_calls_section_end|>"
    return text + TURN_END


# ---------------------------------------------------------------------------------- arithmetic
PLACES = ("ones", "tens", "hundreds", "thousands")


def _digits(n: int, width: int) -> list[int]:
    """The `width` lowest decimal digits of n, ones first."""
    return [(n // 10 ** i) % 10 for i in range(width)]


def place_values(n: int) -> str:
    """`347 = 3 hundreds + 4 tens + 7 ones.`: every digit named by its place, so that a column step
    finds its digits by the place's name rather than by counting digits (many numbers are two-digit
    tokens of the byte-level vocabulary, e.g. `347` is `34` `7`)."""
    width = len(str(n))
    parts = [f"{d} {PLACES[i]}" for i, d in reversed(list(enumerate(_digits(n, width))))]
    return f"{n} = " + " + ".join(parts) + "."


def addition_steps(a: int, b: int) -> str:
    """Column addition, ones first, after naming each operand's digits by place. Every fact has two
    operands: a carry is added in a step of its own (`4 + 8 = 12, 12 + 1 = 13`)."""
    width = max(len(str(a)), len(str(b)))
    da, db = _digits(a, width), _digits(b, width)
    carry, steps = 0, [place_values(a), place_values(b)]
    for i in range(width):
        total = da[i] + db[i]
        step = f"{PLACES[i].capitalize()}: {da[i]} + {db[i]} = {total}"
        if carry:
            step += f", {total} + 1 = {total + 1}"
            total += 1
        carry = total // 10
        steps.append(step + f", write {total % 10}" + (" carry 1." if carry else "."))
    if carry:
        steps.append(f"{PLACES[width].capitalize()}: write the carry 1.")
    return " ".join(steps) + f" So {a} + {b} = {a + b}."


def subtraction_steps(a: int, b: int) -> str:
    """Column subtraction (a >= b), ones first, after naming each operand's digits by place; a borrow
    is taken off the next column's top digit in a step of its own (`4 - 1 = 3, 3 - 8 needs a borrow`),
    and passes on from a 0 (`0 - 1 needs a borrow, 10 - 1 = 9`)."""
    width = len(str(a))
    da, db = _digits(a, width), _digits(b, width)
    borrow, steps = 0, [place_values(a), place_values(b)]
    for i in range(width):
        top, step, out = da[i], f"{PLACES[i].capitalize()}: ", 0
        if borrow and top == 0:  # the borrow passes on: 0 - 1 borrows from the next column
            step += "0 - 1 needs a borrow, 10 - 1 = 9, "
            top, out = 9, 1
        elif borrow:
            step += f"{top} - 1 = {top - 1}, "
            top -= 1
        if top < db[i]:
            diff, out = top + 10 - db[i], 1
            step += f"{top} - {db[i]} needs a borrow, {top + 10} - {db[i]} = {diff}, write {diff} borrow 1."
        else:
            step += f"{top} - {db[i]} = {top - db[i]}, write {top - db[i]}" + (" borrow 1." if out else ".")
        borrow = out
        steps.append(step)
    return " ".join(steps) + f" So {a} - {b} = {a - b}."


def multiplication_steps(a: int, b: int) -> str:
    """a (up to two digits) times b (one digit): a one-digit a is one fact; otherwise ones then tens,
    the ones' carry added to the tens product in a step of its own."""
    if a < 10:
        return f"{a} * {b} = {a * b}."
    tens, ones = a // 10, a % 10
    low = ones * b
    high = tens * b
    step_ones = f"Ones: {ones} * {b} = {low}, write {low % 10}" + (f" carry {low // 10}." if low >= 10 else ".")
    step_tens = f"Tens: {tens} * {b} = {high}"
    if low >= 10:
        step_tens += f", {high} + {low // 10} = {high + low // 10}"
    step_tens += f", write {high + low // 10}."
    return f"{place_values(a)} {step_ones} {step_tens} So {a} * {b} = {a * b}."


def arithmetic(rng: random.Random) -> Example:
    op = rng.choice("+-*")
    big = rng.random() < 0.3
    if op == "+":
        hi = 999 if big else 99
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        steps, result, expr = addition_steps(a, b), a + b, f"{a} + {b}"
    elif op == "-":
        hi = 999 if big else 99
        a, b = sorted((rng.randint(0, hi), rng.randint(0, hi)), reverse=True)
        steps, result, expr = subtraction_steps(a, b), a - b, f"{a} - {b}"
    else:
        a, b = rng.randint(2, 99 if big else 12), rng.randint(2, 9)
        steps, result, expr = multiplication_steps(a, b), a * b, f"{a} * {b}"
    question = rng.choice(["What is {e}?", "Compute {e}.", "What is {e} equal to?", "Calculate {e}.", "{e} = ?"])
    return Example("arithmetic", [user(question.format(e=expr)), assistant(f"{expr} = {result}.", steps)],
                   answer=str(result))


def word_problem(rng: random.Random) -> Example:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    form = rng.randrange(3)
    if form == 0:
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        think = f"{name} starts with {a} {item} and gets {b} more, so we add. {addition_steps(a, b)}"
        result = a + b
        ans = f"{name} has {result} {item} now."
    elif form == 1:
        a = rng.randint(2, 40)
        b = rng.randint(1, a)
        q = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
        think = f"{name} starts with {a} {item} and gives away {b}, so we subtract. {subtraction_steps(a, b)}"
        result = a - b
        ans = f"{name} has {result} {item} left."
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        q = f"{name} has {a} boxes with {b} {item} in each box. How many {item} are there in total?"
        think = f"There are {a} boxes of {b} {item}, so we multiply. {multiplication_steps(a, b)}"
        result = a * b
        ans = f"There are {result} {item} in total."
    return Example("word_problem", [user(q), assistant(ans, think)], answer=str(result))


# ---------------------------------------------------------------------------------- chat
def _fact(rng: random.Random) -> tuple[str, str, str]:
    """(question, answer, key value) of one short fact."""
    form = rng.randrange(6)
    if form == 0:
        country = rng.choice(list(CAPITALS))
        q = rng.choice(["What is the capital of {c}?", "Which city is the capital of {c}?", "Capital of {c}?"])
        return q.format(c=country), f"The capital of {country} is {CAPITALS[country]}.", CAPITALS[country]
    if form == 1:
        animal = rng.choice(list(ANIMAL_SOUNDS))
        return f"What sound does a {animal} make?", f"A {animal} {ANIMAL_SOUNDS[animal]}.", ANIMAL_SOUNDS[animal]
    if form == 2:
        word = rng.choice(list(OPPOSITES))
        return f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}.", OPPOSITES[word]
    if form == 3:
        return rng.choice(GREETINGS), "Hello! How can I help you today?", "Hello"
    if form == 4:
        return rng.choice(["Who are you?", "What is your name?", "Who made you?"]), IDENTITY, "Kimi"
    n = rng.randint(0, 998)
    return f"What number comes after {n}?", f"The number after {n} is {n + 1}.", str(n + 1)


def chat(rng: random.Random) -> Example:
    q, a, key = _fact(rng)
    return Example("chat", [user(q), assistant(a)], answer=key)


def multi_turn(rng: random.Random) -> Example:
    form = rng.randrange(3)
    if form == 0:
        thing = rng.choice(list(FAVORITES))
        value = rng.choice(FAVORITES[thing])
        if thing == "number" or rng.random() < 0.5:
            first = [user(f"My favorite {thing} is {value}."), assistant(f"Got it, your favorite {thing} is {value}.")]
        else:
            first = [user(f"I really like the {thing} {value}, it is my favorite."),
                     assistant(f"Got it, your favorite {thing} is {value}.")]
        middle = []
        for _ in range(rng.randrange(3)):
            q, a, _ = _fact(rng)
            middle += [user(q), assistant(a)]
        ask = [user(rng.choice([f"What is my favorite {thing}?", f"Do you remember my favorite {thing}?"])),
               assistant(f"Your favorite {thing} is {value}.")]
        return Example("multi_turn", first + middle + ask, answer=value)
    if form == 1:
        name = rng.choice(NAMES)
        first = [user(f"Hi, my name is {name}."), assistant(f"Nice to meet you, {name}! How can I help you today?")]
        middle = []
        for _ in range(rng.randrange(3)):
            q, a, _ = _fact(rng)
            middle += [user(q), assistant(a)]
        ask = [user(rng.choice(["What is my name?", "Do you remember my name?"])), assistant(f"Your name is {name}.")]
        return Example("multi_turn", first + middle + ask, answer=name)
    a, b, c = rng.randint(0, 50), rng.randint(0, 49), rng.randint(1, 49)
    s = a + b
    return Example("multi_turn", [
        user(f"What is {a} + {b}?"), assistant(f"{a} + {b} = {s}.", addition_steps(a, b)),
        user(rng.choice([f"Now add {c} to that.", f"And if we add {c} more?"])),
        assistant(f"{s} + {c} = {s + c}.", f"The previous result was {s}. {addition_steps(s, c)}"),
    ], answer=str(s + c))


# ---------------------------------------------------------------------------------- tools
def _call(name: str, args: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return {"id": f"functions.{name}:{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def _declared(rng: random.Random, needed: str | None, exclude: str | None = None) -> list[dict[str, Any]]:
    others = [n for n in TOOLS if n != needed and n != exclude]
    names = rng.sample(others, rng.randint(0 if needed else 1, min(2, len(others))))
    if needed:
        names.insert(rng.randrange(len(names) + 1), needed)
    return [TOOLS[n] for n in names]


def _tool_task(rng: random.Random) -> tuple[str, str, dict, dict, str, str, str]:
    """(tool, user request, arguments, result, why, final answer, answer key)."""
    name = rng.choice(list(TOOLS))
    if name == "get_weather":
        city = rng.choice(CITIES)
        q = rng.choice(["What is the weather in {c}?", "How is the weather in {c} today?", "Weather in {c}?"]).format(c=city)
        result = {"city": city, "temperature_c": rng.randint(-10, 38), "condition": rng.choice(CONDITIONS)}
        final = f"It is {result['condition']} in {city} with a temperature of {result['temperature_c']} C."
        return name, q, {"city": city}, result, f"The user wants the weather in {city}.", final, str(result["temperature_c"])
    if name == "get_time":
        city = rng.choice(CITIES)
        q = rng.choice(["What time is it in {c}?", "What is the local time in {c}?"]).format(c=city)
        time = f"{rng.randrange(24):02d}:{rng.randrange(60):02d}"
        return (name, q, {"city": city}, {"city": city, "time": time}, f"The user wants the time in {city}.",
                f"The local time in {city} is {time}.", time)
    if name == "calculator":
        a, b = rng.randint(100, 9999), rng.randint(11, 999)
        op = rng.choice("*+-")
        expr = f"{a} {op} {b}"
        value = a * b if op == "*" else a + b if op == "+" else a - b
        q = rng.choice(["Use the calculator to compute {e}.", "What is {e}? Please use the calculator.",
                        "Calculate {e} with the calculator."]).format(e=expr)
        return (name, q, {"expression": expr}, {"result": value}, f"The user wants {expr} computed.",
                f"{expr} = {value}.", str(value))
    table = rng.choice(list(TABLES))
    key = rng.choice(NAMES)
    value = TABLES[table](rng)
    q = rng.choice(["Look up {k} in the {t} table.", "What does the {t} table say for {k}?"]).format(k=key, t=table)
    return (name, q, {"table": table, "key": key}, {"key": key, "value": value},
            f"The user wants {key} from the {table} table.", f"The {table} entry for {key} is {value}.", value)


def tool_use(rng: random.Random) -> Example:
    """A request a declared tool fits: call it, read the result, answer from it. The target is either
    the call turn (`tool_call`) or the answer after the result (`tool_answer`); in training both turns
    carry loss (the call turn keeps its reasoning in the history)."""
    name, q, args, result, why, final, key = _tool_task(rng)
    call = _call(name, args)
    messages = [user(q), assistant("", f"{why} I will call {name}.", [call]),
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)},
                assistant(final)]
    tools = _declared(rng, name)
    if rng.random() < 0.5:
        return Example("tool_call", messages[:2], tools, answer=key, expected_call={"name": name, "arguments": args},
                       meta={"result": result, "final": final})
    return Example("tool_answer", messages, tools, answer=key, expected_call={"name": name, "arguments": args})


def no_tool(rng: random.Random) -> Example:
    """Tools are declared but none fits: answer directly (a plain question) or decline (a request that
    needs an undeclared tool)."""
    if rng.random() < 0.5:
        q, a, key = _fact(rng)
        return Example("no_tool", [user(q), assistant(a)], _declared(rng, None), answer=key)
    name, q, _, _, _, _, _ = _tool_task(rng)
    what = {"get_weather": "check the weather", "get_time": "check the time", "calculator": "use a calculator",
            "lookup_table": "look up tables"}[name]
    return Example("decline", [user(q), assistant(f"Sorry, I cannot {what} because no suitable tool is available.")],
                   _declared(rng, None, exclude=name), answer="Sorry")


# ---------------------------------------------------------------------------------- file edits
SETTINGS = {
    "name": lambda rng: f'"{rng.choice(NAMES)}"', "owner": lambda rng: f'"{rng.choice(NAMES)}"',
    "city": lambda rng: f'"{rng.choice(CITIES)}"', "color": lambda rng: f'"{rng.choice(COLORS)}"',
    "theme": lambda rng: f'"{rng.choice(["light", "dark", "blue", "plain"])}"',
    "mode": lambda rng: f'"{rng.choice(["fast", "safe", "debug", "quiet", "full"])}"',
    "team": lambda rng: f'"{TABLES["departments"](rng)}"', "phone": lambda rng: f'"{TABLES["phone_numbers"](rng)}"',
    "port": lambda rng: str(rng.randint(1024, 9999)), "retries": lambda rng: str(rng.randint(0, 9)),
    "timeout_s": lambda rng: str(rng.randint(1, 120)), "max_items": lambda rng: str(rng.randint(10, 500)),
    "level": lambda rng: str(rng.randint(1, 5)), "version": lambda rng: f"{rng.randint(1, 9)}.{rng.randint(0, 20)}",
    "debug": lambda rng: rng.choice(["true", "false"]), "cache": lambda rng: rng.choice(["true", "false"]),
    "item": lambda rng: f'"{rng.choice(ITEMS)}"', "count": lambda rng: str(rng.randint(0, 99)),
}
FILE_NAMES = ["config.txt", "settings.ini", "app.cfg", "setup.conf", "options.txt"]


def edit(rng: random.Random) -> Example:
    """A settings file in the prompt and one change to make (set a value, remove a line, add a line); the
    reply is the whole file again with the change, in a code block."""
    keys = rng.sample(list(SETTINGS), rng.randint(7, 13))
    lines = [f"{k} = {SETTINGS[k](rng)}" for k in keys[:-1]]
    file_name = rng.choice(FILE_NAMES)
    form = rng.randrange(3)
    if form == 0:
        i = rng.randrange(len(lines))
        key, old = lines[i].split(" = ")
        new = next(v for v in iter(lambda: SETTINGS[key](rng), None) if v != old)
        ask = rng.choice(["Set {k} to {v}.", "Change {k} to {v}.", "Please make {k} {v}."]).format(k=key, v=new)
        edited = lines[:i] + [f"{key} = {new}"] + lines[i + 1:]
    elif form == 1:
        i = rng.randrange(len(lines))
        key = lines[i].split(" = ")[0]
        ask = rng.choice(["Remove the {k} line.", "Delete the {k} setting."]).format(k=key)
        edited = lines[:i] + lines[i + 1:]
    else:
        key = keys[-1]
        line = f"{key} = {SETTINGS[key](rng)}"
        ask = rng.choice(["Add {l} at the end.", "Append the line {l}."]).format(l=line)
        edited = lines + [line]
    text, result = "\n".join(lines), "\n".join(edited)
    q = f"Here is {file_name}:\n```\n{text}\n```\n{ask} Reply with the whole file."
    why = f"{ask} I will write the whole {file_name}."
    return Example("edit", [user(q), assistant(f"```\n{result}\n```", why)], answer=result)


# ---------------------------------------------------------------------------------- passkey
def passkey(rng: random.Random, filler_tokens: int, tokens_per_sentence: float = 11.25) -> Example:
    """A 5-digit pass key in about `filler_tokens` tokens of filler, asked for at the end."""
    key = str(rng.randint(10000, 99999))
    n = max(1, round(filler_tokens / tokens_per_sentence))
    sentences = [rng.choice(FILLER) for _ in range(n)]
    sentences.insert(rng.randint(0, n), f"The pass key is {key}. Remember it. {key} is the pass key.")
    text = ("There is an important pass key hidden in the text below. Find it and remember it.\n"
            + " ".join(sentences) + "\nWhat is the pass key?")
    return Example("passkey", [user(text), assistant(f"The pass key is {key}.")], answer=key,
                   filler_tokens=filler_tokens)


GENERATORS = {"chat": chat, "multi_turn": multi_turn, "arithmetic": arithmetic, "word_problem": word_problem,
              "tool_use": tool_use, "no_tool": no_tool, "edit": edit}
MIXTURE = {"chat": 0.07, "multi_turn": 0.11, "arithmetic": 0.36, "word_problem": 0.16, "tool_use": 0.14,
           "no_tool": 0.08, "passkey": 0.08, "edit": 0.12}
"""Shares of examples. By tokens (tool declarations and passkey filler are long, arithmetic short) this
is about a fifth arithmetic, a tenth word problems, a fifth tool use, a sixth passkey and an eighth
edits. The shipped models learnt edits in a fine-tune (`TrainArgs.init_from`) at a larger edit share;
a training from scratch with this mixture has not been run."""
KINDS = tuple(MIXTURE)


def parse_mixture(text: str) -> dict[str, float]:
    """`MIXTURE` with the shares a "kind=share,..." string names changed (e.g. "edit=0.4" for a fine-tune
    that teaches edits and keeps the rest in the proportions they had)."""
    mixture = dict(MIXTURE)
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, share = item.partition("=")
        if kind not in MIXTURE:
            raise ValueError(f"mixture: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        try:
            mixture[kind] = float(share)
        except ValueError:
            raise ValueError(f"mixture: {item!r} is not kind=share (a number)") from None
        if not mixture[kind] >= 0:
            raise ValueError(f"mixture: the share of {kind} must be >= 0, got {share}")
    if sum(mixture.values()) <= 0:
        raise ValueError("mixture: every share is 0")
    return mixture


def sample(rng: random.Random, max_filler_tokens: int = 900, mixture: dict[str, float] | None = None) -> Example:
    """One training example drawn from `mixture` (default `MIXTURE`; passkey filler uniform in [0,
    max_filler_tokens])."""
    mixture = mixture or MIXTURE
    kind = rng.choices(KINDS, weights=[mixture.get(k, 0.0) for k in KINDS])[0]
    if kind == "passkey":
        return passkey(rng, rng.randint(0, max_filler_tokens))
    return GENERATORS[kind](rng)


# ---------------------------------------------------------------------------------- rendering
def render(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a whole example: the prompt of its last turn as the chat template
    renders it, then the last turn as the model generates it. Mask 1 on the last turn and on earlier
    assistant turns the history renders as generated."""
    msgs, tools = example.messages, example.tools
    prompt = tokenizer.apply_chat_template(msgs[:-1], tools=tools, add_generation_prompt=True)
    # (start, end) character spans of the prompt that are earlier assistant turns rendered as generated
    spans = []
    for j, msg in enumerate(msgs[:-1]):
        if msg["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(msgs[:j], tools=tools, add_generation_prompt=True)
        gen = generation_text(msg)
        if prompt.startswith(head) and prompt.startswith(gen, len(head)):
            spans.append((len(head), len(head) + len(gen)))
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for start, end in spans:
        for text, m in ((prompt[pos:start], 0), (prompt[start:end], 1)):
            piece = tokenizer.encode(text, allow_special=True)
            ids += piece
            mask += [m] * len(piece)
        pos = end
    piece = tokenizer.encode(prompt[pos:], allow_special=True)
    ids += piece
    mask += [0] * len(piece)
    target = tokenizer.encode(generation_text(msgs[-1]), allow_special=True)
    return ids + target, mask + [1] * len(target)


def prompt_ids(tokenizer, example: Example) -> list[int]:
    """The generation prompt of the example's last turn (what an evaluation feeds the engine)."""
    return tokenizer.apply_chat_template(example.prompt_messages, tools=example.tools, add_generation_prompt=True,
                                         tokenize=True)
