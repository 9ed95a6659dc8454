"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) outside the target model,
verification of K drafted tokens in one chunk of K + 1 per sequence, KDA/short-conv state rollback
by replay from the committed state (see `verify.py`)."""

from __future__ import annotations


def make_proposer(config, engine):
    """The proposer of a SpeculativeConfig, for an engine (the draft model needs its device and args)."""
    if config.method == "ngram":
        from kimiserve.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    from kimiserve.engine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, engine)


def check_request(params) -> None:
    """ValueError for a request that speculation cannot serve exactly yet: structured outputs (a grammar
    would have to accept the drafts and roll back the rejected ones; the guided-decoding matcher's
    rollback is the hook to wire here)."""
    for name in ("structured_outputs", "guided_decoding"):
        if getattr(params, name, None) is not None:
            raise ValueError("structured outputs (guided decoding) are not supported with speculative decoding "
                             "yet: drop the request's structured output / response_format, or serve without "
                             "speculative_config")
    if getattr(params, "thinking_token_budget", None) is not None:  # verify rows would not force </think>
        raise ValueError("thinking_token_budget is not supported with speculative decoding yet: drop it, or serve "
                         "without speculative_config")
