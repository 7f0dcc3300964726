"""Speculative decoding, the torch-free parts: the config, the n-gram proposer, acceptance stats.

The model runner verifies drafts (worker/spec_verify.py, sample/rejection_sampler.py); proposers
that run a model live beside it (worker/draft_proposer.py).
"""
