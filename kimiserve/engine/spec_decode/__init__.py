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
    """Hook for sampling features speculation cannot serve exactly (a ValueError); none at present:
    structured outputs and the thinking budget give each verify row the state after the drafts
    before it (`runner._draft_states`)."""
