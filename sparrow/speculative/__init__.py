"""Speculative decoding pieces: proposing (proposer.py the contract, registry.py the methods by
name, sparrow_proposer.py / eagle3.py / specvlm.py the methods), accepting (accept.py), sampling."""

from .accept import AcceptResult, accept_greedy, accept_speculative
from .sampling import logits_to_probs, new_generator, sample

__all__ = ["AcceptResult", "accept_greedy", "accept_speculative", "logits_to_probs", "new_generator", "sample"]
