"""Bad words (vLLM's `bad_words`): token sequences that must not be generated.

Tokenization (once per request, `bad_words_token_ids`, called by
`SamplingParams.update_from_tokenizer`): each word, leading whitespace stripped, is encoded as
given and with one leading space, since a word can start a text or follow a space (BPE
vocabularies usually spell " word" with other tokens than "word"); special-token names are
encoded as plain text. The spaced form is kept unless it adds nothing: when it equals the plain
form, or ends with it (then banning the plain form already bans it). vLLM keeps the spaced form
only when it has as many tokens as the plain one and starts differently, which would let " the"
through on a vocabulary where "the" takes two tokens and " the" one; this rule bans both.
A word that is only whitespace is kept as it is. Duplicate sequences are dropped.

Banning (every step, `banned_tokens`): for each sequence, its last token is banned when the
output generated so far ends with the sequence's other tokens; a one-token sequence is always
banned. Like vLLM, only the generated output is matched, not the prompt. Sequences with a token
outside the vocabulary can never be completed and are skipped.
"""

from __future__ import annotations

from typing import Any, Sequence


def _forms(word: str) -> list[str]:
    stripped = word.lstrip()
    return [stripped, " " + stripped] if stripped else [word]


def _ends_with(seq: Sequence[int], tail: Sequence[int]) -> bool:
    return len(seq) >= len(tail) and list(seq[len(seq) - len(tail):]) == list(tail)


def bad_words_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Token sequences to ban for `words` (see the module doc); `tokenizer.encode(text,
    allow_special=False)` gives the ids. Raises ValueError naming bad_words for a word that
    encodes to no token."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for i, word in enumerate(words):
        plain: list[int] | None = None
        for form in _forms(word):
            ids = [int(t) for t in tokenizer.encode(form, allow_special=False)]
            if plain is None:
                if not ids:
                    raise ValueError(f"bad_words[{i}] ({word!r}) encodes to no token")
                plain = ids
            elif _ends_with(ids, plain):
                continue  # the plain form's ban covers it
            if tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append(ids)
    return out


def banned_tokens(sequences: Sequence[Sequence[int]], output_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The tokens that would complete one of `sequences` after `output_ids` (ids in [0, vocab_size))."""
    banned: list[int] = []
    n = len(output_ids)
    for seq in sequences:
        last, k = seq[-1], len(seq) - 1
        if k > n or not 0 <= last < vocab_size:
            continue
        # cheap test first: most prefixes already differ in their last token
        if k == 0 or (output_ids[-1] == seq[-2] and list(output_ids[n - k:]) == list(seq[:k])):
            banned.append(last)
    return banned
